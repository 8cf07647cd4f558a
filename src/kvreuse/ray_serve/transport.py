"""An httpx transport whose "network" is the replicas' ``DeploymentHandle``.

The ingress runs ``kvreuse route``'s router unchanged: it calls executors with an
``httpx.AsyncClient``. Built over this transport, that client reaches executor
``http://<replica id>.replica`` by a streamed handle call ``call(method, path, query, headers,
body, kvreuse_target=<replica id>, kvreuse_proxied=...)``, which the request router
(``kvreuse.ray_serve.request_router``) sends to that replica. Any other host reaches whichever
replica Ray picks (the ingress's first ``/v1/kvreuse/info`` at start).

Failures look like the network failures the router already handles:

- no ``ACCEPTED`` from the replica within the request's connect timeout (the replica is gone,
  or Ray cannot place the call): ``httpx.ConnectTimeout``; a Ray error before it:
  ``httpx.ConnectError``. The router retries the request elsewhere.
- a Ray error after it (the replica's process died mid-response): ``httpx.ReadError``. The
  router continues a stream on another replica (``kvreuse.router.migration``).

httpx does not apply timeouts to a custom transport: the connect timeout bounds the wait
for ``ACCEPTED`` and the read timeout (``None``: none) the wait for the response start; the
router bounds the waits for each chunk itself (``kvreuse.router.deadline``). Closing the
response cancels the handle call, and the replica's app sees its client disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvreuse.ray_serve.asgi_call import ResponseStart
from kvreuse.ray_serve.replica import ACCEPTED
from kvreuse.ray_serve.request_router import PROXIED_KWARG, TARGET_KWARG
from kvreuse.ray_serve.tracker import replica_of_host

# a client's request: the pow2 baseline routes these itself (everything else names its replica)
PROXIED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"})


def _ray_errors() -> tuple[type[BaseException], ...]:
    """What a handle call raises when Ray could not run it or its replica failed."""
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    return (RayError, RayServeException)


class _ReplicaStream(httpx.AsyncByteStream):
    def __init__(self, calls: Any, request: httpx.Request) -> None:
        self.calls, self.request = calls, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for item in self.calls:
                if isinstance(item, bytes):
                    yield item
        except _ray_errors() as exc:
            raise httpx.ReadError(
                f"the replica failed mid-response: {type(exc).__name__}", request=self.request
            ) from exc

    async def aclose(self) -> None:
        self.calls.cancel()


class ReplicaTransport(httpx.AsyncBaseTransport):
    """``handle``: the replicas' ``DeploymentHandle``."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(stream=True)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        path = request.url.path
        target = replica_of_host(request.url.host)
        calls = self.handle.call.remote(
            request.method,
            path,
            request.url.query.decode("latin-1"),
            [(k, v) for k, v in request.headers.multi_items() if k.lower() != "host"],
            body,
            **{TARGET_KWARG: target, PROXIED_KWARG: request.method == "POST" and path in PROXIED_PATHS},
        )
        timeouts = request.extensions.get("timeout") or {}
        try:
            first = await asyncio.wait_for(calls.__anext__(), timeouts.get("connect"))
            if first != ACCEPTED:
                raise httpx.RemoteProtocolError(f"the replica began with {first!r}", request=request)
            start = await asyncio.wait_for(calls.__anext__(), timeouts.get("read"))
        except TimeoutError:
            calls.cancel()
            raise httpx.ConnectTimeout(f"no replica took the request ({target or 'any'})", request=request) from None
        except StopAsyncIteration:
            raise httpx.RemoteProtocolError("the replica ended its response before it began", request=request) from None
        except _ray_errors() as exc:
            calls.cancel()
            raise httpx.ConnectError(f"the replica failed: {type(exc).__name__}: {exc}", request=request) from exc
        except asyncio.CancelledError:
            calls.cancel()
            raise
        if not isinstance(start, ResponseStart):
            calls.cancel()
            raise httpx.RemoteProtocolError(f"the replica answered {type(start).__name__}", request=request)
        return httpx.Response(start.status, headers=start.headers, stream=_ReplicaStream(calls, request))
