"""The CPU int4 kernel vs a transient dequantized bf16 copy + one dense GEMM, by row count.

    PYTHONPATH=src .venv/bin/python bench/int4_rows.py [--threads 2] [--reps 7]
    -> bench/results/int4_rows.json, bench/results/int4_rows.png

For the default model's layer shapes (fused q/k/v 960 x 576, o_proj 576 x 576, fused gate/up
3,072 x 576, down_proj 576 x 1,536; random weights, int4 group 32, bf16 activations), each row
count runs ``_weight_int4pack_mm_for_cpu`` and ``F.linear(x, Int4Linear.unpacked_weight())``
back to back (interleaved), median of ``--reps`` timings of a few calls each. Summed over the
four shapes (one decoder layer), it shows where ``quant.DENSE_MIN_ROWS`` should sit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvreuse.models.quant import DENSE_MIN_ROWS, Int4Linear

RESULTS = Path(__file__).parent / "results"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = [1, 8, 16, 32, 64, 96, 128, 192, 256, 512]


def _ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = [Int4Linear(torch.randn(n, k, generator=gen), None, torch.bfloat16) for n, k in SHAPES]
    result = {"threads": args.threads, "reps": args.reps, "dense_min_rows": DENSE_MIN_ROWS, "rows": {}}
    with torch.inference_mode():
        for rows in ROWS:
            xs = [torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES]
            kernel = lambda: [torch._weight_int4pack_mm_for_cpu(x, m.qweight, m.group, m.scale_zero)  # noqa: E731
                              for m, x in zip(layers, xs)]
            dense = lambda: [F.linear(x, m.unpacked_weight(x.dtype)) for m, x in zip(layers, xs)]  # noqa: E731
            kernel(), dense()
            calls = 3 if rows >= 128 else 10
            samples = {"kernel_ms": [], "dense_ms": []}
            for _ in range(args.reps):
                samples["kernel_ms"].append(_ms(kernel, calls))
                samples["dense_ms"].append(_ms(dense, calls))
            med = {k: round(statistics.median(v), 3) for k, v in samples.items()}
            result["rows"][rows] = {**med, "samples": samples}
            print(f"{rows:4d} rows: int4 kernel {med['kernel_ms']:7.2f} ms  dequantized + dense {med['dense_ms']:7.2f} ms"
                  " (one decoder layer's four matmuls)", flush=True)
    out = RESULTS / "int4_rows.json"
    out.write_text(json.dumps(result, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("kernel_ms", "int4 kernel (_weight_int4pack_mm_for_cpu)"),
                       ("dense_ms", "dequantized bf16 copy + dense GEMM")):
        ax.plot(ROWS, [result["rows"][r][key] for r in ROWS], marker="o", label=label)
    ax.axvline(DENSE_MIN_ROWS, color="#999", linestyle="--", linewidth=1)
    ax.annotate(f"DENSE_MIN_ROWS = {DENSE_MIN_ROWS}", (DENSE_MIN_ROWS, ax.get_ylim()[1] * 0.9), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens in the call)")
    ax.set_ylabel("ms for one decoder layer's 4 matmuls (log)")
    ax.set_title(f"SmolLM2-135M shapes, int4 g32, bf16, {args.threads} threads, median of {args.reps}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
