"""This machine's memcpy bandwidth: the physical limit a tier's copy can approach.

    .venv/bin/python bench/tiers/memcpy_bw.py [--mib 256] [--reps 5] [--threads N]
    -> bench/results/memcpy_bw.json

``dst.copy_(src)`` of one contiguous uint8 tensor of ``--mib`` MiB, host to host (torch's
CPU copy, ``--threads`` intra-op threads, default torch's own choice); with CUDA also
pinned host -> device, device -> pinned host and device -> device. Each direction: one
untimed warm-up (page faults, allocator), then ``--reps`` timed copies; reported is the
median in GB/s (10^9 bytes per second) with the min and max. The tier benchmark quotes these
numbers beside the bandwidth its onboarding reached.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, write_json


def _time_copy(dst: torch.Tensor, src: torch.Tensor, reps: int, sync) -> list[float]:
    dst.copy_(src)  # warm-up: faults every page in, both sides
    sync()
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds


def _summary(nbytes: int, seconds: list[float]) -> dict:
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return {
        "median_gb_s": round(statistics.median(rates), 3),
        "min_gb_s": round(rates[0], 3),
        "max_gb_s": round(rates[-1], 3),
        "median_s": round(statistics.median(seconds), 6),
    }


def measure(mib: int, reps: int) -> dict[str, dict]:
    """GB/s per direction, ``{direction: {median_gb_s, min_gb_s, max_gb_s, median_s}}``."""
    nbytes = mib << 20
    src = torch.ones(nbytes, dtype=torch.uint8)  # [nbytes]
    dst = torch.empty_like(src)
    results = {"host_to_host": _summary(nbytes, _time_copy(dst, src, reps, lambda: None))}
    del dst
    if torch.cuda.is_available():
        sync = torch.cuda.synchronize
        pinned = src.pin_memory()
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        results["pinned_host_to_device"] = _summary(nbytes, _time_copy(device, pinned, reps, sync))
        results["device_to_pinned_host"] = _summary(nbytes, _time_copy(pinned, device, reps, sync))
        other = torch.empty_like(device)
        # a device-to-device copy reads and writes: count the bytes once, like the others
        results["device_to_device"] = _summary(nbytes, _time_copy(other, device, reps, sync))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the copied tensor (MiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS / "memcpy_bw.json")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = measure(args.mib, args.reps)
    report = {
        "what": "torch dst.copy_(src) of one contiguous uint8 tensor; GB/s = 1e9 bytes/s; median of reps",
        "mib": args.mib,
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    for direction, r in results.items():
        print(f"{direction:>24}: {r['median_gb_s']:8.2f} GB/s (min {r['min_gb_s']:.2f}, max {r['max_gb_s']:.2f})")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
