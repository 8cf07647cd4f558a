"""Sequence: the block table kept in step with the blocks, positions without per-token loops."""

from __future__ import annotations

import pytest

from kvreuse import SamplingParams
from kvreuse.cache.kv_block import KVBlock
from kvreuse.engine.sequence import Sequence


def test_block_table_follows_append_replace_and_clear():
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    assert seq.blocks == () and seq.block_table.tolist() == []
    seq.append_blocks([KVBlock(block_id=i) for i in (7, 3)])
    seq.append_blocks([KVBlock(block_id=i) for i in range(20, 30)])  # past the first capacity: grows
    assert seq.block_table.tolist() == [b.block_id for b in seq.blocks] == [7, 3, *range(20, 30)]
    seq.replace_block(1, KVBlock(block_id=99))
    assert seq.block_table.tolist() == [b.block_id for b in seq.blocks] == [7, 99, *range(20, 30)]
    seq.clear_blocks()
    assert seq.blocks == () and seq.block_table.tolist() == []
    seq.append_blocks([KVBlock(block_id=5)])
    assert seq.block_table.tolist() == [5]
    with pytest.raises(AttributeError):
        seq.blocks = []  # read-only: the table would fall out of step


def test_positions_and_tokens_between_equal_the_per_token_answers():
    plain = Sequence("a", [4, 5, 6], SamplingParams())
    pml = Sequence("b", [4, 5, 6, 7], SamplingParams(), prompt_positions=[10, 11, 40, 41])
    for seq in (plain, pml):
        seq.output_token_ids += [8, 9, 10]
        n = seq.num_tokens
        for a in range(n + 1):
            for b in range(a, n + 1):
                assert seq.positions_between(a, b).tolist() == [seq.position(i) for i in range(a, b)]
                assert seq.token_ids_between(a, b) == seq.token_ids[a:b]
    assert plain.key_positions(5) is None  # no context, no explicit positions: 0..n-1
    pml.context = held_context([100, 101], [0, 1])
    for num_own in (0, 2, 7, 3, 7):  # extended on demand, earlier views unchanged
        assert pml.key_positions(num_own).tolist() == [0, 1] + [pml.position(i) for i in range(num_own)]
    plain.context = held_context([100], [3])
    assert plain.context_slots.tolist() == [100]
    assert plain.key_positions(2).tolist() == [3, 0, 1]
    plain.context.release()  # released: no context keys until acquired again
    assert plain.context_slots.tolist() == [] and plain.key_positions(2) is None
    assert plain.context.acquire() and plain.key_positions(2).tolist() == [3, 0, 1]


class _Held:
    def __init__(self, slots, positions):
        self.blocks, self.slots, self.positions = (), tuple(slots), tuple(positions)


class _Source:
    """A context source that always has room (the real one is ModuleCache.source)."""

    def __init__(self, slots, positions):
        self.num_tokens, self.num_blocks = len(slots), 0
        self._kv = (slots, positions)

    def acquire(self):
        return _Held(*self._kv)

    def release(self, held):
        pass


def held_context(slots, positions):
    from kvreuse.engine.context import PromptContext

    context = PromptContext(_Source(slots, positions))
    assert context.acquire()
    return context
