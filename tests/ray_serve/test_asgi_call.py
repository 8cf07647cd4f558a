"""``asgi_call``: one request through an ASGI app in-process, as a replica runs it for the
ingress. No Ray needed: the app is a small FastAPI app."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvreuse.ray_serve.asgi_call import ResponseStart, asgi_call


def _app(seen: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "body": (await request.body()).decode(),
                "q": request.query_params.get("q"),
                "h": request.headers.get("x-a"),
            },
            status_code=201,
            headers={"x-b": "2"},
        )

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/forever")
    async def forever() -> StreamingResponse:
        async def events():
            try:
                yield b"data: first\n\n"
                await asyncio.Event().wait()  # until the client leaves
                yield b"never"
            finally:
                seen["closed"] = True

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> JSONResponse:
        raise RuntimeError("boom")

    return app


async def _collect(app, method, path, query="", headers=(), body=b""):
    return [item async for item in asgi_call(app, method, path, query, list(headers), body)]


def test_a_json_response_comes_back_with_status_headers_and_body():
    items = asyncio.run(_collect(_app({}), "POST", "/echo", "q=7", [("X-A", "1")], b"hello"))
    start, body = items[0], b"".join(items[1:])
    assert isinstance(start, ResponseStart)
    assert start.status == 201
    assert ("x-b", "2") in start.headers
    assert body == b'{"body":"hello","q":"7","h":"1"}'


def test_a_stream_comes_chunk_by_chunk():
    items = asyncio.run(_collect(_app({}), "GET", "/stream"))
    assert isinstance(items[0], ResponseStart) and items[0].status == 200
    assert items[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]


def test_closing_the_call_early_tells_the_app_its_client_left():
    seen: dict = {}

    async def run() -> list:
        calls = asgi_call(_app(seen), "GET", "/forever", "", [], b"")
        got = [await calls.__anext__(), await calls.__anext__()]
        await calls.aclose()  # the ingress went away (Ray cancels the replica's generator)
        for _ in range(100):  # the app's own task ends after it saw the disconnect
            if seen.get("closed"):
                break
            await asyncio.sleep(0.01)
        return got

    got = asyncio.run(run())
    assert got[1] == b"data: first\n\n"
    assert seen == {"closed": True}


def test_an_app_error_is_the_apps_500():
    items = asyncio.run(_collect(_app({}), "GET", "/boom"))
    assert isinstance(items[0], ResponseStart) and items[0].status == 500
    assert b"".join(items[1:]) == b"Internal Server Error"
