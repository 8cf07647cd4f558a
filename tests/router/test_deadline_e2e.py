"""A hung executor holds no stream, with real processes: two ``kvreuse serve`` executors
(tiny random Llama) behind ``kvreuse route``; the executor serving one of two greedy streams
is SIGSTOPped mid-reply (its sockets stay open, it sends nothing). The stream moves to the
other executor once ``--upstream-progress-timeout`` passes (a router that probes too rarely
to notice) or once the health probe marks the executor down (a router whose deadline is too
long to matter), and ends whole with the uninterrupted reply; with ``--migration-limit 0`` it
ends with the error event at the deadline. No client waits much past the deadline."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .cluster import executor, free_port, router, wait_healthy

EXECUTOR_HEADER = "x-kvreuse-executor"
MAX_TOKENS = 300  # ~3 s of decoding here: the stop lands mid-reply
PROGRESS_S = 2.0
MIGRATION_S = 6.0  # a continuation's prefill on the survivor, on a loaded 2-core machine
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
BODIES = [
    ("/v1/completions", {"prompt": " ".join(f"hung executor {i} sentence {j};" for j in range(10))}) for i in range(2)
] + [("/v1/chat/completions", {"messages": [{"role": "user", "content": "a chat " * 20}]})]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("deadline"))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    execs = {url: executor(port, logs).start() for url, port in zip(urls, ports)}
    names = {"deadline": free_port(), "health": free_port(), "off": free_port()}
    routers = []
    try:
        for url in urls:
            wait_healthy(url, list(execs.values()), timeout=300)
        # probes once at start, then every 600 s: only the deadline can notice the stop
        routers.append(
            router(
                names["deadline"],
                urls,
                logs,
                "--routing-policy",
                "round_robin",
                "--health-interval",
                "600",
                "--upstream-progress-timeout",
                str(PROGRESS_S),
            ).start()
        )
        # the deadline is far: the health probe (every 0.3 s, 2 s timeout) notices the stop
        routers.append(
            router(
                names["health"], urls, logs, "--routing-policy", "round_robin", "--upstream-progress-timeout", "120"
            ).start()
        )
        routers.append(
            router(
                names["off"],
                urls,
                logs,
                "--routing-policy",
                "round_robin",
                "--health-interval",
                "600",
                "--upstream-progress-timeout",
                str(PROGRESS_S),
                "--migration-limit",
                "0",
            ).start()
        )
        state = {"execs": execs, **{k: f"http://127.0.0.1:{p}" for k, p in names.items()}}
        for name in names:
            wait_healthy(state[name], [*execs.values(), *routers], all_of=2)
        yield state
    finally:
        for p in execs.values():
            if p.popen is not None and p.popen.poll() is None:
                p.popen.send_signal(signal.SIGCONT)
        for p in [*routers, *execs.values()]:
            p.stop()


def _stream(url: str, path: str, body: dict, seen=None) -> tuple[str, list, float]:
    """(executor, events, longest wait between two events) of one stream; ``seen(executor,
    n)`` after each event."""
    with httpx.stream("POST", url + path, json={**body, **GREEDY}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        served_by, events, last, gap = r.headers[EXECUTOR_HEADER], [], time.monotonic(), 0.0
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if seen is not None:
                    seen(served_by, len(events))
    return served_by, events, gap


def _text(events: list, chat: bool) -> str:
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-2:]
    return "".join((c["delta"].get("content") or "") if chat else c["text"] for e in events[:-1] for c in e["choices"])


def _stop_one_mid_reply(cluster, url: str, requests: list) -> tuple[str, list, float]:
    """Stream ``requests`` through router ``url`` at once; SIGSTOP the executor of the first
    once every stream has 3 events; returns (victim, results, seconds from the stop)."""
    progress: dict[int, tuple[str, int]] = {}
    started, lock = threading.Event(), threading.Lock()

    def note(i):
        def seen(served_by, n):
            with lock:
                progress[i] = (served_by, n)
                if len(progress) == len(requests) and all(k >= 3 for _, k in progress.values()):
                    started.set()

        return seen

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(_stream, url, path, body, note(i)) for i, (path, body) in enumerate(requests)]
        assert started.wait(120), progress
        victim = progress[0][0]
        cluster["execs"][victim].popen.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            results = [f.result(timeout=120) for f in futures]
        finally:
            cluster["execs"][victim].popen.send_signal(signal.SIGCONT)
    return victim, results, time.monotonic() - stopped


def _reference(url: str) -> list[str]:
    return [_text(_stream(url, path, body)[1], "messages" in body) for path, body in BODIES]


@pytest.mark.parametrize("name", ["deadline", "health"])
def test_a_stopped_executors_stream_moves_and_ends_with_the_uninterrupted_reply(cluster, name):
    url = cluster[name]
    wait_healthy(url, list(cluster["execs"].values()), all_of=2)  # the previous stop is over
    reference = _reference(url)
    victim, results, _ = _stop_one_mid_reply(cluster, url, BODIES)
    moved = [i for i, (served_by, _, _) in enumerate(results) if served_by == victim]
    assert 0 in moved
    for (_, body), ref, (_, events, _) in zip(BODIES, reference, results):
        assert _text(events, "messages" in body) == ref  # [DONE], no error event, the same greedy text
    gaps = [results[i][2] for i in moved]
    # the deadline router waits its deadline; the health router the probe's 2 s timeout and a 1 s grace
    floor = PROGRESS_S if name == "deadline" else 1.0
    assert all(floor <= g < (PROGRESS_S if name == "deadline" else 4.0) + MIGRATION_S for g in gaps), gaps


def test_without_migration_a_stopped_executors_stream_ends_with_the_error_event_at_the_deadline(cluster):
    url = cluster["off"]
    victim, results, _ = _stop_one_mid_reply(cluster, url, BODIES[:2])
    served_by, events, gap = results[0]
    assert served_by == victim  # its events, then the error event (no [DONE]: the stream is incomplete)
    error = events[-1]["error"]
    assert error["code"] == "executor_failed" and error["message"] == (
        f"the executor serving this stream (executor {list(cluster['execs']).index(victim)}) failed mid-response: "
        f"it sent no byte for {PROGRESS_S:g} s "
        "(--upstream-progress-timeout); it could not be continued on another executor: migration is off "
        "(--migration-limit 0); the output is incomplete"
    )
    assert PROGRESS_S <= gap < PROGRESS_S + 2.0
    assert _text(results[1][1], False)  # the other executor's stream is whole
