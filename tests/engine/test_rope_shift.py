"""RopeShift: keys computed at positions p, re-rotated by delta, equal keys computed at p + delta
(fp32, <= 1e-4) on the tiny Llama and the tiny Gemma 3 (two rope bases: local and global layers)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvreuse.engine.rope_shift import RopeShift


def keys_at(loaded, k0: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's own RoPE on un-rotated keys ``k0`` [layers, kv_heads, n, d] at ``positions`` [n]."""
    model = loaded.model
    rotary = model.model.rotary_emb
    types = getattr(model.config, "layer_types", None)
    out = []
    for layer in range(k0.shape[0]):
        x = k0[layer : layer + 1]  # [1, kv, n, d]
        if isinstance(getattr(rotary, "rope_type", None), dict):
            cos, sin = rotary(x, positions[None], types[layer])
        else:
            cos, sin = rotary(x, positions[None])
        _, k = apply_rotary_pos_emb(x, x, cos, sin)
        out.append(k[0])
    return torch.stack(out)  # [layers, kv, n, d]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_rotated_keys_equal_keys_at_new_positions(arch, request):
    loaded = request.getfixturevalue(arch)
    shape = loaded.shape
    gen = torch.Generator().manual_seed(0)
    k0 = torch.randn(shape.num_layers, shape.num_kv_heads, 40, shape.head_dim, generator=gen)  # [L, kv, n, d]
    old = torch.arange(3, 43)  # [n]
    new = torch.cat((torch.arange(500, 520), torch.arange(0, 20)))  # forward and backward moves
    shift = RopeShift.of(loaded.model)
    moved = shift.rotate(keys_at(loaded, k0, old), new - old)
    expected = keys_at(loaded, k0, new)
    assert moved.shape == expected.shape
    assert (moved - expected).abs().max().item() <= 1e-4
    assert (keys_at(loaded, k0, old) - expected).abs().max().item() > 0.1  # the move really changes them


def test_gemma3_local_and_global_layers_use_their_own_bases(tiny_gemma3):
    shift = RopeShift.of(tiny_gemma3.model)
    cfg = tiny_gemma3.model.config
    bases = {t: cfg.rope_parameters[t]["rope_theta"] for t in set(cfg.layer_types)}
    assert bases["sliding_attention"] != bases["full_attention"]
    d = cfg.head_dim
    for layer, kind in enumerate(cfg.layer_types):
        want = 1.0 / (bases[kind] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        assert torch.allclose(shift.inv_freq[layer], want)
