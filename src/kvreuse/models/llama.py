"""Our own forward pass for the Llama family, over the transformers model's own weights.

Why: a transformers forward spends much of a short step in Python and in small ops
(module calls, an RMSNorm of five passes, mask plumbing). For a decode step or the
32-token suffix of a cached prompt, that is a large share of the time. This forward
runs the same computation in the same order with fewer calls: ``F.rms_norm`` (one fused
op), the model's own rotary module for cos/sin, transformers' own RoPE function, and
``paged_attention`` for attention over the pool. Projections are called as modules, so
weight-only quantized layers (:mod:`kvreuse.models.quant`) plug in unchanged. On SmolLM2 it gives bit-identical
logits to the transformers forward (tests/models/test_llama_forward.py).

Only plain Llama checkpoints qualify (``supports``): ``model_type == "llama"``, SiLU MLP,
no attention or MLP biases, ``pretraining_tp == 1``. Anything else (Gemma 3, other
families) keeps the transformers forward, which works everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvreuse.engine.attention import ForwardContext, paged_attention


def supports(model: torch.nn.Module) -> bool:
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
    """Callable forward for a Llama ``*ForCausalLM``; holds references, copies no weight.

    The caller must hold ``torch.inference_mode()`` and check ``supports(model)`` first.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama model; use its transformers forward")
        cfg = model.config
        self.model = model
        self.hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps

    def __call__(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        logits_index: torch.Tensor,  # [n] positions in T whose logits are wanted
        kv_context: ForwardContext,
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` (model dtype) for the ``logits_index`` positions; writes
        every layer's new K/V into the pool through ``paged_attention``."""
        inner = self.model.model
        t = input_ids.shape[1]
        x = inner.embed_tokens(input_ids)  # [1, T, hidden]
        cos, sin = inner.rotary_emb(x, position_ids)  # each [1, T, head_dim]
        q_shape, kv_shape = (1, t, self.num_heads, self.head_dim), (1, t, self.num_kv_heads, self.head_dim)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            h = F.rms_norm(x, (self.hidden,), layer.input_layernorm.weight, self.eps)
            q = attn.q_proj(h).view(q_shape).transpose(1, 2)  # [1, heads, T, d]
            k = attn.k_proj(h).view(kv_shape).transpose(1, 2)  # [1, kv_heads, T, d]
            v = attn.v_proj(h).view(kv_shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # transformers' own RoPE
            o, _ = paged_attention(attn, q, k, v, None, scaling=attn.scaling, kv_context=kv_context)  # [1, T, heads, d]
            x = x + attn.o_proj(o.reshape(1, t, -1))
            h = F.rms_norm(x, (self.hidden,), layer.post_attention_layernorm.weight, self.eps)
            gate = F.silu(mlp.gate_proj(h))
            x = x + mlp.down_proj(gate.mul_(mlp.up_proj(h)))
        x = F.rms_norm(x[:, logits_index], (self.hidden,), inner.norm.weight, self.eps)  # [1, n, hidden]
        return self.model.lm_head(x)[0]  # [n, vocab]
