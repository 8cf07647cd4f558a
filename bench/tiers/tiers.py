"""TTFT of a cached prefix + 32 new tokens served from each tier, side by side in one run.

    .venv/bin/python bench/tiers/tiers.py [--prefix 4096] [--suffix 32] [--reps 5] [--model default]

Five executors of one model (one loaded copy of the weights), each holding the same
``--prefix``-token prefix in exactly one place when the timed request arrives:

    device   the device pool (a plain prefix hit)
    host     the host tier only (device blocks pushed down just before)
    disk     the disk tier only (device and host emptied; the blocks were written through)
    redis    a real redis-server on loopback only (started by this script)
    none     nowhere: recomputed

Every repetition measures the five back to back (interleaved), each with a new suffix, so
machine noise hits them alike; figures are medians of ``--reps``. The request's usage says
where its cached tokens came from (``cached_tokens_by_tier``), which is checked. Also reported:
bytes moved per onboarding and the bandwidth reached, against this machine's memcpy bandwidth
measured in the same run (``bench/tiers/memcpy_bw.py``), the physical limit.

Writes bench/results/tiers.json and bench/results/tiers.png.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
TIERS = ("device", "host", "disk", "redis", "none")
LEVEL = {"device": "GPU", "host": "CPU", "disk": "DISK", "redis": "REMOTE"}


def push_device_to_host(llm: LLM) -> None:
    """Evict every cached device block (they go down to the host tier): allocate every free
    block through the admission path's allocator, then give them back."""
    engine = llm.engine
    blocks = engine.kv.allocate(engine.pool.num_free_blocks)
    engine.pool.release(reversed(blocks))
    assert engine.pool.num_cached_blocks == 0


def empty_device_and_host(llm: LLM) -> None:
    llm.engine.reset_prefix_cache()  # device and host; the disk / Redis copies stay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(RESULTS / "tiers.json"))
    args = ap.parse_args()

    import bench.tiers.memcpy_bw as memcpy_bw
    from bench.common import RedisServer  # only the redis tier needs it

    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    vocab = loaded.shape.vocab_size
    per_token = loaded.kv_bytes_per_token()
    max_len = args.prefix + args.suffix + 16
    gib = 1.5 * max_len * per_token / 2**30 + 0.05  # the prefix and one request fit the device
    workdir = Path(tempfile.mkdtemp(prefix="kvreuse-tiers-"))
    redis = RedisServer(workdir)
    if redis.binary is None:
        raise SystemExit("bench/tiers/tiers.py needs redis-server (apt-get install redis-server)")
    redis.start()
    try:
        common = dict(loaded=loaded, kv_cache_memory_gib=gib, max_model_len=max(max_len, loaded.shape.max_model_len))
        host = dict(host_cache_memory_gib=2 * gib)
        llms = {
            "device": LLM(**common),
            "host": LLM(**common, **host),
            "disk": LLM(**common, **host, disk_cache_dir=str(workdir / "disk")),
            "redis": LLM(**common, **host, remote_cache=redis.url),
            "none": LLM(**common, enable_prefix_caching=False),
        }
        rng = random.Random(0)
        prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix)]

        def suffix() -> list[int]:
            return [rng.randrange(100, vocab - 100) for _ in range(args.suffix)]

        for llm in llms.values():  # warm: the prefix computed once on each
            llm.generate(prefix + suffix(), ONE_TOKEN)
            if llm.engine.host is not None and llm.engine.host.below is not None:
                assert llm.engine.host.below.flush(120)
        prepare = {
            "device": lambda llm: None,
            "host": push_device_to_host,
            "disk": empty_device_and_host,
            "redis": empty_device_and_host,
            "none": lambda llm: None,
        }
        ttft: dict[str, list[float]] = {t: [] for t in TIERS}
        cached: dict[str, list[dict]] = {t: [] for t in TIERS}
        for rep in range(-1, args.reps):  # rep -1: an untimed warm-up round (first-call costs)
            for name in TIERS:
                llm = llms[name]
                prepare[name](llm)
                started = time.perf_counter()
                out = llm.generate(prefix + suffix(), ONE_TOKEN)[0]
                if rep < 0:
                    continue
                ttft[name].append(time.perf_counter() - started)
                cached[name].append(out.cached_tokens_by_tier or {"GPU": out.num_cached_tokens})
                print(
                    f"rep {rep} {name:>6}: {ttft[name][-1] * 1e3:8.1f} ms  cached {cached[name][-1]}", file=sys.stderr
                )
        bandwidth = memcpy_bw.measure(256, 5)["host_to_host"]
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    full_blocks = args.prefix // llms["device"].engine.block_size
    moved = full_blocks * llms["device"].engine.block_size * per_token  # bytes onboarded per request
    for name in ("device", "host", "disk", "redis"):  # every timed request found the prefix where we put it
        for split in cached[name]:
            assert split.get(LEVEL[name], 0) >= moved // per_token, (name, split)
    med = {t: statistics.median(v) for t, v in ttft.items()}
    result = {
        "model": loaded.name,
        "dtype": args.dtype,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "reps": args.reps,
        "median_ttft_s": {t: round(v, 4) for t, v in med.items()},
        "ttft_s": {t: [round(x, 4) for x in v] for t, v in ttft.items()},
        "vs_device_hit": {t: round(med[t] / med["device"], 2) for t in TIERS},
        "bytes_onboarded_per_request": moved,
        "extra_seconds_vs_device": {t: round(med[t] - med["device"], 4) for t in ("host", "disk", "redis")},
        "bandwidth_gb_s": {
            t: round(moved / max(med[t] - med["device"], 1e-9) / 1e9, 2) for t in ("host", "disk", "redis")
        },
        "memcpy_host_to_host_gb_s": bandwidth["median_gb_s"],
        "cached_tokens_by_tier": {t: cached[t][-1] for t in TIERS},
        "command": "python bench/tiers/tiers.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    write_json(out, result)
    print(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    names = list(TIERS)
    values = [result["median_ttft_s"][t] * 1e3 for t in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["#2b7", "#49c", "#a7c", "#c55", "#999"])
    ax.set_yscale("log")
    for bar, t in zip(bars, names):
        ax.annotate(
            f"{result['median_ttft_s'][t] * 1e3:.0f} ms\n{result['vs_device_hit'][t]}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(
        f"{result['model']}: {result['prefix_tokens']}-token prefix + {result['suffix_tokens']} new, "
        f"served from each tier (median of {result['reps']})",
        fontsize=9,
    )
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
