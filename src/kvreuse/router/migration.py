"""Mid-stream migration: a stream whose executor dies is continued on another one
(after NVIDIA Dynamo's request migration).

``migrating_stream`` relays a stream through a ``StreamLedger``. When the executor fails
(the connection breaks, the stream closes before ``[DONE]``, it stalls: no byte within
``--upstream-progress-timeout``, or none for a second after the executor was marked down,
``kvreuse.router.deadline``, or it sends an error event that is not the request's fault,
``upstream.executor_fault``: an engine failure, not a bad field), the router continues the
request elsewhere, from exactly what the client has: a ``/v1/completions`` stream whose
prompt is the original prompt's ids plus the ids sent (``StreamRequest.continuation_body``),
translated back into the client's format. A greedy reply is then the one an uninterrupted
run gives; a sampled one goes on from what the client has. When the client has no event
yet, the original request is sent again instead, whatever it asks for.

While a continuation waits for its executor's first byte, the client gets a keep-alive
comment every ``--stream-keepalive-interval`` (``kvreuse.router.keepalive``).

Each executor tried counts against ``Router.migration_limit`` (``--migration-limit``, 0:
off). When the router cannot continue (the limit, no other healthy executor, a request it
does not continue: ``n`` > 1, several prompts, logprobs, echo, a PML prompt, or executors
that send no token ids), the stream ends with the error event the official client raises
(``stream_error_event``), never silently. A reply that was already finished when its
executor died is ended by the router (usage, ``[DONE]``).

Counted in ``kvreuse:router_migrations_total{outcome}``: ``continued`` (another executor
took the stream), ``finished`` (the router ended a finished reply), ``failed`` (an executor
tried for the continuation failed too), ``limit``, ``no_executor``, ``unsupported``
(the stream ended with the error event).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

import httpx

from kvreuse.cache.kv_block import cdiv
from kvreuse.router.deadline import Stalled
from kvreuse.router.executors import ExecutorInfo
from kvreuse.router.keepalive import Waiting
from kvreuse.router.prompt_keys import RequestKeys
from kvreuse.router.router import Router
from kvreuse.router.sse import error_event, payload
from kvreuse.router.stream_ledger import StreamLedger
from kvreuse.router.stream_request import StreamRequest
from kvreuse.router.upstream import ExecutorFault, Retry, Upstream, fault_of_event, send

logger = logging.getLogger(__name__)

CONTINUATION_PATH = "/v1/completions"
MIGRATION_OFF = "migration is off (--migration-limit 0)"


def stream_error_event(executor: str, failure: str, refusal: str | None = None) -> bytes:
    """The SSE event that ends a stream whose executor failed mid-response; ``executor`` is
    its ``Executor.label`` (never its address); ``refusal`` says why it was not continued elsewhere."""
    message = f"the executor serving this stream ({executor}) failed mid-response: {failure}; "
    if refusal is not None:
        message += f"it could not be continued on another executor: {refusal}; "
    return error_event(message + "the output is incomplete")


async def relay_events(upstream: Upstream, ledger: StreamLedger) -> AsyncGenerator[bytes, None]:
    """The client's events for ``upstream``'s, until ``[DONE]`` or the end of the stream.
    Raises ``httpx.TransportError`` when the connection breaks, ``Stalled`` when it stalls,
    ``ExecutorFault`` for an error event that is not the request's fault (the event is not
    sent: an error event the request caused is, and ends the stream)."""
    async for event in upstream.events():
        fault = fault_of_event(event)
        if fault is not None:  # the executor's failure, not the request's: continued elsewhere
            raise ExecutorFault(fault)
        out = ledger.translate(event) if ledger.continuing else ledger.relay(event)
        if out:
            yield out
        if ledger.done:
            return


async def migrating_stream(
    router: Router,
    first: Upstream,
    request: StreamRequest,
    keys: RequestKeys,
    path: str,
    headers: dict[str, str],
    tried: list[str],
) -> AsyncGenerator[bytes, None]:
    """The client's stream for ``first`` (the executor serving ``request`` at ``path``),
    continued on other executors (not in ``tried``) when it fails."""
    ledger = StreamLedger(request)
    origin: ExecutorInfo | None = first.executor.info  # its defaults are the reply's
    upstream: Upstream | None = first
    attempts = 0
    try:
        while upstream is not None:
            try:
                async with aclosing(relay_events(upstream, ledger)) as events:
                    async for out in events:
                        yield out
                failure = None if ledger.done else "it closed the stream before [DONE]"
            except httpx.TransportError as exc:
                failure = f"the connection broke ({type(exc).__name__})"
                upstream.executor.mark_down(f"stream broke mid-response: {exc!r}")
            except Stalled as exc:  # hung, or marked down and silent: moved, never held
                failure = str(exc)
            except ExecutorFault as exc:  # e.g. its engine failed a step: the request may be fine elsewhere
                failure = f"it sent an error: {exc}"
            finally:
                await upstream.close()
            if failure is None or ledger.failed:
                return  # whole, or ended by the executor's own error event
            failed = upstream.executor
            tried.append(failed.name)
            logger.warning("stream from %s cut mid-response: %s", failed.url, failure)
            if ledger.finished:  # nothing left to generate: only the end is missing
                router.metrics.migration("finished")
                yield ledger.end()
                return
            upstream = None
            while upstream is None:
                refusal = _refusal(router, request, ledger, origin, attempts, tried)
                if refusal is not None:
                    outcome, reason = refusal
                    router.metrics.migration(outcome)
                    router.metrics.streams_cut.inc()
                    logger.warning("stream from %s not continued: %s", failed.url, reason)
                    yield stream_error_event(failed.label, failure, reason)
                    return
                attempts += 1
                waiting = Waiting(
                    _continue(router, request, ledger, origin, keys, path, headers, tried),
                    router.deadlines.keepalive_s,
                    orphan=_close,
                )
                async with aclosing(waiting.beats()) as beats:
                    async for beat in beats:  # keep-alive comments until the new executor's first byte
                        yield beat
                upstream, problem = waiting.result()
                if problem is not None:  # the executor answered, and not with a stream: say its words
                    router.metrics.migration("failed")
                    router.metrics.streams_cut.inc()
                    yield stream_error_event(failed.label, failure, problem)
                    return
                if upstream is None:
                    router.metrics.migration("failed")
            router.metrics.migration("continued")
            logger.info(
                "stream from %s continued on %s after %d tokens",
                failed.url,
                upstream.executor.url,
                len(ledger.output_ids),
            )
    finally:
        if upstream is not None:
            await upstream.close()


def _refusal(
    router: Router,
    request: StreamRequest,
    ledger: StreamLedger,
    origin: ExecutorInfo | None,
    attempts: int,
    tried: list[str],
) -> tuple[str, str] | None:
    """``(outcome, why)`` when the stream cannot be continued now; ``None`` when it can."""
    limit = router.migration_limit
    if attempts >= limit:
        return "limit", (MIGRATION_OFF if limit == 0 else f"the migration limit is reached (--migration-limit {limit})")
    if not router.candidates(RequestKeys(0, []), exclude=tried):
        return "no_executor", f"no other healthy executor (tried {router.labels(tried)})"
    if not ledger.sent:
        return None  # the original request is sent again, whatever it asks for
    # (what the body asks for was checked before it was first sent: proxy._refusal)
    if ledger.several_choices:
        return "unsupported", "the stream has several choices"
    if ledger.prompt_ids is None:
        return "unsupported", (
            "the executor sent no prompt_token_ids (a PML prompt has no token prompt to send "
            "again, and an executor without return_token_ids sends none)"
        )
    if router.hasher.tokenizer is None or origin is None or origin.eos_token_ids is None:
        return "unsupported", "the router lacks the executors' tokenizer or EOS ids (/v1/kvreuse/info eos_token_ids)"
    return None


async def _close(continued: tuple[Upstream | None, str | None]) -> None:
    """A continuation's stream that came when its client had left."""
    if continued[0] is not None:
        await continued[0].close()


async def _continue(
    router: Router,
    request: StreamRequest,
    ledger: StreamLedger,
    origin: ExecutorInfo | None,
    keys: RequestKeys,
    path: str,
    headers: dict[str, str],
    tried: list[str],
) -> tuple[Upstream | None, str | None]:
    """The next executor's stream: ``(upstream, None)``; ``(None, None)`` when that executor
    failed before its first byte (``tried`` has it; try another); ``(None, why)`` when it
    answered with an error."""
    routed = router.decide(keys, exclude=tried)
    assert routed is not None  # _refusal checked that there is a candidate
    executor = router.executors[routed.decision.choice]
    router.metrics.decision(routed.decision, routed.candidates)
    if ledger.sent:
        assert origin is not None and ledger.prompt_ids is not None
        budget = request.max_tokens(len(ledger.prompt_ids), origin)
        if not ledger.continuing:
            ledger.continue_with(
                request.stop_params(budget), router.hasher.tokenizer, frozenset(origin.eos_token_ids or ())
            )
        raw = request.continuation_body(ledger.prompt_ids, ledger.output_ids, budget)
        target, blocks = CONTINUATION_PATH, cdiv(len(ledger.prompt_ids) + len(ledger.output_ids), router.block_size)
    else:
        raw, target, blocks = request.upstream_body(), path, router.prompt_blocks(keys)
    executor.begin(blocks)
    try:
        result = await send(router.client, executor, target, raw, headers, blocks, None, deadlines=router.deadlines)
    except Retry as exc:
        executor.end(blocks)
        executor.failures += 1
        tried.append(executor.name)
        logger.info("continuing a stream: %s failed before its first byte: %s", executor.url, exc)
        return None, None
    except BaseException:  # the client left meanwhile (the response task is cancelled)
        executor.end(blocks)
        raise
    if isinstance(result, Upstream):
        return result, None
    body = payload(b"data: " + bytes(result.body) + b"\n\n") or {}
    message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
    return None, f"{executor.label} answered {result.status_code}: {message or bytes(result.body)[:200]!r}"
