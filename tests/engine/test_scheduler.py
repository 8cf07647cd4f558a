"""The scheduler's step plan on a simulated pool: decode first, the prefill cap while anyone
decodes, running order kept in the plan, and the pool's integrity after every step."""

import pytest

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.kv_cache_manager import KVCacheManager
from kvreuse.engine.scheduler import Scheduler, default_prefill_cap, default_prefill_per_decode
from kvreuse.engine.sequence import Sequence
from kvreuse.sampling_params import SamplingParams

BS = 4


def make(cap, budget=64, n_blocks=64, per_decode=0):
    pool = BlockPool(n_blocks, BS)
    return Scheduler(
        KVCacheManager(pool, model_id="m"),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_prefill_tokens_while_decoding=cap,
        prefill_tokens_per_decode=per_decode,
    ), pool


def run_plan(sched, pool, plan):
    """What the engine does after a forward: computed tokens advance, a finished prefill samples."""
    for item in plan:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_token_ids.append(7)
    pool.check_integrity()


def plan_of(plan):
    return [(item.seq.request_id, item.num_new_tokens) for item in plan]


def test_prefill_is_capped_only_while_a_sequence_decodes():
    sched, pool = make(cap=5)
    a = Sequence("a", list(range(10)), SamplingParams())
    sched.add(a)
    first = sched.schedule()
    assert plan_of(first) == [("a", 10)]  # nobody decodes: the whole prompt in one step
    run_plan(sched, pool, first)
    b = Sequence("b", list(range(100, 112)), SamplingParams())
    sched.add(b)
    steps = []
    for _ in range(3):
        plan = sched.schedule()
        steps.append(plan_of(plan))
        run_plan(sched, pool, plan)
    # a decodes every step; b's 12 prompt tokens come 5 at a time, then b decodes too
    assert steps == [[("a", 1), ("b", 5)], [("a", 1), ("b", 5)], [("a", 1), ("b", 2)]]
    assert plan_of(sched.schedule()) == [("a", 1), ("b", 1)]
    pool.check_integrity()


def test_decodes_come_before_a_running_prefill_when_the_budget_is_short():
    sched, pool = make(cap=None, budget=4)
    a = Sequence("a", list(range(9)), SamplingParams())
    b = Sequence("b", list(range(50, 53)), SamplingParams())
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan_of(plan) == [("a", 4)]  # a admitted first takes the whole budget
    run_plan(sched, pool, plan)
    plan = sched.schedule()
    assert plan_of(plan) == [("a", 4)]
    run_plan(sched, pool, plan)
    plan = sched.schedule()
    assert plan_of(plan) == [("a", 1), ("b", 3)]
    run_plan(sched, pool, plan)
    c = Sequence("c", list(range(200, 220)), SamplingParams())
    sched.add(c)
    # a and b decode (2 tokens); c's prefill gets the 2 left
    plan = sched.schedule()
    assert plan_of(plan) == [("a", 1), ("b", 1), ("c", 2)]
    run_plan(sched, pool, plan)
    sched.running.insert(0, sched.running.pop())  # c (mid-prefill) now ahead of the decodes
    plan = sched.schedule()
    # running order kept, decodes served first: before, c (first in running) took all 4 tokens
    assert plan_of(plan) == [("c", 2), ("a", 1), ("b", 1)]
    pool.check_integrity()


def test_cap_below_one_is_refused():
    pool = BlockPool(4, BS)
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 1, got 0"):
        Scheduler(KVCacheManager(pool), max_num_seqs=1, max_num_batched_tokens=8, max_prefill_tokens_while_decoding=0)


def test_default_prefill_cap_per_device_and_setting():
    assert default_prefill_cap(None, "cpu") == 16
    assert default_prefill_cap(None, "cuda") == 2048
    assert default_prefill_cap(0, "cpu") is None  # 0: no cap
    assert default_prefill_cap(32, "cuda") == 32
    assert default_prefill_per_decode(None, "cpu") == 4  # the CPU default cap grows with the batch
    assert default_prefill_per_decode(None, "cuda") == 0
    assert default_prefill_per_decode(32, "cpu") == 0  # a cap given is kept as given


def test_the_cap_grows_by_its_share_per_decoding_sequence():
    """Cap 3, 2 tokens per decode: with one decode the cap (3) holds, with three decodes 6."""
    sched, pool = make(cap=3, per_decode=2)
    seqs = [Sequence(name, list(range(i * 20, i * 20 + 4)), SamplingParams()) for i, name in enumerate("abc")]
    for seq in seqs:
        sched.add(seq)
    run_plan(sched, pool, sched.schedule())  # nobody decodes yet: the three prompts whole
    d = Sequence("d", list(range(200, 220)), SamplingParams())
    sched.add(d)
    assert plan_of(sched.schedule()) == [("a", 1), ("b", 1), ("c", 1), ("d", 6)]
    pool.check_integrity()
    e, f = make(cap=3, per_decode=2)
    a = Sequence("a", list(range(4)), SamplingParams())
    e.add(a)
    run_plan(e, f, e.schedule())
    e.add(Sequence("b", list(range(100, 120)), SamplingParams()))
    assert plan_of(e.schedule()) == [("a", 1), ("b", 3)]  # 2 x 1 decode < 3: the cap
    f.check_integrity()
    with pytest.raises(ValueError, match="prefill_tokens_per_decode must be >= 0, got -1"):
        make(cap=3, per_decode=-1)
