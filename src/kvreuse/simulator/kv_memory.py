"""Pool sizes in bytes for ``kvreuse simulate``: how many blocks a memory budget holds in each KV
format, so a trace answers "what does int8 KV buy me at N GiB".

    --capacity-gib G [--host-gib H] --kv-cache-dtype int8 [--kv-layout LAYERS,KV_HEADS,HEAD_DIM]

A block of ``block_tokens`` tokens takes ``block_tokens * bytes_per_token``, with
``bytes_per_token = 2 * layers * kv_heads * (head_dim * value_bytes + scale_bytes)``: the
engine's own sizing (``engine/kv_quant.py``; int8 and fp8 rows carry one bf16 scale per token
and KV head). The layout defaults to the default model's (SmolLM2-135M: 30 layers, 3 KV heads, 64).
Pure arithmetic: no torch.
"""

from __future__ import annotations

import argparse

# bytes per stored value, bytes of scale per (token, KV head)
KV_FORMAT_BYTES = {
    "bfloat16": (2, 0),
    "float16": (2, 0),
    "float32": (4, 0),
    "int8": (1, 2),
    "fp8": (1, 2),  # vLLM's name for fp8_e4m3
    "fp8_e4m3": (1, 2),
    "fp8_e5m2": (1, 2),
}
DEFAULT_LAYOUT = (30, 3, 64)  # the default model (SmolLM2-135M): layers, KV heads, head_dim


def kv_bytes_per_token(kv_cache_dtype: str, layout: tuple[int, int, int] = DEFAULT_LAYOUT) -> int:
    """K and V of every layer for one token in ``kv_cache_dtype`` (scales included)."""
    layers, kv_heads, head_dim = layout
    value, scale = KV_FORMAT_BYTES[kv_cache_dtype]
    return 2 * layers * kv_heads * (head_dim * value + scale)


def blocks_in(gib: float, kv_cache_dtype: str, block_tokens: int, layout: tuple[int, int, int] = DEFAULT_LAYOUT) -> int:
    """Whole blocks of ``block_tokens`` tokens that ``gib`` GiB hold, as the engine sizes its pool."""
    return int(gib * 2**30) // (kv_bytes_per_token(kv_cache_dtype, layout) * block_tokens)


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--capacity-gib",
        type=float,
        default=None,
        metavar="G",
        help="pool size in GiB instead of --capacity-blocks: blocks = G / bytes per block of --kv-cache-dtype",
    )
    p.add_argument("--host-gib", type=float, default=None, metavar="H", help="host tier in GiB (with --capacity-gib)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_FORMAT_BYTES),
        default="bfloat16",
        help="KV format the GiB are counted in (int8, fp8: one bf16 scale per token and KV head)",
    )
    p.add_argument(
        "--kv-layout",
        default=",".join(map(str, DEFAULT_LAYOUT)),
        metavar="LAYERS,KV_HEADS,HEAD_DIM",
        help="the model's KV shape (default: the default model's, 30,3,64)",
    )


def resolve_capacity(args: argparse.Namespace, block_tokens: int) -> tuple[int, int]:
    """``(capacity_blocks, host_blocks)`` from ``--capacity-blocks`` / ``--host-blocks`` or from
    ``--capacity-gib`` / ``--host-gib`` in ``--kv-cache-dtype``. Raises ``ValueError`` naming the
    flag for a missing, doubled or malformed size."""
    if (args.capacity_blocks is None) == (args.capacity_gib is None):
        raise ValueError("give one of --capacity-blocks N or --capacity-gib G")
    if args.host_gib is not None and args.capacity_gib is None:
        raise ValueError("--host-gib goes with --capacity-gib (else --host-blocks)")
    if args.capacity_blocks is not None:
        return args.capacity_blocks, args.host_blocks
    try:
        layout = tuple(int(x) for x in args.kv_layout.split(","))
    except ValueError:
        layout = ()
    if len(layout) != 3 or min(layout) < 1:
        raise ValueError(f"--kv-layout takes LAYERS,KV_HEADS,HEAD_DIM (positive integers), got {args.kv_layout!r}")
    shape = (layout[0], layout[1], layout[2])
    host = 0 if args.host_gib is None else blocks_in(args.host_gib, args.kv_cache_dtype, block_tokens, shape)
    return blocks_in(args.capacity_gib, args.kv_cache_dtype, block_tokens, shape), host
