"""bench/router/router_migration.py's client: a request that fails before its headers is
recorded as refused, not a crash of the bench (it raised UnboundLocalError on ``served_by``)."""

from __future__ import annotations

import socket
import threading

import pytest

from bench.common import free_port
from bench.router.router_migration import outcome, stream


def _drops_every_connection() -> tuple[str, threading.Thread]:
    """A listener that reads each request and closes the connection without a byte back."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", thread


@pytest.mark.parametrize("failure", ["refused", "dropped"])
def test_a_request_that_fails_before_its_headers_is_recorded_as_refused(failure):
    if failure == "refused":
        url, thread = f"http://127.0.0.1:{free_port()}", None  # nothing listens there
    else:
        url, thread = _drops_every_connection()
    heard: list[tuple[str | None, int]] = []
    result = stream(url, "/v1/completions", {"prompt": "x", "stream": True}, lambda by, n: heard.append((by, n)))
    if thread is not None:
        thread.join(5)
    assert result["executor"] is None and result["times"] == []
    [event] = result["events"]
    assert event["status"] is None
    error = "ConnectError" if failure == "refused" else "RemoteProtocolError"
    assert event["transport_error"].startswith(error + "(")
    assert outcome(result, chat=False) == ("refused", "")
    assert heard == [(None, 1_000_000)]  # over: the run does not wait for its first events
