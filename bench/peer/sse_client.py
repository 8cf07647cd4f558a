"""A light asyncio client for streaming ``POST /v1/completions`` and a load generator on it.

Plain ``asyncio`` streams, HTTP/1.1, one connection per request: no client library's own CPU
(on a 2-core machine a heavy client takes time from the server it measures). Works against any
OpenAI-compatible server that streams Server-Sent Events (``kvreuse serve``, ``llama-server``).

A request's figures (``Stream``): the time of every event that carries text (a user sees a
token arrive), so TTFT = first such event - send time and the inter-token latencies (ITL) are
the gaps between them; ``tokens`` is the server's own ``usage.completion_tokens`` (or
llama-server's ``timings.predicted_n``), which can exceed the events when a token's text is
held back until a later one completes a UTF-8 character (both servers do that).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Stream:
    """One streamed completion: ``sent`` (``perf_counter`` when the request went out),
    ``events`` (arrival of each chunk with text), ``tokens`` (completion tokens)."""

    sent: float
    events: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.events[0] - self.sent

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]

    @property
    def decode_tok_s(self) -> float:
        """Tokens/s after the first: ``(tokens - 1) / (last event - first event)``."""
        span = self.events[-1] - self.events[0]
        return (self.tokens - 1) / span if span > 0 else float("nan")


class ServerError(RuntimeError):
    """The server answered with an HTTP error or an error event (its text in the message)."""


def completion_body(prompt: Sequence[int], max_tokens: int) -> dict:
    """The request both servers get: token ids, greedy, exactly ``max_tokens`` (``ignore_eos``),
    streamed with a final usage chunk."""
    return {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def complete(url: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 600) -> Stream:
    """One streaming ``/v1/completions`` request to the server at ``url``; the ``Stream``.
    Raises ``ServerError`` on a non-200 answer or an error event, ``TimeoutError`` after ``timeout_s``."""
    return await asyncio.wait_for(_complete(url, completion_body(prompt, max_tokens)), timeout_s)


async def _complete(url: str, body: dict) -> Stream:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        stream = Stream(sent=time.perf_counter())
        writer.write(head + payload)
        await writer.drain()
        status = (await reader.readline()).decode("latin-1").split()
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        chunks = _chunked(reader) if "chunked" in headers.get("transfer-encoding", "") else _plain(reader)
        if len(status) < 2 or status[1] != "200":
            text = b"".join([c async for c in chunks]).decode(errors="replace")
            raise ServerError(f"{url}: HTTP {' '.join(status[1:])}: {text[:500]}")
        buffer = b""
        usage_tokens = None
        async for data in chunks:
            now = time.perf_counter()
            buffer += data.replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data_text = line[5:].strip()
                    if data_text == b"[DONE]":
                        continue
                    obj = json.loads(data_text)
                    if "error" in obj:
                        raise ServerError(f"{url}: {obj['error']}")
                    choices = obj.get("choices") or []
                    if choices and choices[0].get("text"):
                        stream.events.append(now)
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens", usage_tokens)
                    elif obj.get("timings", {}).get("predicted_n") is not None:
                        usage_tokens = obj["timings"]["predicted_n"]
        if not stream.events:
            raise ServerError(f"{url}: the stream carried no text")
        stream.tokens = usage_tokens if usage_tokens is not None else len(stream.events)
        return stream
    finally:
        writer.close()


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        yield data


async def _plain(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(1 << 16):
        yield data


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def load(
    url: str, clients: int, requests_per_client: int, prompt: Callable[[int, int], Sequence[int]], max_tokens: int
) -> dict:
    """``clients`` concurrent clients, each sending ``requests_per_client`` streaming requests in
    a row (``prompt(client, request)`` gives each one's token ids). Returns ITL p50/p99 over
    every gap of every stream, TTFT p50/p99 over every request (ms), aggregate output tokens/s
    (all completion tokens / the wall time from the first send to the last stream's end), and
    the counts behind them."""

    async def client(i: int) -> list[Stream]:
        return [await complete(url, prompt(i, r), max_tokens) for r in range(requests_per_client)]

    start = time.perf_counter()
    per_client = await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - start
    streams = [s for c in per_client for s in c]
    itls = [g for s in streams for g in s.itls_s]
    ttfts = [s.ttft_s for s in streams]
    tokens = sum(s.tokens for s in streams)
    return {
        "clients": clients,
        "requests": len(streams),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2),
        "itl_p50_ms": round(1e3 * percentile(itls, 50), 2),
        "itl_p99_ms": round(1e3 * percentile(itls, 99), 2),
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(ttfts, 99), 1),
        "itl_samples": len(itls),
    }
