"""Our own forward pass for the Llama family, over the transformers model's own weights.

Why: a transformers forward spends much of a short step in Python and in small ops
(module calls, an RMSNorm of five passes, mask plumbing). For a decode step or the
32-token suffix of a cached prompt, that is a large share of the time. This forward
runs the same computation with fewer calls: fused q/k/v and gate/up projections,
one fused kernel per RMSNorm (``rms_norm``), the model's own rotary module for cos/sin with RoPE applied to q and k in
one pass, and ``attend`` for attention over the pool. Projections are called as modules, so
weight-only quantized layers (:mod:`kvreuse.models.quant`) plug in unchanged. Its logits
match the transformers forward's to float rounding (tests/models/test_llama.py).

Only plain Llama checkpoints qualify (``supports``): ``model_type == "llama"``, SiLU MLP,
no attention or MLP biases, ``pretraining_tp == 1``. Anything else (Gemma 3, other
families) keeps the transformers forward, which works everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
import torch.nn.functional as F

from kvreuse.engine.attention import ForwardContext, attend
from kvreuse.engine.kv_quant import KVStore
from kvreuse.models import invariant
from kvreuse.models.kernels import native_kernels
from kvreuse.models.quant import Int4Linear, dense_rule, fused_projection

if TYPE_CHECKING:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM


def supports(model: torch.nn.Module) -> TypeGuard[LlamaForCausalLM]:
    """True when ``LlamaForward`` computes exactly what ``model``'s own forward does."""
    cfg = getattr(model, "config", None)
    return (
        cfg is not None
        and getattr(cfg, "model_type", None) == "llama"
        and getattr(cfg, "hidden_act", None) == "silu"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "pretraining_tp", 1) == 1
        and hasattr(model, "model")
        and hasattr(model.model, "rotary_emb")
        and hasattr(model, "lm_head")
    )


class LlamaForward:
    """Callable forward for a Llama ``*ForCausalLM``.

    At construction each decoder layer's q/k/v projections are fused into one matmul and its
    gate/up projections into another (:func:`kvreuse.models.quant.fuse_linears`: the parts
    become row views of the fused weight, so memory does not grow and the model's own forward
    still works). The step then runs on ``[T, hidden]`` rows: per layer two RMSNorms, three
    matmuls plus ``down_proj``, RoPE on q and k together, one ``attend`` call.

    ``invariant``: a row's logits do not depend on the rows beside it (``--deterministic``;
    attention is the ``ForwardContext``'s part): every step through the fused kernel path
    where every projection has kvreuse's int4 kernel (its rows computed alone at any count),
    else every projection and norm through :mod:`kvreuse.models.invariant`.

    The caller must hold ``torch.inference_mode()`` and check ``supports(model)`` first.
    """

    def __init__(self, model: LlamaForCausalLM, invariant: bool = False) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama model; use its transformers forward")
        cfg = model.config
        self.model = model
        self.invariant = invariant
        self.hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        # LlamaConfig already turns None into num_attention_heads; the "or" only tells the type
        self.num_kv_heads: int = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        # ModuleList is untyped; LlamaModel builds it of LlamaDecoderLayer
        self.layers = [_Layer(cast("LlamaDecoderLayer", layer)) for layer in model.model.layers]
        self.final_norm = _NormWeight(model.model.norm.weight)
        # few-row steps fold norms, SiLU and residual adds into kvreuse's int4 kernel; in
        # invariant mode every step does (its rows are computed alone at any count)
        self.native_fused = _all_native_int4(self.layers)
        scales = {layer.scaling for layer in self.layers}
        # llama_layers takes one attention scale for every layer, and its attention reads rows of
        # d a multiple of 16 up to 256 (flash.kernels_read); None: every step takes the per-op path
        fits = self.head_dim % 16 == 0 and self.head_dim <= 256
        self._scale: float | None = scales.pop() if len(scales) == 1 and fits else None
        # the tensors as fused above (the norm weights are the model's own parameters, as
        # _NormWeight holds them): llama_layers' argument, built once
        self._weights = _layer_weights(self.layers) if self.native_fused else []
        half = self.head_dim // 2
        # rotate_half(x) = cat(-x2, x1) = roll(x, half) * sign: the sign folds into sin once per step
        self._sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)])  # [head_dim]

    def __call__(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        logits_index: torch.Tensor,  # [n] positions in T whose logits are wanted
        kv_context: ForwardContext,
        num_layers: int | None = None,
    ) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` (model dtype) for the ``logits_index`` positions; writes
        every layer's new K/V into the pool through ``attend``. ``num_layers``: run only the
        first layers (their K/V written, nothing else) and return ``None`` (seam repair's
        deviation pass)."""
        inner = self.model.model
        t = input_ids.shape[1]
        heads, kv, d, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        x = inner.embed_tokens(input_ids[0])  # [T, hidden]
        cos, sin = inner.rotary_emb(x, position_ids)  # each [1, T, head_dim]
        cos = cos[0].unsqueeze(1)  # [T, 1, d]: broadcast over the q and k heads
        sin = (sin[0] * self._sign.to(sin.device, sin.dtype)).unsqueeze(1)  # [T, 1, d]
        qk_heads = heads + kv
        proj, norm = (invariant.project, _invariant_norm) if self.invariant else (_call, rms_norm)
        if (
            self.native_fused
            and x.dtype == torch.bfloat16
            and (self.invariant or dense_rule.dense_dtype(t, x.dtype) is None)
        ):
            x = self._fused_layers(x, cos, sin, kv_context, num_layers)
            if num_layers is not None:
                return None
            return proj(self.model.lm_head, norm(x[logits_index], self.final_norm, eps))  # [n, vocab]
        for i, layer in enumerate(self.layers[:num_layers]):
            h = norm(x, layer.input_norm, eps)
            qkv = proj(layer.qkv, h).view(t, qk_heads + kv, d)  # [T, heads + 2 kv, d]: q, k, v heads
            qk = qkv[:, :qk_heads]
            # RoPE on q and k at once; transformers' apply_rotary_pos_emb computes the same
            qk = torch.addcmul(qk * cos, torch.roll(qk, d // 2, -1), sin)  # [T, heads + kv, d]
            o = attend(i, qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:], kv_context, layer.scaling)  # [T, heads, d]
            x = x + proj(layer.o_proj, o.reshape(t, heads * d))
            h = norm(x, layer.post_norm, eps)
            gu = proj(layer.gate_up, h)  # [T, 2 * intermediate]
            x = x + proj(layer.down_proj, F.silu(gu[:, : layer.inter]).mul_(gu[:, layer.inter :]))
        if num_layers is not None:
            return None
        x = norm(x[logits_index], self.final_norm, eps)  # [n, hidden]
        return proj(self.model.lm_head, x)  # [n, vocab]

    def _fused_layers(
        self,
        x: torch.Tensor,  # [T, hidden] bf16
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d], rotate_half's sign folded in
        kv_context: ForwardContext,
        num_layers: int | None,
    ) -> torch.Tensor:
        """The layers with every projection on kvreuse's int4 kernel (a few rows; any number in
        invariant mode): each norm, the SiLU-and-multiply and each residual add folded into a
        projection's call (5 calls a layer fewer). Returns the last layer's ``[T, hidden]``."""
        t = x.shape[0]
        heads, kv, d, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        qk_heads = heads + kv
        cos, sin = cos.view(t, d), sin.view(t, d)
        items = _native_items(kv_context) if self.invariant and self._scale is not None else None
        if items is not None:  # every layer in one C++ call: the same kernels in the same order
            pool = cast("KVStore", kv_context.kv_cache).tensor
            layers = len(self.layers) if num_layers is None else num_layers
            weights = self._weights[: LAYER_TENSORS * layers]
            flat, slots = items
            return torch.ops.kvreuse.llama_layers(
                x, weights, eps, cos, sin, pool, kv_context.slot_mapping, flat, slots, heads, kv, self._scale
            )
        for i, layer in enumerate(self.layers[:num_layers]):
            qkv_proj, o_proj = cast("Int4Linear", layer.qkv), cast("Int4Linear", layer.o_proj)
            gate_up, down = cast("Int4Linear", layer.gate_up), cast("Int4Linear", layer.down_proj)
            qkv = qkv_proj.native_fused(x, layer.input_norm.weight, eps).view(t, qk_heads + kv, d)
            qk = torch.ops.kvreuse.rope_(qkv, cos, sin, qk_heads)[:, :qk_heads]  # [T, heads + kv, d], in place
            o = attend(i, qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:], kv_context, layer.scaling)  # [T, heads, d]
            x = o_proj.native_fused(o.reshape(t, heads * d).contiguous(), residual=x)
            gu = gate_up.native_fused(x, layer.post_norm.weight, eps)  # [T, 2 * intermediate]
            x = down.native_fused(gu, silu_mul=True, residual=x)
        return x


def resolve_deterministic(requested: bool | None, model: torch.nn.Module) -> bool:
    """``--deterministic`` as asked (True / False), or, for None (the default), whether the
    batch-invariant forward costs about nothing here: a plain Llama whose every decoder
    projection is an int4 layer on kvreuse's kernels (bf16 on CPU). Those kernels compute each
    row alone at any row count, and kvreuse's attention kernels keep the same contract at the
    flash kernel's speed (docs/deterministic.md: cold TTFT 1.08x, decode 0.99x measured).
    Raises nothing: a model the mode cannot serve is refused by ``ModelRunner`` when asked."""
    if requested is not None:
        return requested
    if not supports(model) or native_kernels() is None:
        return False
    return all(
        _native_int4(p)
        for layer in model.model.layers
        for p in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        )
    )


def _all_native_int4(layers: list[_Layer]) -> bool:
    """Whether every projection of every layer is an Int4Linear on kvreuse's kernel, without bias
    (what ``LlamaForward._fused_layers`` needs)."""
    return all(_native_int4(p) for layer in layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj))


def _native_items(ctx: ForwardContext) -> tuple[list[int], list[torch.Tensor | None]] | None:
    """The step's items as ``kvreuse::llama_layers`` takes them (``(start, n, run start or -1,
    keys)`` flattened, and each item's slots or None for one run), or None where that loop cannot
    run the step: a padded decode batch, an int8 or non-bf16 pool, documents' frames or masked
    items (``attention.attend`` serves those)."""
    kv = ctx.kv_cache
    if ctx.decodes is not None or not isinstance(kv, KVStore) or kv.format.quantized:
        return None
    if kv.tensor.dtype != torch.bfloat16 or kv.tensor.device.type != "cpu":
        return None
    flat: list[int] = []
    slots: list[torch.Tensor | None] = []
    for item in ctx.prefills:
        if item.frames is not None or item.masked:
            return None
        if len(item.kv_runs) == 1:
            ((first, length),) = item.kv_runs
            flat += (item.start, item.num_new, first, length)
            slots.append(None)
        else:
            flat += (item.start, item.num_new, -1, item.keys.num_keys)
            slots.append(item.kv_slots)
    return flat, slots


LAYER_TENSORS = 14  # tensors a layer passes to kvreuse::llama_layers


def _layer_weights(layers: list[_Layer]) -> list[torch.Tensor]:
    """Each layer's 14 tensors in ``kvreuse::llama_layers``' order: q/k/v, o, gate/up and down
    (each qweight, scale, min), then the input and post-attention norm weights (read live)."""
    out: list[torch.Tensor] = []
    for layer in layers:
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj):
            d = p.__dict__  # not nn.Module.__getattr__: ~0.6 us a lookup, 120 a step
            out += (d["_buffers"]["qweight"], d["native_scale"], d["native_min"])
        out += (layer.input_norm.weight, layer.post_norm.weight)
    return out


def _native_int4(p: object) -> bool:
    """An Int4Linear on kvreuse's kernel, without bias (what the fused path takes)."""
    return isinstance(p, Int4Linear) and p.native and p.bias is None


def _call(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _invariant_norm(x: torch.Tensor, w: _NormWeight, eps: float) -> torch.Tensor:
    return invariant.rms_norm(x, w.weight, eps)


class _Layer:
    """One decoder layer's weights as the step uses them (fused where the weights allow)."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = _NormWeight(layer.input_layernorm.weight)
        self.post_norm = _NormWeight(layer.post_attention_layernorm.weight)
        self.scaling = attn.scaling
        self.qkv = fused_projection(attn, ("q_proj", "k_proj", "v_proj")) or _Concat(
            attn.q_proj, attn.k_proj, attn.v_proj
        )
        self.o_proj = attn.o_proj
        self.inter = mlp.gate_proj.out_features
        self.gate_up = fused_projection(mlp, ("gate_proj", "up_proj")) or _Concat(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj


class _NormWeight:
    """An RMSNorm weight ``[hidden]`` (the model's own parameter, read live) and, on CPU, the
    same weight twice ``[2 * hidden]`` for ``rms_norm``'s layer-norm form, rebuilt whenever the
    parameter changes in place or is replaced (its version counter or storage moves)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._doubled: torch.Tensor | None = None
        self._key: tuple | None = None

    def doubled(self) -> torch.Tensor:
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor has no version counter: in-place updates are not allowed on it
            version = None
        key = (w.data_ptr(), version, w.dtype)
        doubled = self._doubled
        if key != self._key or doubled is None:
            doubled = self._doubled = torch.cat([w, w])
            self._key = key
        return doubled


def rms_norm(x: torch.Tensor, w: _NormWeight, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (hidden,), w.weight, eps)`` for ``x [T, hidden]``.

    On CPU, for a few rows, as the layer norm of ``[x, -x]``: that row has mean 0 and variance
    ``mean(x^2)``, so its first half is ``x / rms(x) * w`` (the second half is dropped). Why:
    PyTorch's CPU ``rms_norm`` is a composite of ~10 small ops (casts, pow, mean, rsqrt, ...),
    its ``layer_norm`` one fused kernel, and a decode step runs 61 norms of one row: 6.7 vs 10.4
    us a norm ([1, 576] bf16, 1 thread; both accumulate in fp32: bf16 outputs equal, fp32 ones
    within a few ulp, the computed mean of ``[x, -x]`` being ~0 rather than 0). The doubled row
    costs more than the composite's fixed overhead saves from 3 rows in fp32 and 9 in bf16
    (measured), so longer inputs and other devices (CUDA has a fused ``rms_norm``) take the
    plain call."""
    rows = x.shape[0]
    if x.device.type != "cpu" or rows > (LAYER_NORM_MAX_ROWS_FP32 if x.dtype == torch.float32 else LAYER_NORM_MAX_ROWS):
        return F.rms_norm(x, (x.shape[-1],), w.weight, eps)
    hidden = x.shape[-1]
    # contiguous: a copy only when T > 1 (the int4 kernel takes contiguous rows)
    return F.layer_norm(torch.cat([x, -x], -1), (2 * hidden,), w.doubled(), None, eps)[:, :hidden].contiguous()


LAYER_NORM_MAX_ROWS = 8  # bf16 / fp16: up to this many rows the layer-norm form is faster on CPU
LAYER_NORM_MAX_ROWS_FP32 = 2


class _Concat:
    """Projections that could not be fused, called one by one: outputs concatenated."""

    def __init__(self, *parts: torch.nn.Module) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
