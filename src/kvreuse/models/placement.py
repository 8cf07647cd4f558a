"""Placement: the dtype and device a model runs in, from ``--dtype`` / ``--device`` text.

Re-exported by :mod:`kvreuse.models.loader`, where callers have always imported them.
"""

from __future__ import annotations

import torch

from kvreuse.models.quant import fast_bf16_cpu

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_dtype(
    dtype: str | torch.dtype, device: str | torch.device | None = None, *, quantized: bool = False
) -> torch.dtype:
    """Map ``float32|fp32|bfloat16|bf16|float16|fp16|auto`` (or a torch dtype) to a torch dtype.

    ``auto`` is bfloat16 on a CPU that multiplies bf16 natively (AMX or AVX512-BF16, see
    :func:`kvreuse.models.quant.fast_bf16_cpu`), and on any CPU when the weights are
    ``quantized`` (PyTorch's int4 / int8 CPU kernels are only fast with bf16 activations: on an
    AVX2-only EPYC a 576 -> 3,072 int4 matmul of one row took 5.2 ms of CPU with fp32 inputs and
    0.35 ms with bf16, a whole int4 decode step 585 vs 70 ms); float32 elsewhere (other CPUs
    unquantized, CUDA). ``device`` None means cpu. float32 stays the exact reference: ask for it
    by name. Raises ValueError for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPE_NAMES:
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        on_cpu = device is None or torch.device(str(device)).type == "cpu"
        return torch.bfloat16 if on_cpu and (quantized or fast_bf16_cpu()) else torch.float32
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype '{dtype}'; use float32, bfloat16 or float16 (or fp32, bf16, fp16, auto)")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    """Map ``cpu|cuda|cuda:N|auto`` to a torch device; ``auto`` is cuda when available.

    Raises ValueError for cuda when CUDA is not available, or for an unknown device string.
    """
    key = str(device).strip().lower()
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(key)
    except RuntimeError as exc:
        raise ValueError(f"unknown device '{device}'; use cpu, cuda or auto") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' requested but CUDA is not available; use cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}'; use cpu, cuda or auto")
    return dev
