"""Decode throughput with KV events published over ZMQ vs events off, side by side.

Both engines share one loaded model and run the same greedy batch, alternating rounds
(off, on, off, on, ...) so drift hits both; the prefix cache is reset before every round
so each round stores (and the reset removes) the same blocks. Rounds come in adjacent
triples (off, on, and a control engine also with events off), the order rotating; the
JSON has the ratio of medians, the median of per-round ratios, and control/off, which is
the noise floor of the machine the figure must be read against. "On" means the full path:
EventBuffer -> ZmqEventPublisher thread -> PUB socket -> a subscriber in another process.

    .venv/bin/python bench/events/events.py --model default --rounds 5
    -> bench/results/events.json, bench/results/events.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.publisher import ZmqEventPublisher

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

SUBSCRIBER = r"""
import sys, msgpack, zmq
sock = zmq.Context().socket(zmq.SUB); sock.setsockopt(zmq.SUBSCRIBE, b""); sock.connect(sys.argv[1])
poller = zmq.Poller(); poller.register(sock, zmq.POLLIN); poller.register(sys.stdin, zmq.POLLIN)
batches = events = 0
print("ready", flush=True)
while True:
    ready = dict(poller.poll())
    if sock in ready:
        _, seq, payload = sock.recv_multipart()
        batches += 1; events += len(msgpack.unpackb(payload)[1])
    elif ready:  # stdin closed: the bench is done
        break
print(batches, events, flush=True)
"""


def load(model: str, device: str):
    if model.startswith("tiny"):
        from kvreuse.models.tiny import tiny_model

        return tiny_model("llama", seed=0)
    from kvreuse.models.loader import load_model

    return load_model(model, device=device)


def prompts(batch: int, prefix_len: int, tokenizer) -> list[list[int]]:
    """A shared system prefix plus a distinct question each, as token ids."""
    system = tokenizer.encode("You are a careful assistant. " * (prefix_len // 6 + 1))[:prefix_len]
    return [system + tokenizer.encode(f" Question {i}: name a colour.") for i in range(batch)]


def one_round(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process, all threads: the
    publisher thread's work included, other tenants of a shared machine excluded)."""
    llm.reset_prefix_cache()
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(batch, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.output_token_ids) for o in outs)
    return tokens / elapsed, tokens / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="a --model spec, or 'tiny' (random 2-layer Llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--buffer-size", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 steadies a shared machine)")
    ap.add_argument("--out", default=str(RESULTS / "events"))
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error("--rounds must be >= 5 (the result is a median)")

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    loaded = load(args.model, args.device)
    cfg = dict(block_size=args.block_size, kv_cache_memory_gib=0.25, device=args.device)
    llm_off = LLM(args.model, loaded=loaded, events=None, **cfg)
    buffer = EventBuffer(args.buffer_size)
    llm_on = LLM(args.model, loaded=loaded, events=buffer, **cfg)
    publisher = ZmqEventPublisher(buffer, "tcp://127.0.0.1:*", topic="kv-events").start()
    sub = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, publisher.endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert sub.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # let the SUB connection finish (ZMQ slow joiner)

    batch = prompts(args.batch, args.prefix_len, loaded.tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    one_round(llm_off, batch, params), one_round(llm_on, batch, params)  # warm-up, not counted
    # A third engine, also with events off, runs the same rounds: off-vs-control is the
    # noise floor of this machine, to read the on-vs-off figure against.
    llm_ctl = LLM(args.model, loaded=loaded, events=None, **cfg)
    one_round(llm_ctl, batch, params)
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": [], "control": []}
    engines = {"off": llm_off, "on": llm_on, "control": llm_ctl}
    orders = (("off", "on", "control"), ("on", "control", "off"), ("control", "off", "on"))
    for i in range(args.rounds):  # adjacent triples, order rotating, so drift cancels
        for name in orders[i % 3]:
            runs[name].append(one_round(engines[name], batch, params))
        print(
            f"round {i}: " + ", ".join(f"{k} {v[-1][0]:.1f}" for k, v in runs.items()) + " tok/s",
            file=sys.stderr,
            flush=True,
        )
    off, on, ctl = ([w for w, _ in runs[k]] for k in ("off", "on", "control"))
    off_cpu, on_cpu = [c for _, c in runs["off"]], [c for _, c in runs["on"]]
    deadline = time.monotonic() + 10
    while publisher.last_event_id < buffer.last_event_id and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the last batches cross the socket
    publisher.close()
    received = sub.communicate("", timeout=30)[0].split()

    cpu_per_event = full_path_cpu_per_event()
    tokens_per_round = args.batch * args.max_tokens
    events_per_token = (buffer.last_event_id + 1) / (tokens_per_round * (args.rounds + 1))  # +1: warm-up
    implied_overhead = events_per_token * cpu_per_event * statistics.median(off_cpu)  # (s/event)*(tokens/s)
    result = {
        "model": args.model,
        "device": args.device,
        "batch": args.batch,
        "prefix_len": args.prefix_len,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "rounds": args.rounds,
        "tokens_per_s_off": off,
        "tokens_per_s_on": on,
        "median_off": statistics.median(off),
        "median_on": statistics.median(on),
        "ratio_on_over_off": statistics.median(on) / statistics.median(off),
        "median_paired_ratio": statistics.median(a / b for a, b in zip(on, off)),
        "tokens_per_s_control": ctl,
        "noise_floor_control_over_off": statistics.median(ctl) / statistics.median(off),
        "noise_floor_paired": statistics.median(a / b for a, b in zip(ctl, off)),
        "tokens_per_cpu_s_off": off_cpu,
        "tokens_per_cpu_s_on": on_cpu,
        "cpu_ratio_on_over_off": statistics.median(on_cpu) / statistics.median(off_cpu),
        "cpu_us_per_event_full_path": cpu_per_event * 1e6,
        "events_per_token": events_per_token,
        "implied_ratio_from_event_cost": 1 / (1 + implied_overhead),
        "events_emitted": buffer.last_event_id + 1,
        "events_dropped": buffer.num_dropped,
        "batches_published": publisher.num_batches,
        "events_lost_by_publisher": publisher.num_events_lost,
        "subscriber_received": {"batches": int(received[0]), "events": int(received[1])} if received else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), result)
    plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "median_off",
                    "median_on",
                    "ratio_on_over_off",
                    "median_paired_ratio",
                    "noise_floor_control_over_off",
                    "noise_floor_paired",
                    "cpu_ratio_on_over_off",
                    "cpu_us_per_event_full_path",
                    "implied_ratio_from_event_cost",
                    "events_emitted",
                    "batches_published",
                    "subscriber_received",
                )
            },
            indent=2,
        )
    )


def full_path_cpu_per_event(n: int = 20_000) -> float:
    """CPU seconds (all threads of this process) per event for append + publish: the
    engine thread's buffer append plus the publisher thread's conversion, msgpack and send."""
    from kvreuse.events.records import BlocksStored, StoredBlock

    buffer = EventBuffer(n)
    publisher = ZmqEventPublisher(buffer, "tcp://127.0.0.1:*").start()
    record = BlocksStored(None, (StoredBlock(b"\x01" * 32, tuple(range(16)), 35),), 16)
    start = time.process_time()
    for _ in range(n):
        buffer.append(record)
    while publisher.last_event_id < buffer.last_event_id:
        time.sleep(0.001)
    cpu = time.process_time() - start
    publisher.close()
    return cpu / n


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 4))
    bars = (
        ("tokens_per_s_off", "events off", "#9ab"),
        ("tokens_per_s_on", "events over ZMQ", "#5a8"),
        ("tokens_per_s_control", "events off\n(control)", "#ccc"),
    )
    for x, (key, _label, color) in enumerate(bars):
        values = result[key]
        ax.bar(x, statistics.median(values), color=color)
        ax.scatter([x] * len(values), values, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(bars)), [label for _, label, _ in bars])
    ax.set_ylabel("decode throughput (tokens/s, median of rounds)")
    ax.set_title(
        f"{result['model']} on {result['device']}: on/off {result['ratio_on_over_off']:.3f}, "
        f"control/off {result['noise_floor_control_over_off']:.3f}",
        fontsize=9,
    )
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
