"""Per-step bookkeeping at long context: ``engine.step()`` with the model forward stubbed out.

    PYTHONPATH=src .venv/bin/python bench/decode/step_bookkeeping.py [--contexts 1024 8000] [--steps 200]

One engine (default model, fp32, CPU), batch 1, greedy. A prompt of each length is
prefilled for real; then the runner's forward is replaced by a stub returning zero logits
and every further ``engine.step()`` is timed: scheduling, the chunk the engine builds for
the runner (slots, positions), the runner's inputs (slot mapping, runs, masks), sampling
and stop checks. Two paths: ``in-place`` (the default: a decode over 1,024+ context tokens
reads the pool in place) and ``gather`` (every decode in the padded batch). Prints the
median microseconds per step; writes nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import median, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8000])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory_gib=1.0, max_model_len=max(args.contexts) + args.steps + 64)
    engine, runner = llm.engine, llm.engine.runner
    vocab = llm.tokenizer.vocab_size
    rng = random.Random(0)
    in_place_min = runner.decode_in_place_min
    for n in args.contexts:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))  # cache the prompt
        for path in ("in-place", "gather"):
            runner.decode_in_place_min = in_place_min if path == "in-place" else 1 << 30
            params = SamplingParams(max_tokens=args.steps + 2, temperature=0, ignore_eos=True)
            engine.add_request(f"{n}-{path}", prompt, params)
            engine.step()  # the prompt's last block, through the real model
            own = runner._llama
            logits = torch.zeros(1, runner.model.config.vocab_size)  # [1, vocab]
            runner._llama = lambda input_ids, position_ids, logits_index, ctx: logits[: len(logits_index)]
            try:
                times = [timed(engine.step) for _ in range(args.steps)]
            finally:
                runner._llama = own
            engine.abort_request(f"{n}-{path}")
            print(
                f"context {n:>5} {path:>8}: {median(times) * 1e6:8.1f} us per step (median of {args.steps})", flush=True
            )
    runner.decode_in_place_min = in_place_min


if __name__ == "__main__":
    main()
