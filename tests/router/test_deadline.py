"""The router's upstream deadlines (``kvreuse.router.deadline``): no wait on a hung or dead
executor outlasts its deadline. Executors are in-process transports that hang (await
forever) where told; the client reads the router app over ASGI. (A stalled stream continued
on a real executor app: test_deadline_migration.py; SIGSTOP of real processes:
test_deadline_e2e.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvreuse.router.app import build_router_app
from kvreuse.router.deadline import Deadlines, ReadClock, Stalled, within
from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router

MARGIN_S = 0.5  # scheduling slack on a loaded 2-core machine


def _event(text: str) -> bytes:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _forever() -> None:
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------- within


def _timed(coro_fn):
    async def run():
        start = time.monotonic()
        try:
            return await coro_fn(), time.monotonic() - start
        except Stalled as exc:
            return exc, time.monotonic() - start

    return asyncio.run(run())


def test_a_silent_read_ends_at_its_deadline_naming_the_setting():
    e = Executor("http://a", healthy=True)
    got, took = _timed(lambda: within(_forever(), e, since=time.monotonic(), limit_s=0.3, setting="--flag"))
    assert isinstance(got, Stalled) and got.timed_out and str(got) == "it sent no byte for 0.3 s (--flag)"
    assert 0.3 <= took < 0.3 + MARGIN_S
    assert e.healthy  # marking down is the caller's


def test_a_read_that_answers_in_time_returns_its_result():
    async def soon():
        await asyncio.sleep(0.05)
        return b"chunk"

    e = Executor("http://a", healthy=True)
    got, took = _timed(lambda: within(soon(), e, since=time.monotonic(), limit_s=2.0, setting="--flag"))
    assert got == b"chunk" and took < 1.0


def test_marking_the_executor_down_ends_a_silent_wait_after_the_grace():
    e = Executor("http://a", healthy=True)

    async def scenario():
        asyncio.get_running_loop().call_later(0.2, e.mark_down, "/health answered 503")
        return await within(_forever(), e, since=time.monotonic(), limit_s=None, setting="--flag", grace_s=0.3)

    got, took = _timed(scenario)
    assert isinstance(got, Stalled) and not got.timed_out
    assert str(got) == "it was marked down (/health answered 503) and sent no byte for 0.3 s after"
    assert 0.5 <= took < 0.5 + MARGIN_S
    assert not e.on_down  # nothing left registered


def test_the_reason_a_wait_ended_names_no_address():
    e = Executor("http://10.1.2.3:8001", healthy=True, id=1)

    async def scenario():
        why = "ConnectError('connect to http://10.1.2.3:8001/health failed: 10.1.2.3:8001 refused')"
        asyncio.get_running_loop().call_later(0.05, e.mark_down, why)
        return await within(_forever(), e, since=time.monotonic(), limit_s=None, setting="--flag", grace_s=0.1)

    got, _ = _timed(scenario)
    assert str(got) == (
        "it was marked down (ConnectError('connect to executor 1/health failed: executor 1 refused')) "
        "and sent no byte for 0.1 s after"
    )
    assert "10.1.2.3" in e.last_error  # the admin route keeps it whole


def test_a_down_executor_that_still_sends_keeps_its_read():
    async def late():
        await asyncio.sleep(0.3)  # after the mark, within the grace
        return b"chunk"

    e = Executor("http://a", healthy=True)

    async def scenario():
        asyncio.get_running_loop().call_later(0.1, e.mark_down, "probe timed out")
        return await within(late(), e, since=time.monotonic(), limit_s=None, setting="--flag", grace_s=1.0)

    got, _ = _timed(scenario)
    assert got == b"chunk"


def test_a_clock_times_each_read_from_its_start_not_the_first_reads():
    async def paced(gaps):
        for gap in gaps:
            await asyncio.sleep(gap)
            yield gap

    async def scenario():
        clock = ReadClock(Executor("http://a", healthy=True), limit_s=0.4, setting="--flag")
        chunks = paced([0.15] * 8 + [0.8])  # 1.2 s of steady chunks, then silence past the limit
        got, start = [], time.monotonic()
        try:
            while True:
                got.append(await clock.read(anext(chunks)))
        except Stalled as exc:
            return got, str(exc), time.monotonic() - start
        finally:
            clock.close()

    got, message, took = asyncio.run(scenario())
    assert got == [0.15] * 8 and message == "it sent no byte for 0.4 s (--flag)"
    assert 1.2 + 0.4 <= took < 1.2 + 0.4 + MARGIN_S


def test_a_clock_forgets_the_mark_once_the_executor_is_up_again():
    e = Executor("http://a", healthy=True)

    async def scenario():
        clock = ReadClock(e, limit_s=None, setting="--flag", grace_s=0.2)
        asyncio.get_running_loop().call_later(0.05, e.mark_down, "probe timed out")

        async def late(delay):
            await asyncio.sleep(delay)
            return delay

        try:
            first = await clock.read(late(0.15))  # within the grace after the mark
            e.healthy = True  # the health probe brought it back
            second = await clock.read(late(0.5))  # slower than the grace: fine, it is up
            e.mark_down("probe timed out again")
            try:
                await clock.read(_forever())
            except Stalled as exc:
                return first, second, str(exc)
        finally:
            clock.close()

    assert asyncio.run(scenario()) == (
        0.15,
        0.5,
        "it was marked down (probe timed out again) and sent no byte for 0.2 s after",
    )


def test_a_read_whose_executor_comes_back_within_the_grace_is_not_ended():
    # A stalled stream marks its executor down, and the next health probe brings it back
    # (Router.probe: healthy, last_error cleared) before the grace ends: the other reads of
    # that executor wait on (bench/ray/kill_replica.py once cut every stream of the live
    # replica here: "it was marked down () and sent no byte for 1 s after").
    e = Executor("http://a", healthy=True)

    def probe_ok() -> None:
        e.healthy, e.last_error = True, None

    async def late():
        await asyncio.sleep(0.5)  # longer than the grace
        return b"chunk"

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, e.mark_down, "a stream stalled")
        loop.call_later(0.1, probe_ok)
        return await within(late(), e, since=time.monotonic(), limit_s=None, setting="--flag", grace_s=0.2)

    got, _ = _timed(scenario)
    assert got == b"chunk"


def test_a_read_whose_executor_came_back_still_ends_at_its_deadline():
    e = Executor("http://a", healthy=True)

    def probe_ok() -> None:
        e.healthy, e.last_error = True, None

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, e.mark_down, "a stream stalled")
        loop.call_later(0.1, probe_ok)
        return await within(_forever(), e, since=time.monotonic(), limit_s=0.6, setting="--flag", grace_s=0.2)

    got, took = _timed(scenario)
    assert isinstance(got, Stalled) and str(got) == "it sent no byte for 0.6 s (--flag)"
    assert 0.6 <= took < 0.6 + MARGIN_S


def test_a_read_cancelled_from_outside_is_cancelled_not_stalled():
    async def scenario():
        clock = ReadClock(Executor("http://a", healthy=True), limit_s=0.3, setting="--flag")
        reader = asyncio.ensure_future(clock.read(_forever()))
        await asyncio.sleep(0.1)
        reader.cancel()  # the client left
        try:
            await reader
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            clock.close()

    assert asyncio.run(scenario()) == "cancelled"


@pytest.mark.parametrize(
    ("first_byte", "progress", "want"),
    [
        (300.0, 10.0, Deadlines(300.0, 10.0)),
        (0.0, 0.0, Deadlines(None, None)),
        (5.0, 0.0, Deadlines(5.0, None)),
    ],
)
def test_flag_values_become_deadlines_zero_meaning_none(first_byte, progress, want):
    assert Deadlines.of(first_byte, progress) == want


@pytest.mark.parametrize(
    ("first_byte", "progress", "flag"),
    [
        (-1.0, 10.0, "--upstream-first-byte-timeout"),
        (300.0, float("inf"), "--upstream-progress-timeout"),
        (float("nan"), 10.0, "--upstream-first-byte-timeout"),
    ],
)
def test_bad_flag_values_are_refused_naming_the_flag(first_byte, progress, flag):
    with pytest.raises(ValueError, match=f"^{flag} must be a finite number of seconds >= 0"):
        Deadlines.of(first_byte, progress)


# ---------------------------------------------------------------------------- through the router


def _route(handler, names, deadlines, calls, *, migration_limit=0):
    """``calls(http, router)`` against a router app over executors ``names`` answered by
    ``handler(request)`` (async)."""

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as upstream:
            hasher = PromptHasher(None, HashSettings("m", 4, "sha256"))
            router = Router(
                [Executor(n, healthy=True) for n in names],
                hasher,
                make_policy("round_robin"),
                client=upstream,
                seed=0,
                migration_limit=migration_limit,
                deadlines=deadlines,
            )
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_router_app(router)), base_url="http://r")
            try:
                return await calls(http, router)
            finally:
                await http.aclose()

    return asyncio.run(scenario())


class _Chunks(httpx.AsyncByteStream):
    """``chunks``, then (``stall``) nothing, ever: a SIGSTOPped executor keeps its socket open."""

    def __init__(self, chunks: list[bytes], *, stall: bool = True) -> None:
        self.chunks, self.stall = chunks, stall

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.stall:
            await _forever()


STREAM = {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True}


def test_a_stream_that_stalls_mid_response_ends_with_the_error_event_at_the_deadline():
    async def handler(request):
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Chunks([_event("Hello"), _event(" wor")])
        )

    async def calls(http, router):
        start = time.monotonic()
        raw = await http.post("/v1/completions", json=STREAM)
        return raw, time.monotonic() - start, router

    raw, took, router = _route(handler, ["http://a"], Deadlines(60.0, 0.4), calls)
    message = (
        "the executor serving this stream (executor 0) failed mid-response: it sent no byte for 0.4 s "
        "(--upstream-progress-timeout); it could not be continued on another executor: migration is off "
        "(--migration-limit 0); the output is incomplete"
    )
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "executor_failed"}}
    assert raw.status_code == 200
    error_event = b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n"
    assert raw.content == _event("Hello") + _event(" wor") + error_event
    assert 0.4 <= took < 0.4 + MARGIN_S
    e = router.executors["http://a"]
    assert not e.healthy and e.last_error == "a stream stalled: it sent no byte for 0.4 s (--upstream-progress-timeout)"
    assert e.in_flight == 0 and router.metrics.streams_cut._value.get() == 1


def test_a_stream_whose_executor_is_marked_down_ends_a_grace_after_the_mark():
    async def handler(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks([_event("Hi")]))

    async def calls(http, router):
        start = time.monotonic()
        asyncio.get_running_loop().call_later(0.3, router.executors["http://a"].mark_down, "/health answered 503")
        raw = await http.post("/v1/completions", json=STREAM)
        return raw, time.monotonic() - start

    raw, took = _route(handler, ["http://a"], Deadlines(60.0, 60.0, down_grace_s=0.2), calls)
    assert raw.content.startswith(_event("Hi") + b'data: {"error":')
    assert (
        "failed mid-response: it was marked down (/health answered 503) and sent no byte for 0.2 s after; "
        "it could not be continued"
    ) in raw.text
    assert 0.5 <= took < 0.5 + MARGIN_S


def _answering_b(hang_a):
    """Executor a hangs (``hang_a``: before its headers); b answers a short stream or JSON."""

    async def handler(request):
        if request.url.host == "a":
            await hang_a()
        if json.loads(request.content).get("stream"):
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                stream=_Chunks([_event("from b") + b"data: [DONE]\n\n"], stall=False),
            )
        return httpx.Response(200, json={"choices": [{"text": "from b"}]})

    return handler


def test_a_stream_without_a_first_byte_by_its_deadline_is_retried_elsewhere():
    async def calls(http, router):
        start = time.monotonic()
        raw = await http.post("/v1/completions", json=STREAM)
        return raw, time.monotonic() - start, router

    raw, took, router = _route(_answering_b(_forever), ["http://a", "http://b"], Deadlines(0.4, 60.0), calls)
    assert raw.status_code == 200 and raw.headers["x-kvreuse-executor"] == "http://b"
    assert raw.content == _event("from b") + b"data: [DONE]\n\n"
    assert 0.4 <= took < 0.4 + MARGIN_S
    a = router.executors["http://a"]
    assert not a.healthy and a.last_error == "no first byte: it sent no byte for 0.4 s (--upstream-first-byte-timeout)"
    assert router.num_retries == 1 and a.in_flight == 0 and a.failures == 1


def test_a_non_streamed_request_has_no_first_byte_deadline_but_moves_when_its_executor_goes_down():
    async def calls(http, router):
        start = time.monotonic()
        asyncio.get_running_loop().call_later(0.8, router.executors["http://a"].mark_down, "probe timed out")
        raw = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8})
        return raw, time.monotonic() - start

    # the first-byte deadline (0.2 s) is a stream's: the wait lasts until the mark (0.8 s) and its grace
    raw, took = _route(_answering_b(_forever), ["http://a", "http://b"], Deadlines(0.2, 60.0, down_grace_s=0.2), calls)
    assert raw.status_code == 200 and raw.json() == {"choices": [{"text": "from b"}]}
    assert raw.headers["x-kvreuse-executor"] == "http://b"
    assert 1.0 <= took < 1.0 + MARGIN_S


class _Paced(httpx.AsyncByteStream):
    """``chunks``, one every ``gap_s``."""

    def __init__(self, chunks: list[bytes], gap_s: float) -> None:
        self.chunks, self.gap_s = chunks, gap_s

    async def __aiter__(self):
        for i, chunk in enumerate(self.chunks):
            if i:
                await asyncio.sleep(self.gap_s)
            yield chunk


def test_one_stalled_stream_does_not_cut_the_streams_its_executor_still_sends():
    # Executor a streams one request (a token every 0.6 s: a loaded CPU) and holds another
    # after its first chunk (queued or preempted there). The held one passes its progress
    # deadline and is ended; a is not marked down for it, since a sent bytes meanwhile, so
    # the other stream is not cut a grace after a mark (it was, in bench/ray/kill_replica.py:
    # one preempted stream on the surviving replica cut all of that replica's streams).
    steady = [_event(f" t{i}") for i in range(5)] + [b"data: [DONE]\n\n"]

    async def handler(request):
        if json.loads(request.content)["prompt"] == [1, 2, 3]:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks([_event("Hi")]))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Paced(steady, 0.6))

    async def calls(http, router):
        held = asyncio.ensure_future(http.post("/v1/completions", json=STREAM))
        await asyncio.sleep(0.05)
        other = await http.post("/v1/completions", json={**STREAM, "prompt": [4, 5, 6]})
        return await held, other, router

    held, other, router = _route(handler, ["http://a"], Deadlines(60.0, 1.0, down_grace_s=0.05), calls)
    assert other.status_code == 200 and other.content == b"".join(steady)
    assert held.content.startswith(_event("Hi") + b'data: {"error":')
    assert "failed mid-response: it sent no byte for 1 s (--upstream-progress-timeout)" in held.text
    a = router.executors["http://a"]
    assert a.healthy and a.last_error is None
    assert a.in_flight == 0 and router.metrics.streams_cut._value.get() == 1


def test_a_stream_that_stalls_while_its_executor_sends_nothing_marks_it_down():
    # the same two streams, but the steady one ends before the held one's deadline: then
    # nothing came from a during the held read, and a is marked down as before
    async def handler(request):
        if json.loads(request.content)["prompt"] == [1, 2, 3]:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks([_event("Hi")]))
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_Chunks([_event("x"), b"data: [DONE]\n\n"], stall=False),
        )

    async def calls(http, router):
        other = await http.post("/v1/completions", json={**STREAM, "prompt": [4, 5, 6]})
        held = await http.post("/v1/completions", json=STREAM)
        return held, other, router

    held, other, router = _route(handler, ["http://a"], Deadlines(60.0, 0.4, down_grace_s=0.05), calls)
    assert other.content == _event("x") + b"data: [DONE]\n\n"
    assert "it sent no byte for 0.4 s (--upstream-progress-timeout)" in held.text
    a = router.executors["http://a"]
    assert not a.healthy and a.last_error == "a stream stalled: it sent no byte for 0.4 s (--upstream-progress-timeout)"
