"""How fast the CPU int4 kernel reads weights in a decode step (one row), against the machine's
read bandwidth measured in the same run: the limit behind batch-1 decode on a model whose step
is weight reads (issue 32: the 1B files decode at ~0.6x llama-server's).

    PYTHONPATH=src .venv/bin/python bench/quant/int4_decode_bandwidth.py [--threads 1] [--reps 7] [--tag _core0]
    -> bench/results/int4_decode_bandwidth<tag>.{json,png}

For each model's decoder-layer shapes (fused q/k/v, o_proj, fused gate/up, down_proj; random
weights, int4 group 32, bf16 activations, one row), ``_weight_int4pack_mm_for_cpu`` is timed
(median of ``--reps`` timings of many calls) and its effective bandwidth computed from the bytes
it must read (packed codes + bf16 scale/zero pairs). Beside it, each rep: ``torch.sum`` over
256 MB (``bench/peer/limits.py: read_gb_s``), and a dense bf16 ``F.linear`` of the same shape
(reads 4x the bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, machine, pyplot, save_png, write_json
from bench.peer.limits import read_gb_s
from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.packing import pack_q4
from kvreuse.models.quant.int4_linear import _int4_codes

GROUP = 32  # input channels per int4 scale
# (out, in) of one decoder layer's projections, as kvreuse runs them (q/k/v and gate/up fused)
SHAPES = {
    "SmolLM2-135M": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "llama-1b (bench/peer/build_1b.py)": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}


def _seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    have_native = native_kernels() is not None
    gen = torch.Generator().manual_seed(0)
    result: dict = {"machine": machine(), "threads": args.threads, "reps": args.reps, "models": {}}
    reads: list[float] = []
    with torch.inference_mode():
        models = {}
        for name, shapes in SHAPES.items():
            layers, natives, dense = [], [], []
            for n, k in shapes:
                w = torch.randn(n, k, generator=gen)
                q, scale, zero = _int4_codes(w, GROUP)  # w ~= (q - 8) * scale + zero
                sz = torch.stack([scale.T, zero.T], dim=-1).contiguous().bfloat16()  # [in/group, out, 2]
                layers.append((torch._convert_weight_to_int4pack_for_cpu(q, 1), sz))
                natives.append(pack_q4(q, scale, zero - 8 * scale))  # w ~= q * scale + min
                dense.append(w.bfloat16())
            xs = [torch.randn(1, k, generator=gen).bfloat16() for _, k in shapes]
            int4_bytes = sum(n * k // 2 + (k // GROUP) * n * 2 * 2 for n, k in shapes)  # both layouts: 5 bits/weight
            bf16_bytes = sum(n * k * 2 for n, k in shapes)
            models[name] = (layers, natives, dense, xs, int4_bytes, bf16_bytes)
        arms = ("int4_s", "native_s", "bf16_s") if have_native else ("int4_s", "bf16_s")
        samples: dict[str, dict[str, list[float]]] = {n: {a: [] for a in arms} for n in SHAPES}
        for _ in range(args.reps):
            reads.append(read_gb_s(args.threads))
            for name, (layers, natives, dense, xs, _, _) in models.items():

                def kernel(layers=layers, xs=xs):
                    for (qw, sz), x in zip(layers, xs):
                        torch._weight_int4pack_mm_for_cpu(x, qw, GROUP, sz)

                def native(natives=natives, xs=xs):
                    for packed, x in zip(natives, xs):
                        torch.ops.kvreuse.q4_linear(x, *packed)

                def linear(dense=dense, xs=xs):
                    for w, x in zip(dense, xs):
                        F.linear(x, w)

                kernel(), linear()
                samples[name]["int4_s"].append(_seconds(kernel, 20))
                if have_native:
                    native()
                    samples[name]["native_s"].append(_seconds(native, 20))
                samples[name]["bf16_s"].append(_seconds(linear, 20))
    read = statistics.median(reads)
    for name, (_, _, _, _, int4_bytes, bf16_bytes) in models.items():
        t4, t16 = statistics.median(samples[name]["int4_s"]), statistics.median(samples[name]["bf16_s"])
        tn = statistics.median(samples[name]["native_s"]) if have_native else float("nan")
        result["models"][name] = {
            "native_us_per_layer": tn * 1e6,
            "native_gb_s": int4_bytes / tn / 1e9,
            "native_share_of_read": int4_bytes / tn / 1e9 / read,
            "int4_bytes_per_layer": int4_bytes,
            "int4_us_per_layer": t4 * 1e6,
            "int4_gb_s": int4_bytes / t4 / 1e9,
            "bf16_us_per_layer": t16 * 1e6,
            "bf16_gb_s": bf16_bytes / t16 / 1e9,
            "int4_share_of_read": int4_bytes / t4 / 1e9 / read,
            "samples": samples[name],
        }
        r = result["models"][name]
        print(
            f"{name}: int4 {r['int4_us_per_layer']:.0f} us/layer = {r['int4_gb_s']:.1f} GB/s "
            f"({100 * r['int4_share_of_read']:.0f}% of read {read:.1f} GB/s); "
            f"native {r['native_us_per_layer']:.0f} us = {r['native_gb_s']:.1f} GB/s "
            f"({100 * r['native_share_of_read']:.0f}%); "
            f"bf16 dense {r['bf16_us_per_layer']:.0f} us = {r['bf16_gb_s']:.1f} GB/s"
        )
    result["read_gb_s"] = read
    result["read_gb_s_samples"] = reads
    out = RESULTS / f"int4_decode_bandwidth{args.tag}.json"
    write_json(out, result)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(result["models"])
    for i, key in enumerate(("int4_gb_s", "native_gb_s", "bf16_gb_s")):
        ax.bar([x + 0.27 * i for x in range(len(names))], [result["models"][n][key] for n in names], 0.27, label=key)
    ax.axhline(read, color="k", ls="--", label=f"torch.sum read {read:.1f} GB/s")
    ax.set_xticks([x + 0.27 for x in range(len(names))], names)
    ax.set_ylabel("GB/s (bytes the call must read / time)")
    ax.set_title(f"one-row decode projections, {args.threads} thread(s)")
    ax.legend()
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
