"""/metrics exports the disk store's gauges (entries, bytes) inside a Prometheus *counter*
family (kvreuse:disk_tier_events), so a counter goes down when a block file is refused and
deleted (Prometheus reads a decrease as a counter reset)."""

from kvreuse import LLM, SamplingParams
from kvreuse.server.metrics import _tier_metrics

ONE = SamplingParams(max_tokens=1, temperature=0)
PROMPT = [(i * 37) % 4000 + 10 for i in range(61)]


def executor(loaded, d):
    return LLM(loaded=loaded, kv_cache_memory_gib=0.001, block_size=4, host_cache_memory_gib=0.001,
               disk_cache_dir=str(d))


def disk_family(engine):
    fams = {f.name: f for f in _tier_metrics(engine.stats(), [], [])}
    fam = fams["kvreuse:disk_tier_events"]
    return fam.type, {s.labels["event"]: s.value for s in fam.samples}


def test_disk_store_counters_never_decrease(tiny_llama, tmp_path):
    first = executor(tiny_llama, tmp_path)
    first.generate(PROMPT, ONE)
    assert first.engine.host.below.flush(30)
    llm = executor(tiny_llama, tmp_path)
    disk = llm.engine.host.below.disk
    victim = next(p for p in tmp_path.rglob("*.kvb"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    kind, before = disk_family(llm.engine)
    key = next(k for k in list(disk._index) if disk._path(k) == victim)
    tiers = llm.engine.host.below
    assert disk.get(key, shape=tiers.block_shape, dtype=tiers.dtype) is None  # refused, deleted (admission's path)
    kind, after = disk_family(llm.engine)
    print(kind, "before", before, "after", after)
    decreased = {k: (before[k], after[k]) for k in before if after.get(k, 0) < before[k]}
    assert kind == "counter"
    assert not decreased, f"counter samples went down: {decreased}"
