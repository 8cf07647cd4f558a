"""The CPU int4 kernels (PyTorch's and kvreuse's own) vs a transient dequantized copy + one dense
GEMM, by row count.

    PYTHONPATH=src .venv/bin/python bench/quant/int4_rows.py [--threads 2] [--reps 7] [--act float32] [--tag _epyc]
    -> bench/results/int4_rows<tag>.json, bench/results/int4_rows<tag>.png

``--act`` is the activation dtype (bf16 by default; fp32 is what ``--dtype float32`` with a
quantized model runs). The dense product runs in bf16 and in fp32 (the activations cast to
fp32 and back), so the plot shows where ``quant.dense_dtype`` should switch on this CPU
(``cpu_has_fast_bf16`` in the JSON: AMX / AVX512-BF16 or not).

For the default model's layer shapes (fused q/k/v 960 x 576, o_proj 576 x 576, fused gate/up
3,072 x 576, down_proj 576 x 1,536; random weights, int4 group 32, bf16 activations), each row
count runs ``_weight_int4pack_mm_for_cpu`` and ``F.linear(x, Int4Linear.unpacked_weight())``
back to back (interleaved), and, where they are built, kvreuse's own kernels
(``Int4Linear.native_linear``, ``models/kernels``), median of ``--reps`` timings of a few calls
each. Summed over the four shapes (one decoder layer), it shows where ``quant.dense_dtype``
should switch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvreuse.models.quant import Int4Linear, dense_dtype, fast_bf16_cpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

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
    ap.add_argument("--act", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    args = ap.parse_args()
    act = getattr(torch, args.act)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in SHAPES]
    layers = [Int4Linear(w, None, act, native=False) for w in weights]
    natives = [m for m in (Int4Linear(w, None, act) for w in weights) if m.native]
    held = natives or layers  # what kvreuse holds: the dense arms unpack its layout
    result = {
        "threads": args.threads,
        "reps": args.reps,
        "act": args.act,
        "cpu_has_fast_bf16": fast_bf16_cpu(),
        "dense_from_rows": next(r for r in range(1, 1 << 16) if dense_dtype(r, act) is not None),
        "rows": {},
    }
    with torch.inference_mode():
        for rows in ROWS:
            xs = [torch.randn(rows, k, generator=gen).to(act) for _, k in SHAPES]

            def kernel(xs=xs):
                return [
                    torch._weight_int4pack_mm_for_cpu(x, m.qweight, m.group, m.scale_zero) for m, x in zip(layers, xs)
                ]

            def dense(xs=xs):
                return [F.linear(x.bfloat16(), m.unpacked_weight(torch.bfloat16)) for m, x in zip(held, xs)]

            def dense32(xs=xs):
                return [F.linear(x.float(), m.unpacked_weight(torch.float32)).to(act) for m, x in zip(held, xs)]

            def native(xs=xs):
                return [m.native_linear(x) for m, x in zip(natives, xs)]

            kernel(), dense(), dense32()
            calls = 3 if rows >= 128 or act == torch.float32 else 10
            samples: dict[str, list[float]] = {"kernel_ms": [], "dense_ms": [], "dense_fp32_ms": []}
            if natives:
                samples["native_ms"] = []
                native()
            for _ in range(args.reps):  # interleaved
                samples["kernel_ms"].append(_ms(kernel, calls))
                if natives:
                    samples["native_ms"].append(_ms(native, calls))
                samples["dense_ms"].append(_ms(dense, calls))
                samples["dense_fp32_ms"].append(_ms(dense32, calls))
            med = {k: round(statistics.median(v), 3) for k, v in samples.items()}
            result["rows"][rows] = {**med, "runs_dense_in": str(dense_dtype(rows, act)), "samples": samples}
            print(
                f"{rows:4d} rows: int4 kernel {med['kernel_ms']:7.2f} ms"
                f"  kvreuse's {med.get('native_ms', float('nan')):7.2f} ms"
                f"  dequantized + dense bf16 {med['dense_ms']:7.2f} ms, fp32 {med['dense_fp32_ms']:7.2f} ms"
                " (one decoder layer's four matmuls;"
                f" kvreuse runs: {dense_dtype(rows, act) or 'kernel'})",
                flush=True,
            )
    out = RESULTS / f"int4_rows{args.tag}.json"
    write_json(out, result)

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (
        ("kernel_ms", "int4 kernel (_weight_int4pack_mm_for_cpu)"),
        ("dense_ms", "dequantized bf16 copy + dense bf16 GEMM"),
        ("dense_fp32_ms", "dequantized fp32 copy + dense fp32 GEMM"),
        ("native_ms", "kvreuse's int4 kernel (models/kernels)"),
    ):
        if key in result["rows"][ROWS[0]]:
            ax.plot(ROWS, [result["rows"][r][key] for r in ROWS], marker="o", label=label)
    switch = result["dense_from_rows"]  # where kvreuse goes dense
    ax.axvline(switch, color="#999", linestyle="--", linewidth=1)
    ax.annotate(f"dense from {switch} rows ({dense_dtype(switch, act)})", (switch, ax.get_ylim()[1] * 0.9), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens in the call)")
    ax.set_ylabel("ms for one decoder layer's 4 matmuls (log)")
    cpu = "native bf16" if result["cpu_has_fast_bf16"] else "no native bf16"
    ax.set_title(
        f"SmolLM2-135M shapes, int4 g32, {args.act} activations,\n{cpu}, {args.threads} threads, median of {args.reps}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
