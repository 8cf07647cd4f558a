"""kvreuse's own CPU kernels for few-row quantized layers (:mod:`.native` builds and loads
them; :mod:`.packing` lays weights out for them)."""

from __future__ import annotations

from kvreuse.models.kernels.native import NativeKernels, native_kernels

__all__ = ["NativeKernels", "native_kernels"]
