"""Mid-stream migration with real processes: two ``kvreuse serve`` executors (tiny random
Llama) behind ``kvreuse route``; one executor is SIGKILLed while it streams greedy replies
(after every stream has its first chunks, with hundreds of tokens still to come) and
computes a non-streamed one. Every stream ends with ``[DONE]``, no error event, and the
reply of an uninterrupted run; the non-streamed request is retried to the same reply. With
``--migration-limit 0``, or no other executor, the official ``openai`` client raises the router's error event."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .cluster import executor, free_port, router, wait_healthy

EXECUTOR_HEADER = "x-kvreuse-executor"
MAX_TOKENS = 300  # ~3 s of decoding on this machine: the kill lands mid-reply


def _prompt(seed: int) -> str:
    return " ".join(f"stream {seed} sentence {i} of a prompt worth continuing;" for i in range(12))


REQUESTS = [
    ("/v1/completions", {"prompt": _prompt(0)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _prompt(1)}]}),
    ("/v1/completions", {"prompt": _prompt(2)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _prompt(3)}]}),
]
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("migration"))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    names = {"mig": free_port(), "off": free_port(), "alone": free_port()}
    state = {
        "urls": urls,
        "execs": {url: executor(port, logs).start() for url, port in zip(urls, ports)},
        "ports": dict(zip(urls, ports)),
        "logs": logs,
        **{k: f"http://127.0.0.1:{p}" for k, p in names.items()},
    }
    routers = []
    try:
        for url in urls:  # before the routers, which wait only so long for their executors
            wait_healthy(url, list(state["execs"].values()), timeout=300)
        routers += [
            router(names["mig"], urls, logs, "--routing-policy", "round_robin").start(),
            router(names["off"], urls, logs, "--migration-limit", "0", "--routing-policy", "round_robin").start(),
            router(names["alone"], urls[:1], logs).start(),
        ]
        procs = [*state["execs"].values(), *routers]
        wait_healthy(state["mig"], procs, all_of=2)
        wait_healthy(state["off"], procs, all_of=2)
        wait_healthy(state["alone"], procs, all_of=1)
        yield state
    finally:
        for p in [*routers, *state["execs"].values()]:
            p.stop()


def _restart(cluster, url: str) -> None:
    cluster["execs"][url] = executor(cluster["ports"][url], cluster["logs"]).start()
    wait_healthy(cluster["mig"], list(cluster["execs"].values()), timeout=300, all_of=2)


def _stream(url: str, path: str, body: dict, progress=None) -> tuple[str, list]:
    """(executor, events) of one streamed request; ``progress(executor, n)`` after each event."""
    with httpx.stream(
        "POST",
        url + path,
        json={**body, **GREEDY, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        served_by, events = r.headers[EXECUTOR_HEADER], []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if progress is not None:
                    progress(served_by, len(events))
    return served_by, events


def _reply(events: list, chat: bool) -> dict:
    """Text, finish reason and token counts; asserts the stream is whole (``[DONE]``, no error)."""
    assert events and events[-1] == "[DONE]", f"a silent cut: {events[-2:]}"
    assert not any("error" in e for e in events[:-1]), [e for e in events[:-1] if "error" in e]
    text, finish = "", None
    for e in events[:-1]:
        for c in e["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            finish = c["finish_reason"] or finish
    usage = events[-2]["usage"]
    return {
        "text": text,
        "finish": finish,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}" + (rf"\{{{re.escape(want)}\}}" if want else "") + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def _healthy(url: str) -> dict[str, bool]:
    return {e["url"]: e["healthy"] for e in httpx.get(url + "/v1/route/executors", timeout=5).json()["executors"]}


def _in_flight(url: str) -> dict[str, int]:
    return {e["url"]: e["in_flight"] for e in httpx.get(url + "/v1/route/executors", timeout=5).json()["executors"]}


def test_an_executor_killed_mid_reply_costs_no_request_and_changes_no_reply(cluster):
    # Round robin makes the kill deterministic: the non-streamed request goes first, to the
    # victim; the four streams then alternate, so two of them are on the victim too.
    mig = cluster["mig"]
    whole = {"prompt": _prompt(9), **GREEDY}
    reference = [_reply(_stream(mig, path, body)[1], "messages" in body) for path, body in REQUESTS]
    assert all(r["completion_tokens"] == MAX_TOKENS and r["finish"] == "length" for r in reference)
    whole_reference = httpx.post(mig + "/v1/completions", json=whole, timeout=120).json()["choices"][0]["text"]
    retries = _metric(mig, "kvreuse:router_retries_total")

    progress: dict[int, tuple[str, int]] = {}
    started = threading.Event()
    lock = threading.Lock()

    def note(i: int):
        def seen(served_by: str, n: int) -> None:
            with lock:
                progress[i] = (served_by, n)
                if len(progress) == len(REQUESTS) and all(n >= 3 for _, n in progress.values()):
                    started.set()  # every stream has its role/first chunks

        return seen

    with ThreadPoolExecutor(len(REQUESTS) + 1) as pool:
        pending = pool.submit(httpx.post, mig + "/v1/completions", json=whole, timeout=120)
        deadline = time.monotonic() + 30
        while not any(_in_flight(mig).values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        (victim,) = [url for url, n in _in_flight(mig).items() if n]
        futures = [pool.submit(_stream, mig, path, body, note(i)) for i, (path, body) in enumerate(REQUESTS)]
        assert started.wait(60), progress
        on_victim = [i for i, (served_by, _) in progress.items() if served_by == victim]
        assert len(on_victim) == 2 and not pending.done()
        cluster["execs"][victim].kill()  # SIGKILL: every connection to it is reset mid-reply
        results = [f.result(timeout=120) for f in futures]
        retried = pending.result(timeout=120)
    for (_path, body), ref, (_, events) in zip(REQUESTS, reference, results):
        assert _reply(events, "messages" in body) == ref  # whole ([DONE], no error), the uninterrupted reply
    assert retried.status_code == 200 and retried.json()["choices"][0]["text"] == whole_reference
    assert retried.headers[EXECUTOR_HEADER] != victim
    assert _metric(mig, "kvreuse:router_migrations_total", outcome="continued") == len(on_victim)
    assert _metric(mig, "kvreuse:router_streams_cut_total") == 0
    assert _metric(mig, "kvreuse:router_retries_total") == retries + 1
    if victim == cluster["urls"][0]:  # the next test needs it
        _restart(cluster, victim)


def test_without_migration_or_another_executor_the_openai_client_raises(cluster):
    first = cluster["urls"][0]  # alive: the previous test restarted it if it was the victim
    for name in ("off", "alone"):
        deadline = time.monotonic() + 120
        while not _healthy(cluster[name]).get(first) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _healthy(cluster[name]).get(first), name
    got: dict[str, list] = {"off": [], "alone": []}
    errors: dict[str, openai.APIError] = {}
    both = threading.Barrier(3, timeout=60)

    def read(name: str) -> None:
        client = openai.OpenAI(base_url=cluster[name] + "/v1", api_key="none", max_retries=0)
        while True:  # round robin: the first executor's turn comes within two requests
            raw = client.completions.with_raw_response.create(
                model=client.models.list().data[0].id,
                prompt=_prompt(20),
                stream=True,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            if raw.headers[EXECUTOR_HEADER] == first:
                break
            raw.parse().close()
        try:
            for chunk in raw.parse():
                got[name].append(chunk.choices[0].text)
                if len(got[name]) == 2:
                    both.wait()  # both streams are forwarding tokens: the kill comes now
        except openai.APIError as exc:
            errors[name] = exc

    threads = [threading.Thread(target=read, args=(name,)) for name in got]
    for t in threads:
        t.start()
    both.wait()
    cluster["execs"][first].kill()
    for t in threads:
        t.join(120)
    cut = "the executor serving this stream (executor 0) failed mid-response: "  # no address: its id
    for name, reason in (
        ("off", "migration is off (--migration-limit 0)"),
        ("alone", "no other healthy executor (tried executor 0)"),
    ):
        assert got[name] and name in errors, (name, got[name][-3:])
        assert errors[name].body["code"] == "executor_failed" and errors[name].message.startswith(cut)
        assert (
            f"it could not be continued on another executor: {reason}; the output is incomplete" in errors[name].message
        )
