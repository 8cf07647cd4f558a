"""Keys read in place in several RoPE frames (kvreuse.engine.key_frames + attention's
``_flash_over_frames``): attending with the queries rotated into each key group's frame gives
attention over the keys moved to their positions (rope_shift.rotate), for a decode and a suffix,
with groups read in place and gathered; the grouping itself is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvreuse.engine import key_frames
from kvreuse.engine.attention import ForwardContext, KeyTable, PrefillItem, attend
from kvreuse.engine.key_frames import KeyFrames
from kvreuse.engine.rope_shift import RopeShift
from tests.engine.test_attention import _plain

HEAD_DIM = 16


def _rope(layers: int = 2) -> RopeShift:
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))  # [d/2]
    return RopeShift(inv.expand(layers, -1).clone())  # [layers, d/2]


def test_runs_are_split_where_the_slot_or_the_shift_changes():
    slots = np.array([10, 11, 12, 13, 20, 21, 5], np.int64)
    shifts = np.array([3, 3, 7, 7, 7, 7, 0], np.int64)
    own_starts, own_lengths = np.array([40], np.int64), np.array([2], np.int64)
    frames = KeyFrames.build(slots, shifts, own_starts, own_lengths, _rope(), "cpu")
    # shift 0 (the query as is): slot 5 and the own keys; shift 3: one run; shift 7: two runs
    assert [(g.frame, g.runs) for g in frames.groups] == [
        (-1, ((5, 1), (40, 2))),
        (0, ((10, 2),)),
        (1, ((12, 2), (20, 2))),
    ]
    assert frames.cos.shape == (2, 2, HEAD_DIM)  # [layers, frames (3, 7), d]


def test_a_group_in_many_runs_is_gathered(monkeypatch):
    monkeypatch.setattr(key_frames, "IN_PLACE_RUNS", 1)
    slots = np.array([30, 32, 34], np.int64)
    frames = KeyFrames.build(
        slots, np.full(3, 5, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), _rope(), "cpu"
    )
    (group,) = frames.groups
    assert group.runs == () and group.slots.tolist() == [30, 32, 34]


@pytest.mark.parametrize("num_new", [1, 5])
@pytest.mark.parametrize("in_place_runs", [4, 0])
def test_queries_rotated_per_frame_attend_like_moved_keys(num_new, in_place_runs, monkeypatch):
    """Three documents' keys stored where they were computed (at 0..), placed at other
    positions (shifts 12, 40, 0): the output equals plain attention over the keys rotated to
    their placed positions (fp32, 1e-5), in place and gathered."""
    monkeypatch.setattr(key_frames, "IN_PLACE_RUNS", in_place_runs)
    g = torch.Generator().manual_seed(3)
    rope = _rope()
    cache = torch.randn(2, 2, 2, 200, HEAD_DIM, generator=g)  # [layers, K/V, kv_heads, slots, d]
    context = list(range(100, 110)) + list(range(20, 26)) + list(range(60, 64))  # three documents
    shifts = np.array([12] * 10 + [40] * 6 + [0] * 4, np.int64)
    own_before = [150, 151, 152]  # own keys computed before this step (the question)
    new = list(range(170, 170 + num_new))
    own = own_before + new
    keys = KeyTable(np.asarray(context, np.int64), np.asarray(own, np.int64), 1, len(own), shifts)
    groups_end = len(own) if num_new == 1 else len(own_before)  # a lone decode's key joins the groups
    starts, lengths = keys.own_intervals(0, groups_end)
    frames = KeyFrames.build(keys.context_slots, shifts, starts, lengths, rope, "cpu")
    item = PrefillItem(0, num_new, keys, None, {}, (), frames=frames)
    ctx = ForwardContext(cache, torch.tensor(new), [item], None)
    q = torch.randn(num_new, 4, HEAD_DIM, generator=g)  # [n, heads, d]
    k, v = torch.randn(2, num_new, 2, HEAD_DIM, generator=g)  # [n, kv_heads, d]
    layer = 1
    stored_k = cache[layer, 0][:, context + own_before]  # [kv, c + 3, d] before the write
    moved = rope.rotate(stored_k[None], torch.from_numpy(np.concatenate((shifts, [0, 0, 0]))))[0]
    keys_k = torch.cat([moved.transpose(0, 1), k])  # [L, kv, d]
    keys_v = torch.cat([cache[layer, 1][:, context + own_before].transpose(0, 1), v])
    out = attend(layer, q, k, v, ctx, 0.25)
    torch.testing.assert_close(out, _plain(q, keys_k, keys_v, 0.25, num_new).float(), rtol=1e-5, atol=1e-5)


def test_frames_refuse_a_sliding_window_layer():
    keys = KeyTable(np.array([0], np.int64), np.array([5], np.int64), 1, 1, np.array([3], np.int64))
    frames = KeyFrames.build(
        keys.context_slots, keys.context_shifts, np.array([5], np.int64), np.array([1], np.int64), _rope(), "cpu"
    )
    item = PrefillItem(0, 1, keys, None, {}, (), frames=frames)
    ctx = ForwardContext(torch.zeros(2, 2, 2, 8, HEAD_DIM), torch.tensor([5]), [item], None)
    q, k, v = torch.zeros(1, 4, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM)
    with pytest.raises(RuntimeError, match="sliding-window"):
        attend(0, q, k, v, ctx, 0.25, sliding_window=4)
