"""The machine's limits a serving figure is judged against, measured in the bench's own run.

- ``read_gb_s``: read bandwidth, a ``torch.sum`` over 256 MB (bytes read / s);
- ``copy_gb_s``: copy bandwidth, a 256 MB ``copy_`` (bytes read + bytes written, / s);
- ``gemm_gflops``: a square matmul's GFLOP/s in one dtype (the GEMM peak the CPU reaches);
- ``GgufFacts``: a GGUF file's tensor bytes (what a decode step reads) and K/V bytes per token,
  for the decode floor = (weight bytes + K/V bytes per context token x context) / read bandwidth;
- ``cpu_tag``: a short name of the CPU for result file names (``epyc_avx512bf16``, ``xeon_amx``).

Imports torch lazily (``gguf`` too), so a script that only plots needs neither.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import machine, timed

BUFFER_BYTES = 256 << 20  # 256 MiB: far beyond any cache of the CPUs CI lands on


def cpu_tag(info: dict | None = None) -> str:
    """``<vendor>_<best ISA>`` of this CPU from lscpu (``machine()``): vendor ``epyc`` /
    ``xeon`` / the model name's first word; ISA ``amx`` (amx_bf16), ``avx512bf16``,
    ``avx512``, ``avx2`` or ``base``."""
    info = info or machine()
    model = (info.get("cpu_model") or "cpu").lower()
    flags = set(info.get("cpu_flags") or ())
    vendor = "epyc" if "epyc" in model else "xeon" if "xeon" in model else re.sub(r"\W+", "", model.split()[0]) or "cpu"
    if "amx_bf16" in flags:
        isa = "amx"
    elif "avx512_bf16" in flags:
        isa = "avx512bf16"
    elif "avx512f" in flags:
        isa = "avx512"
    elif "avx2" in flags:
        isa = "avx2"
    else:
        isa = "base"
    return f"{vendor}_{isa}"


def read_gb_s(threads: int) -> float:
    """GB/s read by a ``torch.sum`` over a 256 MiB fp32 tensor on ``threads`` threads (best of 5)."""
    import torch

    with _threads(threads):
        x = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
        x.sum()
        best = min(timed(lambda: x.sum()) for _ in range(5))
    return BUFFER_BYTES / best / 1e9


def copy_gb_s(threads: int) -> float:
    """GB/s moved by a 256 MiB ``copy_`` (bytes read + bytes written) on ``threads`` threads (best of 5)."""
    import torch

    with _threads(threads):
        src = torch.ones(BUFFER_BYTES, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * BUFFER_BYTES / best / 1e9


def gemm_gflops(dtype, k: int = 2048, *, m: int = 2048, n: int = 2048, threads: int | None = None) -> float:
    """GFLOP/s of a ``[m, k] @ [k, n]`` matmul in ``dtype`` (best of 3 after a warm-up), on
    ``threads`` threads (``None``: torch's current setting)."""
    import torch

    with _threads(threads):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)
        best = min(timed(lambda: torch.mm(a, b)) for _ in range(3))
    return 2 * m * k * n / best / 1e9


def measure(threads: int) -> dict[str, float]:
    """One sample of every limit: ``read_gb_s``, ``copy_gb_s``, ``gemm_gflops_fp32``, ``gemm_gflops_bf16``."""
    import torch

    return {
        "read_gb_s": read_gb_s(threads),
        "copy_gb_s": copy_gb_s(threads),
        "gemm_gflops_fp32": gemm_gflops(torch.float32, threads=threads),
        "gemm_gflops_bf16": gemm_gflops(torch.bfloat16, threads=threads),
    }


class _threads:
    """torch's intra-op thread count set for a block and restored afterwards (``None``: unchanged)."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        import torch

        self.saved = torch.get_num_threads()
        if self.n is not None:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self.saved)


@dataclass(frozen=True)
class GgufFacts:
    """What a decode step of a GGUF model must read: ``weight_bytes``, the bytes of every
    tensor a step multiplies by (all of them, except a token embedding only gathered from
    because the file has its own ``output.weight``); ``kv_bytes_per_token``, one context
    token's K and V over all layers in f16/bf16 (2 bytes: llama.cpp's default KV type and
    kvreuse's bf16)."""

    file: str
    file_bytes: int
    tensor_bytes: int  # every tensor in the file
    weight_bytes: int  # what one decode step reads
    n_layers: int
    n_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, path: Path) -> GgufFacts:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
        gathered = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
        n_layers = int(_field(reader, f"{arch}.block_count"))
        n_heads = int(_field(reader, f"{arch}.attention.head_count"))
        kv = _field(reader, f"{arch}.attention.head_count_kv")
        n_kv = int(kv) if kv is not None else n_heads
        key_len = _field(reader, f"{arch}.attention.key_length")
        head_dim = int(key_len) if key_len is not None else int(_field(reader, f"{arch}.embedding_length")) // n_heads
        return cls(
            file=path.name,
            file_bytes=path.stat().st_size,
            tensor_bytes=sum(sizes.values()),
            weight_bytes=sum(sizes.values()) - gathered,
            n_layers=n_layers,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            kv_bytes_per_token=2 * n_layers * n_kv * head_dim * 2,
        )

    def decode_floor_tok_s(self, read_gb_s: float, context: int) -> float:
        """Tokens/s if a step did nothing but read the weights and ``context`` tokens' K/V once."""
        return read_gb_s * 1e9 / (self.weight_bytes + context * self.kv_bytes_per_token)

    def as_dict(self) -> dict:
        return asdict(self)


def _field(reader, key: str):
    """A GGUF metadata value (``GGUFField.contents()``), ``None`` when the file lacks ``key``."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each limit's median over samples from ``measure``."""
    return {k: round(statistics.median(s[k] for s in samples), 2) for k in samples[0]} if samples else {}
