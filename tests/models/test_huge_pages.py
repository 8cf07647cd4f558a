"""``models/huge_pages``: a best-effort request that changes no value, counts each storage once,
skips what cannot hold a huge page, and honours the ``THP_MEM_ALLOC_ENABLE=0`` opt-out."""

from __future__ import annotations

import torch

from kvreuse.models import huge_pages
from kvreuse.models.huge_pages import HUGE


def _interior(t: torch.Tensor) -> int:
    addr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    return max(0, ((addr + size) & ~(HUGE - 1)) - ((addr + HUGE - 1) & ~(HUGE - 1)))


def test_collapse_changes_no_value_and_counts_each_storage_once():
    t = torch.arange(3 * HUGE // 4, dtype=torch.float32)  # 6 MB: at least one aligned 2 MB page inside
    before = t.clone()
    done = huge_pages.collapse([t, t[10:], torch.zeros(16)])  # a view of the same storage, a small tensor
    assert done in (0, _interior(t))  # 0 where the kernel refuses (older than 6.1, THP off)
    assert _interior(t) >= HUGE and torch.equal(t, before)


def test_the_opt_out_and_small_tensors_do_nothing(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert not huge_pages.enabled()
    assert huge_pages.collapse([torch.zeros(HUGE)]) == 0
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert huge_pages.collapse([torch.zeros(HUGE // 8)]) == 0  # under 2 MB: no page to fill
