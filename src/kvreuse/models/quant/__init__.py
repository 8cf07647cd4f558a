"""Weight-only quantization: int8 / int4 linear layers on PyTorch's own CPU kernels.

Why: a decode step reads every weight once. SmolLM2-135M in fp32 is 540 MB per token; its
GGUF (Q4_1 layers, Q8_0 embedding) is 98 MB. Keeping the weights compact is what lets batch-1
decode approach the memory system's limit.

Schemes (``SCHEMES`` names them; the name is folded into the model fingerprint):

- ``int8`` (:mod:`.int8_linear`): symmetric, one scale per output channel,
  ``torch._weight_int8pack_mm`` (``y = (x @ q.T) * scale``). The kernel wants bf16 activations:
  with fp32 ones it is 5-15x slower than a plain fp32 matmul (torch 2.13, SmolLM2's 576 x 1,536
  layer at batch 1: 438 us against 81 us), so pair it with ``dtype=bf16``.
- ``int4`` (:mod:`.int4_linear`, pack layout in :mod:`.int4_pack`): asymmetric, one (scale, min)
  per group of 32 input channels, tinygemm layout ``w = (q - 8) * scale + zero`` with
  ``zero = min + 8 * scale``, ``torch._weight_int4pack_mm_for_cpu``. A GGUF Q4_1 block is exactly
  this (32 weights, ``w = q * d + m``), so requantizing a Q4_1-dequantized weight recovers the
  file's own codes; a GGUF Q4_0 tensor keeps its own symmetric codes without the min plane.
- ``Q6KLinear`` (:mod:`.q6k_linear`): a GGUF Q6_K output projection kept as the file's blocks
  (``models/gguf_blocks.py``) on kvreuse's 6-bit kernel, where they are exactly its weight.
- A tied or plain ``nn.Embedding`` becomes int8 with one scale per group of 32
  (:mod:`.int8_embedding`: a GGUF Q8_0 block, recovered exactly from its dequantized values); the
  lookup gathers rows and scales.

Kernels are CPU only (``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``; the packed
int4 layout is CPU specific). On any other device, or for a shape the kernel refuses (int4 needs
``out_features % 16 == 0``), a layer keeps its codes unpacked and dequantizes on the fly
(``F.linear`` over the dequantized weight): correct everywhere, compact in memory, not fast.
When a many-row call multiplies a dequantized copy instead is :mod:`.dense_rule`; fusing
q/k/v and gate/up is :mod:`.fusion`; swapping a model's layers is :mod:`.surgery`.
"""

from __future__ import annotations

from kvreuse.models.quant.dense_rule import (
    DENSE_MIN_ROWS,
    FP32_DENSE_MIN_ROWS,
    SLOW_BF16_DENSE_MIN_ROWS,
    dense_dtype,
    fast_bf16_cpu,
)
from kvreuse.models.quant.fusion import fuse_linears, fused_projection
from kvreuse.models.quant.int4_linear import Int4Linear
from kvreuse.models.quant.int8_embedding import Int8Embedding
from kvreuse.models.quant.int8_linear import Int8Linear
from kvreuse.models.quant.mode import SCHEMES, QuantMode, parse_quantization
from kvreuse.models.quant.q6k_linear import Q6KLinear
from kvreuse.models.quant.surgery import kept_from_file, kernels_in_use, quantize_model, weight_bytes

__all__ = [
    "QuantMode",
    "SCHEMES",
    "parse_quantization",
    "fast_bf16_cpu",
    "Int8Linear",
    "Int4Linear",
    "Int8Embedding",
    "Q6KLinear",
    "dense_dtype",
    "fuse_linears",
    "fused_projection",
    "quantize_model",
    "weight_bytes",
    "kernels_in_use",
    "kept_from_file",
    "DENSE_MIN_ROWS",
    "SLOW_BF16_DENSE_MIN_ROWS",
    "FP32_DENSE_MIN_ROWS",
]
