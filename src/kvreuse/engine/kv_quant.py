"""KV pool formats (``--kv-cache-dtype``) and the views attention reads and writes the pool through.

One tensor holds the whole pool, ``[layers, 2, kv_heads, slots, row]``, allocated once::

    format               pool dtype   row (one token, one KV head)
    auto                 the model's  head_dim values (bf16 / fp16 / fp32: the model's dtype)
    bfloat16 / float16 / float32      head_dim values in that dtype (cast to the model's on read)
    int8                 uint8        head_dim int8 values, then one bf16 scale (2 bytes)
    fp8_e4m3 (fp8)       uint8        head_dim float8_e4m3fn values (their bits), then one bf16 scale
    fp8_e5m2             uint8        head_dim float8_e5m2 values (their bits), then one bf16 scale

The byte formats are symmetric with one scale per token and KV head (llama.cpp's q8_0, one block
per head row): ``scale = max|x| / qmax`` rounded to bf16 (``qmax`` 127 for int8, 448 for e4m3,
57344 for e5m2, the code's largest finite value); int8 ``q = round(x / scale)`` clamped to ±127,
fp8 ``q = x / scale`` clamped to ±qmax then cast (round to nearest even): saturated, so finite
input never gives inf or NaN. ``fp8`` is vLLM's name for ``fp8_e4m3``. The row keeps values and
scale side by side, so a block is one contiguous byte range per (layer, K/V, head) and every
mover of blocks (host tier, disk, Redis: ``kv_transfer.py``, ``tiers/block_codec.py``) carries
the compressed bytes unchanged. A slot is quantized once,
when the forward writes it (``KVSide.write``); reads dequantize only the slots read (a run in
place or a gather), in the model's dtype. Keys moved to other RoPE positions (documents) are
dequantized, rotated and quantized into *new* slots (``KVStore.copy_shifted``): no shared slot is
ever rewritten. Only int8 rows are handed as stored to kvreuse's attention kernels (``stored_*``);
fp8 rows are dequantized before any kernel reads them.

The format is part of what a block is: ``KVFormat.identity`` is folded into the model
fingerprint (``engine_builder.kv_identity``) whenever the pool does not hold the model's own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KV_CACHE_DTYPES", "KVFormat", "KVSide", "KVStore", "layer_sides", "qmax", "quantize", "dequantize"]

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 2  # one bf16 scale per row
_FLOATS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# byte formats: the dtype of a row's values (stored as their bits in the uint8 pool)
_CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "fp8_e4m3",  # vLLM's default fp8
}
_MIN_SCALE = 1e-30  # an all-zero row: q = 0 whatever the scale (bf16 keeps fp32's range)


@dataclass(frozen=True)
class KVFormat:
    """What one pool slot row holds. ``name`` is never ``auto`` (``resolve`` names the model's dtype)."""

    name: str  # bfloat16 | float16 | float32 | int8 | fp8_e4m3 | fp8_e5m2
    compute_dtype: torch.dtype  # the model's dtype: what attention reads

    @classmethod
    def resolve(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
        """The format ``--kv-cache-dtype`` names for a model computing in ``model_dtype``.
        Raises ``ValueError`` naming the flag for an unknown name."""
        name = _ALIASES.get(kv_cache_dtype.lower(), kv_cache_dtype.lower())
        if name == "auto":
            name = next(n for n, d in _FLOATS.items() if d == model_dtype)
        if name not in _FLOATS and name not in _CODES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        return cls(name, model_dtype)

    @property
    def code(self) -> torch.dtype | None:
        """A byte format's value dtype (int8, a float8), ``None`` for a float pool."""
        return _CODES.get(self.name)

    @property
    def quantized(self) -> bool:
        """Rows of 1-byte values and a bf16 scale in a uint8 pool (int8, fp8)."""
        return self.name in _CODES

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pool tensor's dtype."""
        return torch.uint8 if self.quantized else _FLOATS[self.name]

    def row_width(self, head_dim: int) -> int:
        """Elements of ``storage_dtype`` per (token, KV head)."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of every layer for one token, scales included."""
        item = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * num_layers * num_kv_heads * self.row_width(head_dim) * item

    @property
    def identity(self) -> str | None:
        """What the model fingerprint folds in: ``None`` when the pool holds exactly what the
        model computes (``auto``: fingerprints unchanged), else ``kv_cache_dtype=<name>``."""
        return None if _FLOATS.get(self.name) == self.compute_dtype else f"kv_cache_dtype={self.name}"

    @property
    def description(self) -> str:
        """For the start-up line and ``/v1/kvreuse/info``."""
        return f"{self.name} (one bf16 scale per token and KV head)" if self.quantized else self.name


def qmax(code: torch.dtype) -> float:
    """The largest value a row's code holds: 127 (int8), 448 (float8_e4m3fn), 57344 (float8_e5m2)."""
    return 127.0 if code == torch.int8 else float(torch.finfo(code).max)


def quantize(x: torch.Tensor, code: torch.dtype = torch.int8) -> torch.Tensor:
    """``x [..., d]`` (any float dtype) as rows of ``code`` (int8, a float8): ``[..., d + 2]``
    uint8, the ``d`` values' bytes then the row's bf16 scale ``max|x| / qmax``. int8 rounds
    ``x / scale`` to the nearest integer, fp8 casts it (nearest even); both clamp to ±qmax first,
    so a scale rounded below ``max|x| / qmax`` saturates instead of overflowing to inf / NaN."""
    top = qmax(code)
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / top).clamp_min_(_MIN_SCALE).to(torch.bfloat16)  # [..., 1]
    y = xf / scale.float()  # [..., d]
    q = (torch.round(y) if code == torch.int8 else y).clamp_(-top, top).to(code)  # [..., d]
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)  # [..., d + 2]


def dequantize(rows: torch.Tensor, dtype: torch.dtype, code: torch.dtype = torch.int8) -> torch.Tensor:
    """``rows [..., d + 2]`` uint8 of ``code`` values (``quantize``'s output or a view of the
    pool) -> ``[..., d]`` in ``dtype``: ``q * scale`` (one rounding, in ``dtype``)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].view(torch.bfloat16)  # [..., 1]
    return _exact(rows[..., :d], dtype, code) * scale.to(dtype)


def _exact(values: torch.Tensor, dtype: torch.dtype, code: torch.dtype) -> torch.Tensor:
    """``values [..., d]`` (uint8, a view) read as ``code`` in ``dtype``: exact, every int8 and
    finite float8 value being one in bf16, fp16 and fp32. e4m3 goes by its bits, twice as fast as
    torch's cast on CPU (one value at a time there): with the sign moved to bit 15 and exponent
    and mantissa 7 bits up, the bits are a float16 2^8 below the value (bias 15 against 7; e4m3's
    subnormals land on float16's). Its NaN codes, which ``quantize`` never writes, read as ±480."""
    if code != torch.float8_e4m3fn:
        return values.view(code).to(dtype)
    w = values.to(torch.int16)
    half = ((w & 0x80) << 8) | ((w & 0x7F) << 7)  # float16 bits (the shift wraps to the sign bit)
    return half.view(torch.float16).to(dtype) * 256


class KVSide:
    """The K (or V) of one layer: ``store [kv_heads, slots, row]`` (a view of the pool) read
    and written in ``dtype`` rows ``[kv_heads, n, head_dim]``. Float pools in the model's dtype
    read in place (``run`` is a view, ``select`` a gather), exactly as before formats existed.
    ``code``: a byte pool's value dtype (int8, a float8), ``None`` for a float pool."""

    def __init__(self, store: torch.Tensor, dtype: torch.dtype, code: torch.dtype | None = None) -> None:
        self.store = store
        self.dtype = dtype
        self.code = code
        self.quantized = code is not None
        self.kernel_rows = code == torch.int8  # kvreuse's attention kernels read these rows as stored
        self.kv_heads = store.shape[0]

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Store ``x [kv_heads, T, d]`` (``dtype``) into ``slots [T]``; returns the values as a
        later read gives them back (``x`` itself for a pool in the model's dtype)."""
        if self.code is not None:
            rows = quantize(x, self.code)  # [kv_heads, T, d + 2]
            self.store.index_copy_(1, slots, rows)
            return dequantize(rows, self.dtype, self.code)
        stored = x.to(self.store.dtype)
        self.store.index_copy_(1, slots, stored)
        return stored.to(self.dtype)

    def run(self, start: int, length: int) -> torch.Tensor:
        """Slots ``start..start+length-1``: ``[kv_heads, length, d]`` (a view when no cast)."""
        rows = self.store[:, start : start + length]
        return rows.to(self.dtype) if self.code is None else dequantize(rows, self.dtype, self.code)

    def stored_run(self, start: int, length: int) -> torch.Tensor:
        """Slots ``start..start+length-1`` as stored: a view ``[kv_heads, length, row]`` (int8
        rows undequantized, for a kernel that reads them: ``flash.attend_alone``), else ``run``
        (fp8 rows dequantized: no kernel reads them)."""
        return self.store[:, start : start + length] if self.kernel_rows else self.run(start, length)

    def stored_select(self, slots: torch.Tensor) -> torch.Tensor:
        """``select`` as stored: int8 rows gathered undequantized (half the bytes), else ``select``."""
        return self.store.index_select(1, slots) if self.kernel_rows else self.select(slots)

    def stored_at(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slots ``slots [L]`` for a reader that takes a whole pool side and the rows to read
        (``invariant_attention.attend``): every slot as stored ``[kv_heads, slots, row]`` (a view;
        int8 rows undequantized, a float pool in its own dtype, never converted whole) and
        ``slots``; for fp8 rows, which no kernel reads, ``select(slots)`` and ``None``."""
        if self.code is None or self.kernel_rows:
            return self.store, slots
        return self.select(slots), None

    def select(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots ``slots [L]`` (any order): ``[kv_heads, L, d]``, a copy."""
        rows = self.store.index_select(1, slots)
        return rows.to(self.dtype) if self.code is None else dequantize(rows, self.dtype, self.code)


def layer_sides(kv: torch.Tensor | KVStore, layer: int) -> tuple[KVSide, KVSide]:
    """Layer ``layer``'s K and V sides of a ``KVStore``, or of a bare float tensor
    ``[layers, 2, kv_heads, slots, d]`` read in its own dtype (scratch passes, tests)."""
    if isinstance(kv, KVStore):
        return kv.sides[layer]
    return KVSide(kv[layer, 0], kv.dtype), KVSide(kv[layer, 1], kv.dtype)


class KVStore:
    """The runner's pool in one ``KVFormat``: ``tensor [layers, 2, kv_heads, slots, row]`` and its
    per-layer sides (built once). Engine thread only."""

    def __init__(self, tensor: torch.Tensor, fmt: KVFormat) -> None:
        self.tensor = tensor
        self.format = fmt
        c = fmt.code
        self.sides = [(KVSide(t[0], fmt.compute_dtype, c), KVSide(t[1], fmt.compute_dtype, c)) for t in tensor]

    @classmethod
    def allocate(
        cls, fmt: KVFormat, num_layers: int, num_kv_heads: int, num_slots: int, head_dim: int, device: torch.device
    ) -> KVStore:
        tensor = torch.zeros(  # [layers, 2, kv_heads, slots, row]
            num_layers, 2, num_kv_heads, num_slots, fmt.row_width(head_dim), dtype=fmt.storage_dtype, device=device
        )
        return cls(tensor, fmt)

    @property
    def head_dim(self) -> int:
        width = self.tensor.shape[-1]
        return width - SCALE_BYTES if self.format.quantized else width

    def gather(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """K and V of ``index [n]`` in one layer, in the model's dtype: ``[2, kv_heads, n, d]``."""
        k, v = self.sides[layer]
        return torch.stack([k.select(index), v.select(index)])

    def read_rows(self, slots: Sequence[int]) -> torch.Tensor:
        """A CPU copy of the stored rows of ``slots`` (the pool's own bytes, no conversion):
        ``[layers, 2, n, kv_heads, row]``."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.tensor.device)  # [n]
        return self.tensor[:, :, :, index].transpose(2, 3).contiguous().cpu()

    def write_rows(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        """``rows [layers, 2, n, kv_heads, row]`` (as ``read_rows`` gives; a float format takes
        any float dtype) into ``slots``. int8 / fp8 rows are stored as they are: never re-quantized."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.tensor.device)  # [n]
        if self.format.quantized and rows.dtype != torch.uint8:
            name = self.format.name
            raise ValueError(f"{name} KV pool: stored KV must be {name} rows (uint8), got {rows.dtype}")
        self.tensor[:, :, :, index] = rows.transpose(2, 3).to(self.tensor.device, self.tensor.dtype)

    def copy_shifted(self, src: torch.Tensor, dst: torch.Tensor, rotate) -> None:
        """Copy the K/V of ``src [n]`` into ``dst [n]`` (disjoint), every key through ``rotate``
        (``[layers, kv_heads, n, d]`` -> same, model dtype). int8 / fp8: keys dequantized, rotated
        and quantized into ``dst``; values' rows copied as they are."""
        t, dtype, code = self.tensor, self.format.compute_dtype, self.format.code
        k = t[:, 0].index_select(2, src)  # [layers, kv_heads, n, row]
        v = t[:, 1].index_select(2, src)
        moved = rotate(k.to(dtype)).to(t.dtype) if code is None else quantize(rotate(dequantize(k, dtype, code)), code)
        t[:, 0].index_copy_(2, dst, moved)
        t[:, 1].index_copy_(2, dst, v)
