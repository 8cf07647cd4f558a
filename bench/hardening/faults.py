"""The hardening campaign of issue 31 (faults, determinism, telemetry seal): each numbered
finding reproduced against real processes, with what it shows now. Extends campaign.py (issue
15's), reusing its cluster (two ``kvreuse serve`` executors behind ``kvreuse route``, one
admin key and tenant keys ``alice`` and ``bob`` everywhere) and its row format.

    PYTHONPATH=src .venv/bin/python bench/hardening/faults.py [--only a,b,c,d,e] [--model tiny:llama]
        [--streams 8] [--hung-streams 40] [--hung-stop-s 40] [--prompts 6] [--prompt-tokens 1500]
        [--max-tokens 16] [--tag NAME]
    -> bench/results/faults.json, bench/results/faults.png, the rows as a Markdown table on stdout

Parts (``--only``; all by default):

- ``a`` (finding 1, validation): a tiny ``top_p`` and a dozen other edge values from tenant
  alice, to the router and straight to each executor, while 4 greedy streams of tenant bob run
  through the router: each a 400 or a 200 with a finished choice, never a 5xx, and bob's
  streams identical to an undisturbed run of the same 4.
- ``b`` (finding 1, containment): the executors run with ``--debug-step-fault`` (test only,
  ``kvreuse.engine.step_faults``): alice's requests with ids ``campaign-fault-*`` fail in the
  forward once they have 6 tokens, ``campaign-sfault-*`` in sampling at 3; beside bob's 4
  streams. Only they fail (error event / 500 with code ``request_failed``, not migrated), bob's
  streams are identical, the pools go back to 0 blocks.
- ``c`` (finding 2): SIGSTOP of the executor serving the first of ``--streams`` greedy streams
  (half chat), SIGCONT ``--stop-s`` later: no stream waits longer than the router's progress
  deadline (10 s, ``--upstream-progress-timeout``), 0 silent cuts, migrated greedy text
  identical to an undisturbed run. The cluster probes health every 0.3 s. Then the issue's own
  case, the same with ``--hung-streams`` (40) streams and the executor stopped ``--hung-stop-s``
  (40 s), as bench/router/hung_executor.py runs it (the executors then take ``--max-num-seqs``
  streams + 4 and 0.03 GiB of KV each, so 40 streams fit one executor after the move).
- ``d`` (finding 3): in process, the real model (``--det-model``, default ``default``) at the
  default bf16 + int4, ``--prompts`` chat prompts of ``--prompt-tokens`` tokens, greedy: the
  tokens of a miss, a device hit, a hit from the host tier and a hit from the disk tier, at the
  defaults (deterministic where kvreuse's kernels make it free: target 0) and with the fast
  forward (``deterministic=False``, ``kvreuse serve --no-deterministic``: the finding): prompts
  differing from the miss, per variant and mode.
- ``e`` (finding 4): a server with API keys and CURVE events, a subscriber without credentials
  (receives nothing) and one with an allowed key (control: decodes the tenant's prompt); a
  server with API keys and no CURVE on loopback: a plain subscriber reads the token ids (the
  finding, as documented); its ``/metrics`` (tenant limits on) names tenants to the admin key only.
"""

from __future__ import annotations

import argparse
import gc
import json
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
from bench.common import RESULTS, free_port, pyplot, save_png, wait_healthy, write_json
from bench.hardening.campaign import ADMIN, ALICE, BOB, Cluster, auth, row
from bench.router.router_migration import EXECUTOR_HEADER, outcome, request, stall
from tests.serve_client import metric

FAULT, SFAULT = "campaign-fault-", "campaign-sfault-"
FAULT_ARGS = ("--debug-step-fault", f"forward:{FAULT}@6", "--debug-step-fault", f"sample:{SFAULT}@3")
PROGRESS_DEADLINE_S = 10.0  # kvreuse route's default --upstream-progress-timeout
BOB_PROMPTS = [
    f"Bob's stream {i} describes the {['harbour', 'orchard', 'mill', 'quarry'][i]} in detail." for i in range(4)
]

# finding 1: edge values of the sampling fields (raw JSON: NaN and Infinity literals too)
EDGES: list[tuple[str, dict]] = [
    ("top_p 5e-324 (0 in fp32: the finding)", {"top_p": 5e-324, "temperature": 1.0}),
    ("top_p 1e-38", {"top_p": 1e-38, "temperature": 1.0}),
    ("top_p 1e-37 (the smallest allowed)", {"top_p": 1e-37, "temperature": 1.0, "seed": 7}),
    ("temperature 5e-324", {"temperature": 5e-324}),
    ("temperature 1e-300, top_p 1e-37", {"temperature": 1e-300, "top_p": 1e-37}),
    ("temperature NaN", {"temperature": float("nan")}),
    ("top_p Infinity", {"top_p": float("inf"), "temperature": 1.0}),
    ("top_k 2**62", {"top_k": 2**62, "temperature": 1.0, "seed": 7}),
    ("top_k -2", {"top_k": -2, "temperature": 1.0}),
    ("min_p 1e-320", {"min_p": 1e-320}),
    ("presence_penalty 1e308", {"presence_penalty": 1e308}),
    ("repetition_penalty 5e-324", {"repetition_penalty": 5e-324}),
    ("logit_bias {0: 1e308}", {"logit_bias": {"0": 1e308}}),
    ("seed 2**63", {"seed": 2**63, "temperature": 1.0}),
    ("stop ['']", {"stop": [""]}),
]


# ------------------------------------------------------------------------------ streams
def stream(url: str, key: str, path: str, body: dict, seen: Callable[[str | None, int], None] | None = None) -> dict:
    """One stream with ``key``: its executor, events (parsed) and arrival times
    (``router_migration.stream`` with the campaign's keys)."""
    events, times, served_by = [], [], None
    try:
        with httpx.stream("POST", url + path, json=body, headers=auth(key), timeout=300) as r:
            served_by = r.headers.get(EXECUTOR_HEADER)
            if r.status_code != 200:
                events.append({"status": r.status_code, "body": r.read().decode(errors="replace")[:300]})
                return {"executor": served_by, "events": events, "times": times}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                    times.append(time.perf_counter())
                    if seen is not None:
                        seen(served_by, len(events))
    except httpx.HTTPError as exc:
        events.append({"transport_error": repr(exc)})
    return {"executor": served_by, "events": events, "times": times}


def completion_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True, **extra}


def bob_streams(
    url: str, max_tokens: int, during: Callable[[], tuple[object, float]] | None = None
) -> tuple[list[tuple], object]:
    """Bob's 4 greedy streams through ``url`` at once; ``during()`` runs once each has its
    first chunks and returns ``(value, mark)``, a ``time.perf_counter()`` of interest.
    Returns ``([(kind, text, still running at mark)] in order, value)``."""
    started = [threading.Event() for _ in BOB_PROMPTS]

    def seen(i: int) -> Callable[[str | None, int], None]:
        return lambda _, n: started[i].set() if n >= 2 else None

    with ThreadPoolExecutor(len(BOB_PROMPTS)) as pool:
        futures = [
            pool.submit(stream, url, BOB, "/v1/completions", completion_body(p, max_tokens), seen(i))
            for i, p in enumerate(BOB_PROMPTS)
        ]
        for e in started:
            e.wait(120)
        result, mark = during() if during is not None else (None, time.perf_counter())
        results = [f.result(timeout=600) for f in futures]
    return [(*outcome(r, chat=False), bool(r["times"]) and r["times"][-1] > mark) for r in results], result


def bobs_rows(finding: str, disturbed: list[tuple], reference: list[tuple], what: str) -> list[dict]:
    """Bob's streams beside ``what``: identical to undisturbed, and still running when it was answered."""
    same = sum(1 for (k, t, _), (k0, t0, _) in zip(disturbed, reference) if k == k0 == "whole" and t == t0)
    running = sum(1 for *_, on in disturbed if on)
    return [
        row(
            finding,
            f"bob's 4 greedy streams beside {what}: whole and identical to undisturbed",
            f"{same}/4",
            "4/4",
            same == 4,
        ),
        row(
            finding,
            f"control: bob's streams still running when {what} was answered",
            f"{running}/4",
            "> 0",
            running > 0,
        ),
    ]


def idle_blocks(urls: list[str], timeout: float = 30) -> float:
    """Blocks in use over ``urls`` once they are idle (0 expected), waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        used = sum(metric(u, "kvreuse:num_blocks_used") for u in urls)
        if not used or time.monotonic() > deadline:
            return used
        time.sleep(0.3)


# ------------------------------------------------------------------------------ a: edge values
def edge_values(c: Cluster, max_tokens: int = 400) -> list[dict]:
    reference, _ = bob_streams(c.url, max_tokens)
    targets = {"router": c.url, "executor 0": c.executor_url(0), "executor 1": c.executor_url(1)}

    def barrage() -> tuple[list[tuple[str, str, int, str]], float]:
        answers, first_done = [], 0.0
        for name, extra in EDGES:
            for target, url in targets.items():
                body = {"prompt": "Alice asks about the weather.", "max_tokens": 4, **extra}
                r = httpx.post(
                    f"{url}/v1/completions",
                    content=json.dumps(body),
                    timeout=120,
                    headers={**auth(ALICE), "Content-Type": "application/json"},
                )
                try:
                    doc = r.json()
                except ValueError:
                    doc = {}
                finished = r.status_code == 200 and all(
                    ch.get("finish_reason") in ("stop", "length") for ch in doc.get("choices") or [{}]
                )
                detail = (
                    (doc.get("error") or {}).get("message", "")[:70]
                    if r.status_code != 200
                    else f"finish_reason {[ch.get('finish_reason') for ch in doc.get('choices', [])]}"
                )
                answers.append((name, target, r.status_code, detail if r.status_code == 400 or finished else "?"))
            first_done = first_done or time.perf_counter()  # the finding's value, answered by all three
        return answers, first_done

    disturbed, answers = bob_streams(c.url, max_tokens, barrage)
    rows = []
    for name, _ in EDGES:
        mine = [a for a in answers if a[0] == name]
        statuses = sorted({a[2] for a in mine})
        ok = all(s == 400 or (s == 200 and d != "?") for _, _, s, d in mine)
        rows.append(row("1a", f"{name}: router / executors", f"{statuses}: {mine[0][3]}", "400 or a finished 200", ok))
    rows += bobs_rows("1a", disturbed, reference, "the tiny top_p (the first edge value)")
    return rows


# ------------------------------------------------------------------------------ b: injected step failure
def step_failure(c: Cluster, max_tokens: int = 400) -> list[dict]:
    reference, _ = bob_streams(c.url, max_tokens)
    migrations_before = metric(c.url, "kvreuse:router_migrations_total")

    def faults() -> tuple[dict, float]:
        with ThreadPoolExecutor(3) as pool:
            routed = pool.submit(
                stream,
                c.url,
                ALICE,
                "/v1/completions",
                completion_body("Alice's doomed stream.", 40, request_id=f"{FAULT}1"),
            )
            direct = pool.submit(
                stream,
                c.executor_url(0),
                ALICE,
                "/v1/completions",
                completion_body("Alice's other doomed stream.", 40, request_id=f"{SFAULT}1"),
            )
            whole = pool.submit(
                httpx.post,
                f"{c.url}/v1/completions",
                headers=auth(ALICE),
                timeout=120,
                json={
                    "prompt": "Alice's doomed reply.",
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                    "request_id": f"{FAULT}2",
                },
            )
            got = {"routed": routed.result(), "direct": direct.result(), "whole": whole.result()}
            return got, time.perf_counter()

    disturbed, got = bob_streams(c.url, max_tokens, faults)
    rows = []
    for name in ("routed", "direct"):
        events = got[name]["events"]
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        texts = sum(1 for e in events if isinstance(e, dict) and e.get("choices"))
        code = errors[0].get("code") if errors else None
        rows.append(
            row(
                "1b",
                f"alice's {name} stream ({'forward' if name == 'routed' else 'sampling'} fault): "
                "chunks before, then the error event's code",
                f"{texts} chunks, {code}",
                "> 0 chunks, request_failed",
                texts > 0 and code == "request_failed",
            )
        )
    whole = got["whole"]
    rows.append(
        row(
            "1b",
            "alice's whole reply (forward fault): status, code",
            f"{whole.status_code}, {(whole.json().get('error') or {}).get('code')}",
            "500, request_failed",
            whole.status_code == 500 and whole.json()["error"]["code"] == "request_failed",
        )
    )
    migrated = metric(c.url, "kvreuse:router_migrations_total") - migrations_before
    rows.append(
        row("1b", "the router's migrations of those (the request's own fault)", int(migrated), "0", migrated == 0)
    )
    rows += bobs_rows("1b", disturbed, reference, "alice's failures")
    used = idle_blocks([c.executor_url(0), c.executor_url(1)])
    rows.append(row("1b", "blocks in use on the executors once idle", int(used), "0", used == 0))
    return rows


# ------------------------------------------------------------------------------ c: hung executor
def hung_executor(c: Cluster, streams: int, max_tokens: int, stop_s: float, out: dict, key: str = "hung") -> list[dict]:
    """SIGSTOP of the executor serving the first of ``streams`` greedy streams for ``stop_s``;
    the gaps go in ``out[key]``."""
    requests = [request(i, max_tokens) for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        reference = list(pool.map(lambda pr: stream(c.url, ADMIN, *pr), requests))
    chat = [path.endswith("chat/completions") for path, _ in requests]
    ref_text = [outcome(r, ch)[1] for r, ch in zip(reference, chat)]
    progress: dict[int, tuple[str | None, int]] = {}
    ready, lock = threading.Event(), threading.Lock()

    def seen_by(i: int) -> Callable[[str | None, int], None]:
        def seen(served_by: str | None, n: int) -> None:
            with lock:
                progress[i] = (served_by, n)
                if len(progress) == streams and all(k >= 3 for _, k in progress.values()):
                    ready.set()

        return seen

    by_url = {c.executor_url(i): e for i, e in enumerate(c.execs)}
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream, c.url, ADMIN, path, body, seen_by(i)) for i, (path, body) in enumerate(requests)]
        if not ready.wait(300):
            raise RuntimeError(f"streams never all started: {len(progress)} of {streams}")
        victim = next(served_by for _, (served_by, _) in sorted(progress.items()) if served_by)
        by_url[victim].popen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            results = [f.result(timeout=600) for f in futures]
        finally:
            time.sleep(max(0.0, stopped_at + stop_s - time.monotonic()))
            by_url[victim].popen.send_signal(signal.SIGCONT)
    kinds = [outcome(r, ch) for r, ch in zip(results, chat)]
    on = [r for r in results if r["executor"] == victim]
    gaps_on = sorted(round(stall(r), 3) for r in on)
    gaps_off = sorted(round(stall(r), 3) for r in results if r["executor"] != victim)
    out[key] = {"streams": streams, "stop_s": stop_s, "gaps_on_stopped_s": gaps_on, "gaps_elsewhere_s": gaps_off}
    cuts = sum(k == "silent_cut" for k, _ in kinds)
    whole = [(k, t, ref) for (k, t), ref in zip(kinds, ref_text) if k == "whole"]
    differing = sum(t != ref for _, t, ref in whole)
    worst = max(gaps_on + gaps_off, default=0.0)
    wait_healthy(c.url, [c.router, *c.execs], all_of=2)  # the stopped one is back before anything else runs
    return [
        row(
            "2",
            f"SIGSTOP of 1 of 2 executors for {stop_s:g} s under {streams} streams: streams on it",
            len(on),
            "> 0",
            on,
        ),
        row(
            "2",
            "longest wait of any stream for its next event (s)",
            worst,
            f"<= {PROGRESS_DEADLINE_S:g} (the progress deadline)",
            worst <= PROGRESS_DEADLINE_S,
        ),
        row(
            "2",
            "silent cuts / error events / whole",
            f"{cuts} / {sum(k == 'error_event' for k, _ in kinds)} / {len(whole)}",
            "0 / - / -",
            cuts == 0,
        ),
        row(
            "2",
            f"whole greedy streams differing from undisturbed (of {len(whole)})",
            differing,
            "0",
            differing == 0 and whole,
        ),
    ]


# ------------------------------------------------------------------------------ d: determinism over tiers
def determinism(args: argparse.Namespace, logs: str, out: dict) -> list[dict]:
    from bench.hardening.determinism import first_diff, make_prompts
    from kvreuse import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows, report = [], {}
    prompts: list[list[int]] | None = None
    for mode in ("default", "no-deterministic"):
        disk = tempfile.mkdtemp(prefix=f"det-disk-{mode}-", dir=logs)
        # the device pool holds about 1.5 prompts, so each next prompt pushes the one before to the host
        token_gib = 23040 / 2**30  # SmolLM2-135M's KV per token in bf16 (30 layers x 2 x 3 heads x 64 x 2 bytes)
        llm = LLM(
            args.det_model,
            kv_cache_memory_gib=args.prompt_tokens * 1.5 * token_gib,
            host_cache_memory_gib=args.prompts * args.prompt_tokens * 1.3 * token_gib + 0.01,
            disk_cache_dir=disk,
            deterministic=None if mode == "default" else False,  # None: the default (auto)
        )
        resolved = llm.engine.runner.deterministic
        if prompts is None:
            prompts = make_prompts(llm, args.prompts, args.prompt_tokens, seed=0)
        tokens, tiers, seconds = _tier_answers(llm, prompts, params)
        del llm
        gc.collect()
        differing = {
            v: sum(first_diff(a, b) is not None for a, b in zip(tokens["miss"], tokens[v]))
            for v in ("hit", "host", "disk")
        }
        report[mode] = {
            "deterministic": resolved,
            "differing_vs_miss": differing,
            "cached_tokens_by_tier": tiers,
            "seconds": round(seconds, 1),
        }
        for variant, label in (
            ("hit", "device hit"),
            ("host", "hit from the host tier"),
            ("disk", "hit from the disk tier"),
        ):
            cached = sum(t.get({"hit": "GPU", "host": "CPU", "disk": "DISK"}[variant], 0) for t in tiers[variant])
            n = differing[variant]
            rows.append(
                row(
                    "3",
                    f"{mode} (deterministic {resolved}): {label} vs miss, prompts differing "
                    f"(of {len(prompts)}; {cached} tokens from that tier)",
                    n,
                    "0" if mode == "default" else "(the fast forward: the finding)",
                    n == 0 if mode == "default" else True,
                )
            )
        rows.append(row("3", f"{mode}: seconds for the {4 * len(prompts)} requests", round(seconds, 1), "-", True))
    out["determinism"] = {
        "model": args.det_model,
        "prompt_tokens": [len(p) for p in prompts or []],
        "max_tokens": args.max_tokens,
        **report,
    }
    return rows


def _tier_answers(llm, prompts: list[list[int]], params) -> tuple[dict, dict, float]:
    """Each prompt's greedy tokens and cached tokens by tier: ``miss`` (first time), ``hit``
    (again at once: the device pool), ``host`` (after the others pushed it to the host tier),
    ``disk`` (after the device and host forgot it: only the disk tier holds it)."""
    tokens: dict[str, list[list[int]]] = {v: [] for v in ("miss", "hit", "host", "disk")}
    tiers: dict[str, list[dict]] = {v: [] for v in tokens}

    def answer(variant: str, prompt: list[int]) -> None:
        [o] = llm.generate(prompt, params)
        tokens[variant].append(list(o.token_ids))
        tiers[variant].append(dict(o.cached_tokens_by_tier or {}))

    t0 = time.perf_counter()
    for p in prompts:
        answer("miss", p)
        answer("hit", p)
    for p in prompts:  # each was pushed down to the host by the ones after it
        answer("host", p)
    llm.engine.stores.flush(120)  # the disk writes queued so far are done
    llm.reset_prefix_cache()  # device and host forget: only the disk tier holds them
    for p in prompts:
        answer("disk", p)
    return tokens, tiers, time.perf_counter() - t0


# ------------------------------------------------------------------------------ e: sealed events
def sealed_events(model: str, logs: str) -> list[dict]:
    import zmq
    import zmq.auth

    from bench.common import Proc
    from kvreuse.events.decoder import BlockStored, decode_batch

    keys, allowed = Path(logs) / "keys", Path(logs) / "allowed"
    keys.mkdir(exist_ok=True)
    allowed.mkdir(exist_ok=True)
    zmq.auth.create_certificates(str(keys), "server")
    zmq.auth.create_certificates(str(keys), "router")
    (allowed / "router.key").write_bytes((keys / "router.key").read_bytes())
    base = [
        "serve",
        "--model",
        model,
        "--device",
        "cpu",
        "--kv-cache-memory",
        "0.002",
        "--max-model-len",
        "512",
        "--api-key",
        ADMIN,
        "--api-key",
        f"{ALICE}:alice",
        "--log-level",
        "warning",
    ]
    pubs, ports = [free_port(), free_port()], [free_port(), free_port()]
    sealed = Proc(
        [
            *base,
            "--port",
            str(ports[0]),
            "--kv-events-endpoint",
            f"tcp://*:{pubs[0]}",
            "--kv-events-curve-secret-key",
            str(keys / "server.key_secret"),
            "--kv-events-curve-clients-dir",
            str(allowed),
        ],
        f"{logs}/sealed.log",
    )
    plain = Proc(
        [*base, "--port", str(ports[1]), "--kv-events-endpoint", f"tcp://*:{pubs[1]}", "--tenant-max-in-flight", "8"],
        f"{logs}/plain.log",
    )  # limits: tenant series on /metrics
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    ctx = zmq.Context()
    try:
        for p in (sealed, plain):
            p.start()
        for u in urls:
            wait_healthy(u, [sealed, plain], timeout=300)
        server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
        socks = {name: ctx.socket(zmq.SUB) for name in ("no key", "allowed key", "plain server")}
        socks["allowed key"].curve_publickey, socks["allowed key"].curve_secretkey = zmq.auth.load_certificate(
            str(keys / "router.key_secret")
        )
        socks["allowed key"].curve_serverkey = server_public
        for name, sock in socks.items():
            sock.linger = 0
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{pubs[1] if name == 'plain server' else pubs[0]}")
        heard: dict[str, list[int]] = {name: [] for name in socks}
        prompts: list[list[int]] = []
        deadline = time.monotonic() + 60
        while not (heard["allowed key"] and heard["plain server"]) and time.monotonic() < deadline:
            prompt = [(len(prompts) * 97 + i * 13) % 1500 + 100 for i in range(48)]  # alice's, as token ids
            prompts.append(prompt)
            for u in urls:
                httpx.post(
                    f"{u}/v1/completions", headers=auth(ALICE), timeout=60, json={"prompt": prompt, "max_tokens": 1}
                ).raise_for_status()
            time.sleep(0.5)
            for name, sock in socks.items():
                while sock.poll(0):
                    _, _, payload = sock.recv_multipart()
                    heard[name] += [
                        t for e in decode_batch(payload).events if isinstance(e, BlockStored) for t in e.token_ids
                    ]
        secret = {t for p in prompts for t in p}
        named = {
            key: 'tenant="alice"' in httpx.get(f"{urls[1]}/metrics", headers=auth(key) if key else {}).text
            for key in (None, ALICE, ADMIN)
        }
        return [
            row(
                "4",
                "CURVE + API keys: token ids a subscriber without credentials received",
                len(heard["no key"]),
                "0",
                not heard["no key"],
            ),
            row(
                "4",
                "control: the allowed key decodes alice's token ids",
                len(heard["allowed key"]),
                "> 0",
                heard["allowed key"] and set(heard["allowed key"]) <= secret,
            ),
            row(
                "4",
                "no CURVE (loopback, documented): a plain subscriber reads alice's token ids",
                len(heard["plain server"]),
                "> 0 (why CURVE)",
                True,
            ),
            row(
                "4",
                "executor /metrics names tenant alice: no key / alice's key / admin key",
                f"{named[None]} / {named[ALICE]} / {named[ADMIN]}",
                "False / False / True",
                (named[None], named[ALICE], named[ADMIN]) == (False, False, True),
            ),
        ]
    finally:
        ctx.destroy(linger=0)
        sealed.stop()
        plain.stop()


# ------------------------------------------------------------------------------ output
def plot(out: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cases = [out[k] for k in ("hung", "hung_40") if out.get(k)]
    if cases:
        data, labels = [], []
        for hung in cases:
            data += [hung["gaps_on_stopped_s"] or [0.0], hung["gaps_elsewhere_s"] or [0.0]]
            n, s = hung["streams"], hung["stop_s"]
            labels += [f"{n} streams, {s:g} s:\non the stopped one", f"{n} streams, {s:g} s:\nelsewhere"]
        left.boxplot(data, tick_labels=labels)
        left.tick_params(axis="x", labelsize=7)
        left.axhline(PROGRESS_DEADLINE_S, color="tab:red", linestyle="--", linewidth=1, label="progress deadline")
        left.set_ylabel("longest wait for the next event (s)")
        left.set_title("2: SIGSTOP of 1 of 2 executors")
        left.legend(fontsize=8)
    det = out.get("determinism")
    if det:
        variants = ["hit", "host", "disk"]
        for k, mode in enumerate(("default", "no-deterministic")):
            if mode in det:
                values = [det[mode]["differing_vs_miss"][v] for v in variants]
                right.bar([i + 0.4 * k for i in range(3)], values, width=0.4, label=mode)
        right.set_xticks([i + 0.2 for i in range(3)], ["device hit", "host hit", "disk hit"])
        right.set_ylabel(f"prompts differing from the miss (of {len(det['prompt_tokens'])})")
        right.set_title(f"3: greedy answers, {det['model']}")
        right.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="a,b,c,d,e", help="comma-separated parts (default: all)")
    ap.add_argument("--model", default="tiny:llama", help="the executors' model (parts a, b, c, e)")
    ap.add_argument("--streams", type=int, default=8, help="part c: concurrent streams")
    ap.add_argument("--stream-tokens", type=int, default=300, help="part c: max_tokens of each stream")
    ap.add_argument("--stop-s", type=float, default=15.0, help="part c: seconds the executor stays stopped")
    ap.add_argument("--hung-streams", type=int, default=40, help="part c's second case (issue 31's): streams")
    ap.add_argument("--hung-stop-s", type=float, default=40.0, help="part c's second case: seconds stopped")
    ap.add_argument("--det-model", default="default", help="part d: the model (the finding needs the real one)")
    ap.add_argument("--prompts", type=int, default=6, help="part d: prompts (issue 31 asks 20: ~4x part d's time)")
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="part d: tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=16, help="part d: greedy tokens per answer")
    ap.add_argument("--tag", default="", help="results go to faults[_TAG].json/png")
    args = ap.parse_args()
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    if unknown := set(chosen) - set("abcde"):
        ap.error(f"--only: unknown parts {sorted(unknown)} (a, b, c, d, e)")
    logs = tempfile.mkdtemp(prefix="faults-")
    rows: list[dict] = []
    out: dict = {}

    def run(name: str, fn: Callable[[], list[dict]]) -> None:
        print(f"... part {name}", flush=True)
        t0 = time.perf_counter()
        try:
            rows.extend(fn())
        except Exception as exc:  # noqa: BLE001 - a crashed part is a failed row, not a lost campaign
            traceback.print_exc()
            rows.append(row(name, f"part {name} crashed", f"{type(exc).__name__}: {exc!s:.150}", "runs", False))
        out.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)

    if any(p in chosen for p in "abc"):
        exec_args = FAULT_ARGS if "b" in chosen else ()
        if "c" in chosen:  # the 40 streams fit one executor once the other is stopped
            exec_args += ("--max-num-seqs", str(max(args.streams, args.hung_streams) + 4), "--kv-cache-memory", "0.03")
        with Cluster(args.model, logs, exec_args=exec_args) as c:
            if "a" in chosen:
                run("a", lambda: edge_values(c))
            if "b" in chosen:
                run("b", lambda: step_failure(c))
            if "c" in chosen:  # last: it stops an executor
                run("c", lambda: hung_executor(c, args.streams, args.stream_tokens, args.stop_s, out))
                run(
                    "c40",
                    lambda: hung_executor(c, args.hung_streams, args.stream_tokens, args.hung_stop_s, out, "hung_40"),
                )
    if "e" in chosen:
        run("e", lambda: sealed_events(args.model, logs))
    if "d" in chosen:
        run("d", lambda: determinism(args, logs, out))
    suffix = f"_{args.tag}" if args.tag else ""
    write_json(RESULTS / f"faults{suffix}.json", {"parts": chosen, "model": args.model, "rows": rows, **out})
    plot(out, RESULTS / f"faults{suffix}.png")
    print("\n| finding | check | value | target | ok |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['finding']} | {r['check']} | {r['value']} | {r['target']} | {'yes' if r['ok'] else '**no**'} |")
    passed = sum(r["ok"] for r in rows)
    print(f"\n{passed}/{len(rows)} checks pass; seconds per part {out.get('seconds')}; logs in {logs}")


if __name__ == "__main__":
    main()
