"""kvreuse's ZMQ KV events against the wire contract that KV-aware routers built for vLLM
parse, decoded here with that contract alone (pyzmq + msgpack; no kvreuse decoder), and a
small consumer that routes on them.

The contract, as the consumers' own code states it:

- vLLM, ``vllm/distributed/kv_events.py`` (vllm-project/vllm, read at 0181ea3):
  ``ZmqEventPublisher`` sends ``(topic, seq.to_bytes(8, "big"), payload)``, ``seq`` counting
  batches from 0; its replay ROUTER answers ``[b"", start_seq (8 bytes)]`` with
  ``[b"", seq, payload]`` per kept batch, then ``END_SEQ = (-1).to_bytes(8, "big", signed=True)``.
  ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...)``,
  ``BlockRemoved(block_hashes, medium, ...)``, ``AllBlocksCleared``: msgspec ``tag=True``
  structs (tag first, then the fields in this order); ``MEDIUM_GPU = "GPU"``.
- NVIDIA Dynamo, ``lib/kv-router/src/zmq_wire.rs`` and ``src/bin/kv_indexer/listener.rs``
  (ai-dynamo/dynamo, read at 0cda21d), what its standalone indexer and router decode: exactly
  3 frames, an 8-byte sequence number, a gap answered by a replay request; the batch is the
  array ``(f64 ts, [event], Option<i32> data_parallel_rank)``; an event is a tagged array or a
  map with ``"type"``; hashes are i64 or u64; ``token_ids`` are u32; ``block_size`` usize;
  position 5 is ``lora_id`` (Option<u64>), position 6 ``medium`` (Option<String>, mapped by
  ``StorageTier::from_kv_medium``: GPU, CPU, DISK, REMOTE among others); a ``BlockStored``
  whose hashes (its parent included) repeat is dropped; each block must bring
  ``block_size`` tokens (``create_stored_blocks``). The consumer keys blocks by a hash of their
  tokens chained to the parent's, and uses the engine's hashes only to find parents and
  removals: so does the consumer below.

Dynamo's own indexer (``python -m dynamo.indexer`` from ai-dynamo-runtime 1.6.1) reading
these events is exercised by ``test_dynamo_indexer.py`` and ``bench/interop/dynamo_indexer.py``
where that package is installed (it is not a kvreuse dependency).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq

from kvreuse import LLM, SamplingParams
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.publisher import ZmqEventPublisher
from tests.events.event_helpers import snapshot_levels

BS = 16
U64 = (1 << 64) - 1
MEDIA = {"GPU", "CPU", "DISK", "REMOTE"}  # kvreuse's levels; each one StorageTier::from_kv_medium knows
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
ONE = SamplingParams(max_tokens=1, temperature=0)


def is_hash(h: object) -> bool:
    """An i64 or u64, as Dynamo's ``BlockHashValue`` takes (msgpack ints only: no bytes)."""
    return isinstance(h, int) and not isinstance(h, bool) and -(1 << 63) <= h <= U64


def check_event(event: object) -> dict:
    """One event checked against the contract, as a dict of its fields (and ``type``)."""
    if isinstance(event, dict):  # the map form: {"type": tag, field: value, ...}
        fields = dict(event)
    else:
        assert isinstance(event, list) and event and isinstance(event[0], str), event
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
        assert event[0] in names, event[0]
        assert len(event) - 1 <= len(names[event[0]]), event  # nothing past the documented fields
        fields = {"type": event[0], **dict(zip(names[event[0]], event[1:]))}
    tag = fields["type"]
    if tag == "BlockStored":
        hashes, parent, tokens = fields["block_hashes"], fields["parent_block_hash"], fields["token_ids"]
        assert hashes and all(is_hash(h) for h in hashes), hashes
        assert parent is None or is_hash(parent)
        assert len({h & U64 for h in hashes} | ({parent & U64} if parent is not None else set())) == len(hashes) + (
            parent is not None
        ), "a repeated hash: Dynamo drops the event"
        assert fields["block_size"] == BS and isinstance(fields["block_size"], int)
        assert len(tokens) == BS * len(hashes) and all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens)
        assert fields["lora_id"] is None
        assert fields["medium"] in MEDIA
    elif tag == "BlockRemoved":
        assert fields["block_hashes"] and all(is_hash(h) for h in fields["block_hashes"])
        assert fields["medium"] in MEDIA
    else:
        assert tag == "AllBlocksCleared" and set(fields) == {"type"}, fields
    return fields


def tokens_key(parent: bytes, tokens: list[int]) -> bytes:
    """The consumer's own key of a block: its tokens chained to its parent's key (the way
    Dynamo keys blocks by ``compute_block_hash_for_seq``, with a hash of our choosing)."""
    return hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=16).digest()


@dataclass
class Worker:
    """What the consumer knows of one executor, from its events alone."""

    endpoint: str
    replay_endpoint: str
    expected_seq: int = 0  # the next batch it must apply
    key_of: dict[int, bytes] = field(default_factory=dict)  # engine hash (u64) -> the consumer's token key
    held: dict[int, set[str]] = field(default_factory=dict)  # engine hash (u64) -> levels it is held at
    parents_unknown: int = 0  # stored blocks whose parent the executor never announced
    removed: int = 0  # hashes named by BlockRemoved events

    def levels(self) -> dict[str, set[int]]:
        """Level -> engine hashes held there (as a snapshot lists them)."""
        out: dict[str, set[int]] = {}
        for h, levels in self.held.items():
            for level in levels:
                out.setdefault(level, set()).add(h)
        return out


class ContractConsumer:
    """A KV-aware router's event side and scorer, written from the contract above."""

    def __init__(self, workers: dict[str, Worker]) -> None:
        self.ctx = zmq.Context()
        self.workers = workers
        self.subs: dict[str, zmq.Socket] = {}
        self.replays: dict[str, zmq.Socket] = {}
        for name, w in workers.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(w.endpoint)
            replay = self.ctx.socket(zmq.DEALER)
            replay.connect(w.replay_endpoint)
            self.subs[name], self.replays[name] = sub, replay

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def catch_up(self, name: str, last_seq: int) -> None:
        """Apply ``name``'s batches up to ``last_seq``: live ones as they come, a gap (the
        subscription not set up yet, a drop) from the replay socket."""
        w, sub = self.workers[name], self.subs[name]
        while w.expected_seq <= last_seq:
            if sub.poll(100):
                frames = sub.recv_multipart()
                assert len(frames) == 3 and len(frames[1]) == 8, frames[:2]
                seq = int.from_bytes(frames[1], "big")
                if seq == w.expected_seq:
                    self.apply(name, frames[2])
                elif seq > w.expected_seq:
                    self.replay(name)
            else:
                self.replay(name)

    def replay(self, name: str) -> None:
        w, sock = self.workers[name], self.replays[name]
        sock.send_multipart([b"", w.expected_seq.to_bytes(8, "big")])
        while True:
            empty, seq_bytes, payload = sock.recv_multipart()
            assert empty == b"" and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return
            if seq == w.expected_seq:
                self.apply(name, payload)

    def apply(self, name: str, payload: bytes) -> None:
        w = self.workers[name]
        batch = msgpack.unpackb(payload)
        assert isinstance(batch, list) and len(batch) == 3, batch  # (f64, [event], Option<i32>)
        ts, events, rank = batch
        assert isinstance(ts, float) and isinstance(events, list) and rank in (None, 0)
        for raw in events:
            event = check_event(raw)
            if event["type"] == "AllBlocksCleared":
                w.held.clear()
                w.key_of.clear()
            elif event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    w.held.get(h & U64, set()).discard(event["medium"])
                    w.removed += 1
            else:
                parent = event["parent_block_hash"]
                key = b"" if parent is None else w.key_of.get(parent & U64)
                if key is None:
                    w.parents_unknown += 1
                    continue
                tokens = event["token_ids"]
                for i, h in enumerate(event["block_hashes"]):
                    key = tokens_key(key, tokens[i * BS : (i + 1) * BS])
                    w.key_of[h & U64] = key
                    w.held.setdefault(h & U64, set()).add(event["medium"])
        w.expected_seq += 1

    def overlap(self, name: str, prompt: list[int]) -> int:
        """Leading full blocks of ``prompt`` that ``name`` holds at some level."""
        w = self.workers[name]
        held = {w.key_of[h] for h, levels in w.held.items() if levels}
        key, n = b"", 0
        for i in range(len(prompt) // BS):
            key = tokens_key(key, prompt[i * BS : (i + 1) * BS])
            if key not in held:
                break
            n += 1
        return n

    def route(self, prompt: list[int], turn: int) -> str:
        """The worker with the longest overlap; ties (no overlap anywhere) round robin."""
        names = sorted(self.workers)
        scores = {n: self.overlap(n, prompt) for n in names}
        best = max(scores.values())
        tied = [n for n in names if scores[n] == best]
        return tied[turn % len(tied)]


def executor(tiny_llama, encoding: str = "array", **tiers):
    """An engine of the tiny model with a ZMQ publisher (and its replay socket) on loopback."""
    buffer = EventBuffer(100_000)
    llm = LLM(loaded=tiny_llama, events=buffer, block_size=BS, max_model_len=1024, **tiers)
    publisher = ZmqEventPublisher(
        buffer,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        event_encoding=encoding,
        context=zmq.Context(),
    ).start()
    return llm, buffer, publisher


def settle(consumer: ContractConsumer, name: str, buffer: EventBuffer, publisher: ZmqEventPublisher) -> None:
    """Wait until the publisher has sent every buffered event, then apply all of it."""
    deadline = time.monotonic() + 30
    while publisher.last_event_id != buffer.last_event_id:
        assert time.monotonic() < deadline, "the publisher did not catch up with the buffer"
        time.sleep(0.01)
    consumer.catch_up(name, publisher.last_seq)


def u64_levels(levels: dict) -> dict[str, set[int]]:
    return {level: {int.from_bytes(h, "big") & U64 for h in held} for level, held in levels.items()}


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_events_meet_the_contract_on_every_level_and_rebuild_the_cache(tiny_llama, encoding):
    # ~24 device blocks and a host tier: later requests evict, blocks move GPU -> CPU
    llm, buffer, pub = executor(tiny_llama, encoding, kv_cache_memory_gib=0.0002, host_cache_memory_gib=0.0004)
    consumer = ContractConsumer({"a": Worker(pub.endpoint, pub.replay_endpoint)})
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(200, 49000) for _ in range(6 * BS + 3)] for _ in range(12)]
        for p in prompts:
            llm.generate(p, ONE)
        llm.engine.check_integrity()
        settle(consumer, "a", buffer, pub)
        w = consumer.workers["a"]
        assert w.parents_unknown == 0  # every parent announced before its child, at some level
        assert w.removed > 0  # evictions travelled
        levels = {level: held for level, held in w.levels().items() if held}
        assert levels == u64_levels(snapshot_levels(llm.engine.kv_snapshot()))  # the engine's cache exactly
        assert set(levels) == {"GPU", "CPU"}
        assert consumer.overlap("a", prompts[-1]) == 6  # by the consumer's own token keys
    finally:
        consumer.close()
        pub.close()


def test_a_contract_only_consumer_routes_4_prefix_groups_to_their_holders(tiny_llama):
    stacks = {name: executor(tiny_llama, kv_cache_memory_gib=0.004) for name in ("a", "b")}
    consumer = ContractConsumer({n: Worker(pub.endpoint, pub.replay_endpoint) for n, (_, _, pub) in stacks.items()})
    rng = random.Random(11)
    groups = [[rng.randrange(200, 49000) for _ in range(4 * BS)] for _ in range(4)]
    holder = {0: "a", 1: "a", 2: "b", 3: "b"}
    try:
        for g, prefix in enumerate(groups):  # each group computed once, on its holder
            stacks[holder[g]][0].generate(prefix + [rng.randrange(200, 49000) for _ in range(5)], ONE)
        routed, cached = [], []
        for i in range(40):
            for name, (_, buffer, pub) in stacks.items():
                settle(consumer, name, buffer, pub)
            g = i % 4
            prompt = groups[g] + [rng.randrange(200, 49000) for _ in range(20)]
            chosen = consumer.route(prompt, i)
            routed.append(chosen == holder[g])
            cached.append(stacks[chosen][0].generate(prompt, ONE)[0].num_cached_tokens)
        assert sum(routed) / len(routed) >= 0.9, routed
        assert sum(routed) == 40 and cached == [4 * BS] * 40  # each one on its holder, its prefix a hit
        for llm, _, _ in stacks.values():
            llm.engine.check_integrity()
    finally:
        consumer.close()
        for _, _, pub in stacks.values():
            pub.close()
