"""The router refuses hostile bodies before doing work: time and router memory for a 50 MB
(and a 20 MB) body sent without a key, with and without Content-Length, and explain
without a key. Two ``kvreuse serve`` executors (tiny random Llama, ``--api-key``) behind a
``kvreuse route --executor-api-key`` (so the router requires the key too).

    PYTHONPATH=src .venv/bin/python bench/router/router_guards.py [--model tiny:llama]

Memory is the router process's resident set (``/proc/PID/status``): VmRSS before and after,
and the growth of its peak (VmHWM). Writes bench/results/router_guards.json.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, Proc, free_port, wait_healthy, write_json

KEY = "bench-key"


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def post_raw(port: int, size: int, *, chunked: bool) -> tuple[int, float]:
    """POST ``size`` bytes to /v1/completions with no key; (status, seconds to the status line).
    The body is sent from a thread, so an early answer is seen while it is still uploading."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n")
        + "\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    piece = b"x" * (1 << 20)

    def upload() -> None:
        try:
            sent = 0
            while sent < size:
                n = min(len(piece), size - sent)
                sock.sendall(b"%x\r\n%s\r\n" % (n, piece[:n]) if chunked else piece[:n])
                sent += n
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the router answered and closed: the rest was never read

    start = time.perf_counter()
    sock.sendall(head)
    threading.Thread(target=upload, daemon=True).start()
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    elapsed = time.perf_counter() - start
    sock.close()
    return int(data.split()[1]), elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:llama")
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="router-guards-")
    ports = [free_port(), free_port()]
    execs = [
        Proc(
            [
                "serve",
                "--model",
                args.model,
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
                "--api-key",
                KEY,
                "--log-level",
                "warning",
            ],
            f"{logs}/executor-{p}.log",
        ).start()
        for p in ports
    ]
    rport = free_port()
    route = Proc(
        [
            "route",
            "--port",
            str(rport),
            "--log-level",
            "warning",
            "--executor-api-key",
            KEY,
            *[a for p in ports for a in ("--executor", f"http://127.0.0.1:{p}")],
        ],
        f"{logs}/router.log",
    )
    results: dict = {"model": args.model, "body_limit_bytes": 8 * 1024 * 1024, "cases": []}
    try:
        for p, e in zip(ports, execs):
            wait_healthy(f"http://127.0.0.1:{p}", [e])
        route.start()
        url = f"http://127.0.0.1:{rport}"
        wait_healthy(url, [route], all_of=2)
        for mb in (20, 50):
            for chunked in (False, True):
                before = rss_kib(route.popen.pid)
                status, seconds = post_raw(rport, mb * 1024 * 1024, chunked=chunked)
                time.sleep(0.5)
                after = rss_kib(route.popen.pid)
                results["cases"].append(
                    {
                        "body_mb": mb,
                        "content_length": not chunked,
                        "status": status,
                        "seconds": round(seconds, 4),
                        "rss_growth_mb": round((after["VmRSS"] - before["VmRSS"]) / 1024, 1),
                        "peak_growth_mb": round((after["VmHWM"] - before["VmHWM"]) / 1024, 1),
                    }
                )
        body = {"prompt": "a confidential prompt", "max_tokens": 1}
        results["explain_without_key"] = httpx.post(f"{url}/v1/route/explain", json=body).status_code
        results["explain_with_key"] = httpx.post(
            f"{url}/v1/route/explain", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ).status_code
        results["router_still_serving"] = httpx.post(
            f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ).status_code
    finally:
        route.stop()
        for e in execs:
            e.stop()
    out = RESULTS / "router_guards.json"
    write_json(out, results)
    print(f"{'body':>6} {'Content-Length':>14} {'status':>6} {'seconds':>8} {'RSS +MB':>8} {'peak +MB':>8}")
    for c in results["cases"]:
        print(
            f"{c['body_mb']:>4}MB {str(c['content_length']):>14} {c['status']:>6} {c['seconds']:>8} "
            f"{c['rss_growth_mb']:>8} {c['peak_growth_mb']:>8}"
        )
    print(
        f"explain without key: {results['explain_without_key']}, with key: {results['explain_with_key']}; "
        f"completion after: {results['router_still_serving']}"
    )


if __name__ == "__main__":
    main()
