"""What keeping a GGUF's own layouts buys a decode step: the 1B bench model's weights read
by kvreuse's kernels in the layout each format used to get and the one it gets now, side by
side in one run (one row, as a batch-1 decode step calls them).

    PYTHONPATH=src .venv/bin/python bench/quant/gguf_layouts.py [--threads 2] [--reps 9] [--tag _2thread]
    -> bench/results/gguf_layouts<tag>.{json,png}

Arms, interleaved (``bench.common.interleave``), each timed as the median of many calls:

- ``q4_two_plane``: the decoder layers of ``bench/peer/build_1b.py``'s model (fused q/k/v, o_proj,
  fused gate/up, down_proj; x16 layers counted as 16 calls of each) as a Q4_0 file's weights,
  packed with a min plane (codes + fp16 scale + fp16 min: 5 bits a weight), as before;
- ``q4_0``: the same codes without the min plane (4.5 bits: the file's Q4_0 block size);
- ``lm_head_int8``: the 49,152 x 2,048 output projection, int8 per channel (as before);
- ``lm_head_q6_k``: the same projection from Q6_K blocks (6.56 bits, the file's type).

Weights random; the same x for every arm. Beside them each round: ``torch.sum`` over 256 MB
(``bench/peer/limits.py``). GB/s = the bytes the call must read / its time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, interleave, pyplot, save_png, write_json
from bench.peer.limits import read_gb_s
from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.packing import pack_q4
from kvreuse.models.quant import Int8Linear, Q6KLinear
from kvreuse.models.quant.q6k_linear import BLOCK_BYTES, dequantize_q6k

LAYERS = 16  # the 1B model's decoder layers
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # one layer's projections (out, in)
VOCAB, HIDDEN = 49152, 2048


def _anon_huge_kb() -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5, help="calls a timing averages")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if native_kernels() is None:
        raise SystemExit("kvreuse's native kernels are not built on this machine")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = []  # (codes, d, x) per projection: a Q4_0 tensor's codes and scales
    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen)
        d = (torch.rand(n, k // 32, generator=gen) * 1e-2).half().float()
        layers.append((codes, d, torch.randn(1, k, generator=gen).bfloat16()))
    two_plane = [(pack_q4(c, d, -8 * d), x) for c, d, x in layers]
    q4_0 = [(pack_q4(c, d, None), x) for c, d, x in layers]
    blocks = torch.randint(0, 256, (VOCAB, HIDDEN // 256, BLOCK_BYTES), generator=gen, dtype=torch.uint8)
    blocks[..., 208:] = (torch.rand(VOCAB, HIDDEN // 256, 1, generator=gen) * 1e-3).half().view(torch.uint8)
    blocks = blocks.view(VOCAB, -1)
    q6 = Q6KLinear(blocks, None, torch.bfloat16)
    int8 = Int8Linear(dequantize_q6k(blocks), None, torch.bfloat16).to(torch.bfloat16)
    xh = torch.randn(1, HIDDEN, generator=gen).bfloat16()

    def step(packed):
        def run():
            for _ in range(LAYERS):
                for p, x in packed:
                    torch.ops.kvreuse.q4_linear(x, *p)

        return run

    weights = sum(n * k for n, k in SHAPES) * LAYERS
    arms_fn = {
        "q4_two_plane": (step(two_plane), weights * 5 // 8),
        "q4_0": (step(q4_0), weights * 9 // 16),
        "lm_head_int8": (lambda: int8.native_linear(xh), VOCAB * HIDDEN + VOCAB * 4),
        "lm_head_q6_k": (lambda: q6.native_linear(xh), VOCAB * HIDDEN * 210 // 256),
    }
    reads: list[float] = []
    with torch.inference_mode():
        for fn, _ in arms_fn.values():
            fn()  # warm: first-touch of the weights

        def arm(fn):
            return lambda: _seconds(fn, args.calls)

        def read():
            reads.append(read_gb_s(args.threads))
            return 0.0

        samples = interleave({"read": read, **{name: arm(fn) for name, (fn, _) in arms_fn.items()}}, args.reps)
    samples.pop("read")
    read_bw = statistics.median(reads)
    result: dict = {"threads": args.threads, "reps": args.reps, "read_gb_s": read_bw, "read_gb_s_samples": reads}
    result["thp_mem_alloc_enable"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
    result["anon_huge_pages_kb"] = _anon_huge_kb()  # the weights on 2 MB pages (transparent huge pages) or not
    arms = {}
    for name, (_, nbytes) in arms_fn.items():
        t = statistics.median(samples[name])
        arms[name] = {"ms": t * 1e3, "bytes": nbytes, "gb_s": nbytes / t / 1e9, "samples_s": samples[name]}
        print(f"{name}: {t * 1e3:.2f} ms, {nbytes / 1e6:.1f} MB, {nbytes / t / 1e9:.1f} GB/s")
    result["arms"] = arms
    result["ratios"] = {
        "layers_q4_0_over_two_plane_time": arms["q4_0"]["ms"] / arms["q4_two_plane"]["ms"],
        "lm_head_q6_k_over_int8_time": arms["lm_head_q6_k"]["ms"] / arms["lm_head_int8"]["ms"],
        "step_new_over_old_time": (arms["q4_0"]["ms"] + arms["lm_head_q6_k"]["ms"])
        / (arms["q4_two_plane"]["ms"] + arms["lm_head_int8"]["ms"]),
    }
    print(f"read {read_bw:.1f} GB/s; ratios {result['ratios']}; AnonHugePages {result['anon_huge_pages_kb']} kB")
    result["command"] = " ".join(["bench/quant/gguf_layouts.py", *sys.argv[1:]])
    out = RESULTS / f"gguf_layouts{args.tag}.json"
    write_json(out, result)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, pair, title in (
        (axes[0], ("q4_two_plane", "q4_0"), f"1B decoder layers x{LAYERS}, one row"),
        (axes[1], ("lm_head_int8", "lm_head_q6_k"), "1B output projection, one row"),
    ):
        ax.bar(pair, [arms[a]["ms"] for a in pair], color=["tab:gray", "tab:blue"])
        for i, a in enumerate(pair):
            ax.annotate(
                f"{arms[a]['bytes'] / 1e6:.0f} MB\n{arms[a]['gb_s']:.1f} GB/s",
                (i, arms[a]["ms"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylabel("ms (median)")
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"{args.threads} thread(s); torch.sum read {read_bw:.1f} GB/s", fontsize=9)
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
