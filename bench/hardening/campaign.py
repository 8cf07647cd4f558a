"""The hardening campaign of issue 15, rerun: each numbered finding reproduced against a router
with two real executors (``kvreuse serve`` processes behind ``kvreuse route``), with what it
shows now. Writes bench/results/campaign.json and prints a summary table (docs/benchmarks.md).

    PYTHONPATH=src .venv/bin/python bench/hardening/campaign.py [--model tiny:llama] [--only NAME ...]

Keys: one admin key and two tenant keys (``alice``, ``bob``) on every process. Each check is a
function returning rows ``{finding, check, value, target, ok}``; a check that crashes is a row
with ``ok: false`` and the error, so one broken check never hides the others.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import ROOT, Proc, free_port, wait_healthy, write_json
from bench.router.router_guards import post_raw, rss_kib
from tests.pml.test_module_cache import SCHEMA
from tests.serve_client import metric

ADMIN, ALICE, BOB = "campaign-admin", "campaign-alice", "campaign-bob"
KEYS = [ADMIN, f"{ALICE}:alice", f"{BOB}:bob"]
SECRET = "The vault code of Aldermere Holdings is seven four nine two, kept by the night clerk."
PML_PROMPT = '<prompt schema="s"><b/><r who="Cy"/>Why?</prompt>'  # over tests.pml.test_module_cache.SCHEMA


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def row(finding: str, check: str, value, target: str, ok: bool) -> dict:
    return {"finding": finding, "check": check, "value": value, "target": target, "ok": bool(ok)}


class Cluster:
    """Two executors + one router, all with the campaign's keys."""

    def __init__(self, model: str, logs: str, *, exec_args: tuple[str, ...] = (), router_args: tuple[str, ...] = ()):
        self.model, self.logs = model, logs
        self.ports = [free_port(), free_port()]
        self.rport = free_port()
        keys = [a for k in KEYS for a in ("--api-key", k)]
        self.execs = [
            Proc(
                [
                    "serve",
                    "--model",
                    model,
                    "--port",
                    str(p),
                    "--device",
                    "cpu",
                    "--kv-cache-memory",
                    "0.01",
                    "--max-model-len",
                    "1024",
                    "--event-buffer-max-size",
                    "10000",
                    "--log-level",
                    "info",
                    "--schema-dir",
                    f"{logs}/schemas-{p}",
                    *keys,
                    *exec_args,
                ],
                f"{logs}/executor-{p}.log",
            )
            for p in self.ports
        ]
        self.router = Proc(
            [
                "route",
                "--port",
                str(self.rport),
                "--log-level",
                "info",
                "--health-interval",
                "0.3",
                "--executor-api-key",
                ADMIN,
                *keys,
                *router_args,
                *[a for p in self.ports for a in ("--executor", f"http://127.0.0.1:{p}")],
            ],
            f"{logs}/router-{self.rport}.log",
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.rport}"

    def executor_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def __enter__(self) -> Cluster:
        for e in self.execs:
            e.start()
        for p, e in zip(self.ports, self.execs):
            wait_healthy(f"http://127.0.0.1:{p}", [e], timeout=300)
        self.router.start()
        wait_healthy(self.url, [self.router], all_of=2)
        return self

    def __exit__(self, *exc) -> None:
        self.router.stop()
        for e in self.execs:
            e.stop()


def complete(url: str, key: str, prompt, *, max_tokens: int = 8, timeout: float = 120, **extra) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        headers=auth(key),
        timeout=timeout,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
    )


def stream_text(
    url: str, key: str, prompt: str, max_tokens: int, *, gaps: list[float] | None = None, **extra
) -> tuple[str, str]:
    """(text, ending) of one streamed completion: ending is ``done`` ([DONE] seen), ``error``
    (an SSE error event or a non-200 status) or ``cut`` (the stream ended without either)."""
    text, last = "", None
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            headers=auth(key),
            timeout=300,
            json={
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                **extra,
            },
        ) as r:
            if r.status_code != 200:
                return text, "error"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return text, "done"
                chunk = json.loads(data)
                if "error" in chunk:
                    return text, "error"
                now = time.perf_counter()
                if gaps is not None and last is not None:
                    gaps.append(now - last)
                last = now
                text += "".join(c.get("text", "") for c in chunk.get("choices", []))
    except httpx.HTTPError:
        return text, "error"  # the client sees an exception: not a silent cut
    return text, "cut"


# ------------------------------------------------------------------------------ findings
def body_limits(c: Cluster) -> list[dict]:
    before = rss_kib(c.router.popen.pid)
    status, seconds = post_raw(c.rport, 50 * 1024 * 1024, chunked=False)
    time.sleep(0.5)
    after = rss_kib(c.router.popen.pid)
    growth = round((after["VmHWM"] - before["VmHWM"]) / 1024, 1)
    return [
        row("1", "50 MB body, no key: status", status, "413 (or 401)", status in (401, 413)),
        row("1", "50 MB body, no key: seconds to answer", round(seconds, 3), "< 1 s", seconds < 1.0),
        row("1", "50 MB body, no key: router peak RSS growth (MB)", growth, "< 50 MB", growth < 50),
    ]


def explain_needs_key(c: Cluster) -> list[dict]:
    body = {"prompt": SECRET, "max_tokens": 1}
    without = httpx.post(f"{c.url}/v1/route/explain", json=body).status_code
    complete(c.url, ALICE, SECRET, max_tokens=1).raise_for_status()
    as_bob = httpx.post(f"{c.url}/v1/route/explain", json=body, headers=auth(BOB)).json()
    cached = max((e.get("overlap_blocks", e.get("matched_blocks", 0)) or 0) for e in as_bob.get("executors", [{}]))
    return [
        row("2", "explain without a key: status", without, "401", without == 401),
        row("2", "explain as another tenant: blocks it learns are cached", cached, "0", cached == 0),
    ]


def cross_tenant_reads(c: Cluster) -> list[dict]:
    ids = httpx.post(f"{c.executor_url(0)}/tokenize", headers=auth(ADMIN), json={"prompt": SECRET}).json()["tokens"]
    for i in range(2):
        complete(c.executor_url(i), ALICE, SECRET, max_tokens=1).raise_for_status()
    secret_runs = {tuple(ids[i : i + 4]) for i in range(len(ids) - 3)}
    rows, seen, statuses = [], 0, []
    for base in [c.url, c.executor_url(0), c.executor_url(1)]:
        for path in ("/v1/kv_cache_state", "/v1/kv_cache_events?after=0", "/v1/kvreuse/info"):
            try:
                r = httpx.get(f"{base}{path}", headers=auth(BOB), timeout=5)
            except httpx.HTTPError:
                continue
            statuses.append(r.status_code)
            numbers = [int(x) for x in re.findall(r"\d+", r.text)] if r.status_code == 200 else []
            seen += sum(tuple(numbers[i : i + 4]) in secret_runs for i in range(len(numbers) - 3))
    admin_view = httpx.get(f"{c.executor_url(0)}/v1/kv_cache_state", headers=auth(ADMIN)).text
    admin_numbers = [int(x) for x in re.findall(r"\d+", admin_view)]
    admin_seen = sum(tuple(admin_numbers[i : i + 4]) in secret_runs for i in range(len(admin_numbers) - 3))
    rows.append(row("3", "another tenant's reads of state/events: foreign token-id runs seen", seen, "0", seen == 0))
    rows.append(row("3", "the same reads: statuses", sorted(set(statuses)), "403/404", 200 not in statuses))
    rows.append(row("3", "control: the admin key sees the secret's token-id runs", admin_seen, "> 0", admin_seen > 0))
    return rows


def access_log(c: Cluster) -> list[dict]:
    for base in (c.url, c.executor_url(0)):
        httpx.get(f"{base}/dashboard", params={"api_key": ADMIN})
        httpx.get(f"{base}/v1/models", headers=auth(ALICE))
    time.sleep(0.5)
    logs = "".join(Path(p.log_path).read_text(errors="replace") for p in [c.router, *c.execs])
    hits = sum(logs.count(k) for k in (ADMIN, ALICE, BOB))
    lines = logs.count("/dashboard")
    openapi = httpx.get(f"{c.url}/openapi.json").status_code, httpx.get(f"{c.executor_url(0)}/openapi.json").status_code
    return [
        row("4", "keys in the router's and executors' logs", hits, "0", hits == 0),
        row("4", "control: dashboard requests in those logs", lines, "> 0", lines > 0),
        row("4", "/openapi.json without a key (router, executor)", list(openapi), "401", openapi == (401, 401)),
    ]


def midstream_kill(c: Cluster, n: int = 60, tokens: int = 48) -> list[dict]:
    prompts = [f"Request {i}: write about the harbour and its {i % 7} cranes." for i in range(n)]
    reference = {
        p: complete(c.url, ADMIN, p, max_tokens=tokens, ignore_eos=True).json()["choices"][0]["text"]
        for p in prompts[:12]
    }
    results: list[tuple[str, str, str]] = [None] * n  # type: ignore[list-item]
    started = threading.Event()

    def one(i: int) -> None:
        started.set()
        text, ending = stream_text(c.url, ADMIN, prompts[i], tokens)
        results[i] = (prompts[i], text, ending)

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        started.wait(30)
        time.sleep(1.5)
        c.execs[1].popen.send_signal(signal.SIGKILL)
        for f in futures:
            f.result()
    endings = [r[2] for r in results]
    cuts = endings.count("cut")
    differing = sum(1 for p, text, ending in results if ending == "done" and p in reference and text != reference[p])
    checked = sum(1 for p, _, ending in results if ending == "done" and p in reference)
    return [
        row("5", f"SIGKILL of one executor during {n} streams: silent cuts", cuts, "0", cuts == 0),
        row(
            "5",
            "streams completed / ended with an error the client sees",
            f"{endings.count('done')} / {endings.count('error')}",
            "all complete (migrated)",
            endings.count("done") == n,
        ),
        row(
            "5",
            f"greedy streams differing from an uninterrupted run (of {checked} checked)",
            differing,
            "0",
            differing == 0 and checked > 0,
        ),
    ]


def union_while_streaming(c: Cluster, members: int = 500) -> list[dict]:
    body = "".join(
        f'<module name="m{i}">Member {i} holds a short fact about item {i}.</module>' for i in range(members)
    )
    schema = f'<schema name="big"><union>{body}</union> Question follows.</schema>'
    gaps: list[float] = []
    out: dict = {}

    def client() -> None:
        out["stream"] = stream_text(c.executor_url(0), ADMIN, "Tell a long story about a lighthouse.", 160, gaps=gaps)

    t = threading.Thread(target=client)
    t.start()
    time.sleep(1.0)
    start = time.perf_counter()
    r = httpx.post(f"{c.executor_url(0)}/v1/schemas", headers=auth(ADMIN), json={"schema": schema}, timeout=600)
    seconds = time.perf_counter() - start
    t.join()
    worst = max(gaps) if gaps else float("inf")
    return [
        row(
            "6",
            f"{members}-member union: register status / seconds",
            f"{r.status_code} / {seconds:.1f}",
            "200 (or a 400 naming the limit)",
            r.status_code in (200, 201, 202, 400),
        ),
        row("6", "a streaming client's worst inter-token gap meanwhile (s)", round(worst, 3), "< 1 s", worst < 1.0),
    ]


def corrupt_store(model: str, logs: str) -> list[dict]:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvreuse.pml.schema_store import _checksum

    def rewrite(path: Path, change: Callable) -> None:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        tensors = {k: change(t).contiguous() for k, t in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={**meta, "checksum": _checksum(tensors)})

    modes = {
        "wrong shape": lambda p: rewrite(p, lambda t: t[:, :, :, :1]),
        "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
        "all-NaN KV": lambda p: rewrite(p, lambda t: torch.full_like(t, float("nan"))),
    }
    rows = []
    for mode, corrupt in modes.items():
        port, sdir = free_port(), tempfile.mkdtemp(prefix="camp-schemas-", dir=logs)
        args = [
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "0.01",
            "--schema-dir",
            sdir,
            "--log-level",
            "warning",
            "--api-key",
            ADMIN,
        ]
        url = f"http://127.0.0.1:{port}"
        first = Proc(args, f"{logs}/store-{port}.log").start()
        try:
            wait_healthy(url, [first], timeout=300)
            httpx.post(f"{url}/v1/schemas", headers=auth(ADMIN), json={"schema": SCHEMA}).raise_for_status()
            ref = complete(url, ADMIN, PML_PROMPT).json()["choices"][0]["text"]
        finally:
            first.stop()
        for path in Path(sdir).rglob("*.safetensors"):
            corrupt(path)
        again = Proc(args, f"{logs}/store-{port}-again.log").start()
        try:
            wait_healthy(url, [again], timeout=300)
            names = [s["name"] for s in httpx.get(f"{url}/v1/schemas", headers=auth(ADMIN)).json()["data"]]
            text = complete(url, ADMIN, PML_PROMPT).json()["choices"][0]["text"]
            refused = metric(url, "kvreuse:schema_store_refused_total")
            rows.append(
                row(
                    "7",
                    f"{mode}: server starts, schema kept, output right, refusal counted",
                    f"started, schemas={names}, same={text == ref}, refused={refused:g}",
                    "all",
                    names == ["s"] and text == ref and refused >= 1,
                )
            )
        except Exception as exc:  # noqa: BLE001 - the server not starting is the finding
            rows.append(row("7", f"{mode}: server starts", f"failed: {exc!s:.120}", "starts", False))
        finally:
            again.stop()
    return rows


def smaller_items(c: Cluster) -> list[dict]:
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r_deep = httpx.post(
        f"{c.url}/v1/completions", headers={**auth(ADMIN), "Content-Type": "application/json"}, content=deep
    )
    bad_utf8 = httpx.post(
        f"{c.url}/v1/completions",
        headers={**auth(ADMIN), "Content-Type": "application/json"},
        content=b'{"prompt": "\xff\xfe", "max_tokens": 1}',
    )
    surrogate = httpx.post(
        f"{c.url}/v1/completions",
        headers={**auth(ADMIN), "Content-Type": "application/json"},
        content=b'{"prompt": "\\ud800", "max_tokens": 1}',
    )
    fan = httpx.post(
        f"{c.url}/v1/completions", headers=auth(ADMIN), json={"prompt": ["x"] * 256, "n": 16, "max_tokens": 1}
    )
    chat = httpx.post(
        f"{c.url}/v1/chat/completions",
        headers=auth(ADMIN),
        timeout=120,
        json={"messages": [{"role": "user", "content": "hello"}], "temperature": 0},
    )

    def msg(r: httpx.Response) -> str:
        try:
            return r.json()["error"]["message"][:90]
        except Exception:  # noqa: BLE001
            return r.text[:90]

    return [
        row("8", "router, 100,000-deep JSON", f"{r_deep.status_code}: {msg(r_deep)}", "400", r_deep.status_code == 400),
        row(
            "8",
            "invalid UTF-8 body",
            f"{bad_utf8.status_code}: {msg(bad_utf8)}",
            "400 naming the body",
            bad_utf8.status_code == 400,
        ),
        row(
            "8",
            "lone surrogate in the prompt",
            f"{surrogate.status_code}: {msg(surrogate)}",
            "400, no internals",
            surrogate.status_code == 400 and "Traceback" not in surrogate.text,
        ),
        row(
            "8",
            "n=16 x 256 prompts (4,096 sequences)",
            f"{fan.status_code}: {msg(fan)}",
            "400 naming n",
            fan.status_code == 400,
        ),
        row("8", "chat without max_tokens on a small pool", chat.status_code, "200", chat.status_code == 200),
    ]


def load_figures(model: str, logs: str, streams: int = 64) -> list[dict]:
    """On an executor of its own whose pool (~1,250 tokens of the tiny model) is half what the
    64 streams need together, so the scheduler must preempt."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(
        [
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "0.0006",
            "--max-num-seqs",
            str(streams),
            "--log-level",
            "warning",
            "--api-key",
            ADMIN,
        ],
        f"{logs}/load-{port}.log",
    ).start()
    try:
        wait_healthy(url, [proc], timeout=300)
        return _load_figures(url, streams)
    finally:
        proc.stop()


def _load_figures(url: str, streams: int) -> list[dict]:
    prompts = [f"Stream {i} tells of {'ships ' * (i % 9)}and gulls." for i in range(streams)]
    solo = [complete(url, ADMIN, p, max_tokens=24, ignore_eos=True).json()["choices"][0]["text"] for p in prompts]
    pre = metric(url, "kvreuse:num_preemptions_total")
    with ThreadPoolExecutor(streams) as pool:
        together = list(pool.map(lambda p: stream_text(url, ADMIN, p, 24), prompts))
    preempted = metric(url, "kvreuse:num_preemptions_total") - pre
    failed = sum(1 for _, e in together if e != "done")
    differing = sum(1 for (t, e), s in zip(together, solo) if e == "done" and t != s)

    def used() -> float:
        return metric(url, "kvreuse:num_blocks_used")

    idle_after = used()

    def drop(i: int) -> None:
        try:
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                headers=auth(ADMIN),
                timeout=60,
                json={"prompt": prompts[i], "max_tokens": 200, "stream": True, "ignore_eos": True},
            ) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 3:
                        return  # the client goes away mid-stream
        except httpx.HTTPError:
            pass

    with ThreadPoolExecutor(30) as pool:
        list(pool.map(drop, range(30)))
    deadline = time.monotonic() + 30
    while used() and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = used()
    return [
        row(
            "load",
            f"{streams} concurrent greedy streams: failed / differing from alone",
            f"{failed} / {differing}",
            "0 / 0",
            failed == 0 and differing == 0,
        ),
        row("load", "preemptions during them", int(preempted), "> 0 (pool smaller than the load)", preempted > 0),
        row("load", "blocks in use after (idle pool)", int(idle_after), "0", idle_after == 0),
        row("load", "30 dropped clients: leaked blocks", int(leaked), "0", leaked == 0),
    ]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        pass


CLUSTER_CHECKS = {
    "body": body_limits,
    "explain": explain_needs_key,
    "tenants": cross_tenant_reads,
    "access_log": access_log,
    "smaller": smaller_items,
    "union": union_while_streaming,
    "kill": midstream_kill,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--only", nargs="*", choices=[*CLUSTER_CHECKS, "store", "load"], help="run only these checks")
    args = ap.parse_args()
    chosen = args.only or [*CLUSTER_CHECKS, "store", "load"]
    logs = tempfile.mkdtemp(prefix="campaign-")
    rows: list[dict] = []

    def run(name: str, fn: Callable[[], list[dict]]) -> None:
        print(f"... {name}", flush=True)
        try:
            rows.extend(fn())
        except Exception as exc:  # noqa: BLE001 - a crashed check is a failed row, not a lost campaign
            traceback.print_exc()
            rows.append(row(name, f"{name}: the check crashed", f"{type(exc).__name__}: {exc!s:.150}", "runs", False))

    with Cluster(args.model, logs) if any(n in CLUSTER_CHECKS for n in chosen) else _nothing() as c:
        for name in [n for n in CLUSTER_CHECKS if n in chosen]:  # the kill goes last: it takes an executor
            run(name, lambda name=name: CLUSTER_CHECKS[name](c))
    if "store" in chosen:
        run("store", lambda: corrupt_store(args.model, logs))
    if "load" in chosen:
        run("load", lambda: load_figures(args.model, logs))
    out = ROOT / "bench" / "results" / "campaign.json"
    write_json(out, {"model": args.model, "rows": rows})
    print("\n| finding | check | value | target | ok |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['finding']} | {r['check']} | {r['value']} | {r['target']} | {'yes' if r['ok'] else '**no**'} |")
    print(f"\n{sum(r['ok'] for r in rows)}/{len(rows)} checks pass; logs in {logs}")


if __name__ == "__main__":
    main()
