"""ZMQ publisher: the event buffer, on the wire in vLLM's KV-event format.

Follows vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, positional
encoding of vLLM 0.10/0.11; see docs/events.md) so routers built for vLLM consume it::

    PUB     [topic, seq (8-byte big-endian), msgpack(EventBatch)]
    ROUTER  request [b"", start_seq] -> [b"", seq, payload] per kept batch, then [b"", -1, b""]

    EventBatch  = [ts, [event, ...], data_parallel_rank]
    BlockStored = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

``event_encoding="map"`` writes events as maps tagged by ``"type"`` (vLLM after PR #42892).
The message schema is ``kvreuse.events.wire``.
Hashes are unsigned 64-bit ints, the low 64 bits of our hash (vLLM's default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the full bytes with ``hash_format="bytes"``.
vLLM has no priorities and no "created"/"updated" events: those are not sent.

The publisher is one more reader of the ``EventBuffer``, in its own thread: the buffer is
its bounded queue, so the engine never waits for it, and ZMQ's high-water mark drops
(never blocks) for slow subscribers. If the thread falls behind far enough to lose
events, it counts them and, given a ``snapshot_fn``, publishes a resync batch
(``AllBlocksCleared`` then ``BlockStored`` for every cached block) and carries on after
the snapshot's event id; without one it skips a sequence number so subscribers see a gap.

The events carry every tenant's token ids, so by default they stay on the host: a ``*`` host
(``tcp://*:5557``, vLLM's documented endpoint) binds ``bind_host``, loopback unless asked
otherwise. ``curve`` (``kvreuse.events.curve``) encrypts both sockets and admits only the
allowed subscribers' keys; ``include_token_ids=False`` sends every ``BlockStored`` with an
empty ``token_ids`` (block hashes alone are what a router's index needs).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from kvreuse.events.buffer import EventBuffer
from kvreuse.events.curve import CurveServer
from kvreuse.events.records import AllBlocksCleared, BlocksRemoved, BlocksStored, Event, KVSnapshot
from kvreuse.events.wire import WIRE_FIELDS, stored_message, wire_hash

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
LOOPBACK = "127.0.0.1"  # where a ``*`` host binds unless ``bind_host`` says otherwise
_LOCAL_HOSTS = ("localhost", "::1", "lo")


def is_local(endpoint: str) -> bool:
    """Whether ``endpoint`` keeps events on this host: ``ipc://``, ``inproc://``, or a tcp
    endpoint on a loopback address (127.0.0.0/8, ``::1``, ``localhost``, interface ``lo``)."""
    if not endpoint.startswith("tcp://"):
        return endpoint.startswith(("ipc://", "inproc://"))
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in _LOCAL_HOSTS


def to_vllm_events(events: Sequence[Event], hash_format: str = "int") -> list[dict]:
    """vLLM events (as field dicts with a ``type`` tag) for a run of our events, merging a
    stored chain that continues the previous stored event and consecutive removals."""
    out: list[dict] = []
    for event in events:
        data = event.data
        prev = out[-1] if out else None
        if isinstance(data, BlocksStored):
            parent = data.parent_hash
            for b in data.blocks:
                h = wire_hash(b.block_hash, hash_format)
                p = None if parent is None else wire_hash(parent, hash_format)
                same_kind = (
                    prev is not None
                    and prev["type"] == "BlockStored"
                    and (prev["medium"], prev["lora_id"], prev["block_size"])
                    == (b.cache_level, b.lora_id, data.block_size)
                )
                if prev is not None and same_kind and prev["block_hashes"][-1] == p:
                    prev["block_hashes"].append(h)
                    prev["token_ids"].extend(b.token_ids)
                else:
                    prev = stored_message([h], p, list(b.token_ids), data.block_size, b.lora_id, b.cache_level)
                    out.append(prev)
                parent = b.block_hash
        elif isinstance(data, BlocksRemoved):
            hashes = [wire_hash(h, hash_format) for h in data.block_hashes]
            if prev is not None and prev["type"] == "BlockRemoved" and prev["medium"] == data.cache_level:
                prev["block_hashes"].extend(hashes)
            else:
                out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": data.cache_level})
        elif isinstance(data, AllBlocksCleared):
            out.append({"type": "AllBlocksCleared"})
        # CacheCreated / BlockUpdated have no vLLM counterpart
    return out


def snapshot_to_vllm_events(snapshot: KVSnapshot, hash_format: str = "int") -> list[dict]:
    """A resync batch: forget everything, then store every block (parents first)."""
    out: list[dict] = [{"type": "AllBlocksCleared"}]
    for b in snapshot.blocks:
        parent = None if b.parent_hash is None else wire_hash(b.parent_hash, hash_format)
        out.append(
            stored_message(
                [wire_hash(b.block_hash, hash_format)],
                parent,
                list(b.token_ids),
                snapshot.block_size,
                None,
                b.cache_level,
            )
        )
    return out


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int, event_encoding: str = "array") -> bytes:
    """msgpack of ``[ts, [events], data_parallel_rank]``; events positional (tag first) or maps."""
    wire: list[list[Any]] | list[dict] = events
    if event_encoding == "array":
        wire = [[e["type"], *(e[f] for f in WIRE_FIELDS[e["type"]])] for e in events]
    return msgpack.packb([ts, wire, data_parallel_rank], use_bin_type=True)


class EndpointError(ValueError):
    """An event socket could not bind or connect its endpoint (``replay``: the replay one)."""

    def __init__(self, endpoint: str, cause: zmq.ZMQError, *, replay: bool) -> None:
        self.endpoint, self.replay = endpoint, replay
        verb = "bind" if replay or ZmqEventPublisher.binds(endpoint) else "connect"
        super().__init__(f"cannot {verb} {endpoint!r}: {cause.strerror}")


class ZmqEventPublisher:
    """Reads ``buffer`` from its own thread and publishes vLLM event batches.

    One batch per wake-up: after the first new event it waits ``batch_interval_s`` and
    sends everything new as one batch (vLLM sends one per engine step; coalescing keeps
    the thread off the engine's GIL).
    ``endpoint``: ``tcp://*:5557`` binds (any ``*``, ipc or inproc binds), ``tcp://host:port``
    connects; ``bound`` says which (only a bound socket can be subscribed to);
    ``subscribable`` says whether a subscriber can connect now (bound and not closed).
    A ``*`` host binds ``bind_host`` (loopback by default; ``"*"`` or ``"0.0.0.0"``: every
    interface); ``leaves_host`` says whether events can reach another machine.
    ``replay_endpoint``: a ROUTER serving the last ``replay_steps`` batches.
    ``curve``: CURVE on both sockets (its ZAP handler runs on this publisher's context, a
    private one unless ``context`` is given). ``include_token_ids=False``: none on the wire.
    ``start()`` launches the thread; ``close()`` stops it and closes the sockets.
    """

    def __init__(
        self,
        buffer: EventBuffer,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        snapshot_fn: Callable[[], KVSnapshot] | None = None,
        hash_format: str = "int",
        event_encoding: str = "array",
        replay_steps: int = 10_000,
        hwm: int = 100_000,
        poll_interval_s: float = 0.05,
        batch_interval_s: float = 0.02,
        context: zmq.Context | None = None,
        bind_host: str = LOOPBACK,
        curve: CurveServer | None = None,
        include_token_ids: bool = True,
    ) -> None:
        if hash_format not in ("int", "bytes"):
            raise ValueError(f"hash_format must be 'int' or 'bytes', got {hash_format!r}")
        if event_encoding not in ("array", "map"):
            raise ValueError(f"event_encoding must be 'array' or 'map', got {event_encoding!r}")
        self.buffer = buffer
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.snapshot_fn = snapshot_fn
        self.hash_format = hash_format
        self.event_encoding = event_encoding
        self.poll_interval_s = poll_interval_s
        self.batch_interval_s = batch_interval_s
        self.num_batches = 0  # batches published
        self.num_events_lost = 0  # events dropped by the buffer before this thread read them
        self.num_resyncs = 0
        self.last_event_id = -1  # newest buffer event this thread has handled
        self._replay_log: deque[tuple[int, bytes]] = deque(maxlen=replay_steps)
        self._seq = 0
        self.bind_host = bind_host
        self.curve = curve
        self.include_token_ids = include_token_ids
        own_context = context is None and curve is not None  # one ZAP handler per context
        self._own_ctx = zmq.Context() if own_context else None
        self._ctx = self._own_ctx or (context if context is not None else zmq.Context.instance())
        self._auth = curve.start_authenticator(self._ctx) if curve is not None else None
        self._pub = self._socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self.bound = self.binds(endpoint)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self.endpoint = self._attach(self._pub, self._on_host(endpoint), self.bound)
        except zmq.ZMQError as exc:  # a port in use, a malformed endpoint: say which one
            self._close_sockets()
            raise EndpointError(endpoint, exc, replay=False) from None
        if replay_endpoint is not None:
            self._replay = self._socket(zmq.ROUTER)
            try:
                self._replay.bind(self._on_host(replay_endpoint))
            except zmq.ZMQError as exc:
                self._close_sockets()
                raise EndpointError(replay_endpoint, exc, replay=True) from None
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)

    def start(self) -> ZmqEventPublisher:
        self._thread.start()
        return self

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest batch sent; -1 before the first."""
        return self._seq - 1

    @property
    def subscribable(self) -> bool:
        """Whether a subscriber can connect to ``endpoint`` now: the PUB socket bound it
        (``bound``) and ``close()`` has not run. The server's ``/v1/kvreuse/info`` reports it."""
        return self.bound and not self._pub.closed

    @property
    def leaves_host(self) -> bool:
        """Whether events (or replays) can reach another machine (``is_local`` of each endpoint)."""
        return not all(is_local(e) for e in (self.endpoint, self.replay_endpoint) if e is not None)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        """Close the sockets, stop the ZAP handler and end a private context."""
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx is not None:
            self._own_ctx.term()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if ":" in self.bind_host:  # an IPv6 bind_host
            sock.ipv6 = True
        if self.curve is not None:
            self.curve.secure(sock)
        return sock

    def _on_host(self, endpoint: str) -> str:
        """``endpoint`` with a ``*`` tcp host replaced by ``bind_host`` (kept for ``"*"``)."""
        if not endpoint.startswith("tcp://*:") or self.bind_host == "*":
            return endpoint
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"tcp://{host}:{endpoint.removeprefix('tcp://*:')}"

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        cursor = -1
        while not self._stop.is_set():
            try:
                cursor = self._publish_new(cursor)
            except Exception:  # logged: the publisher must outlive one bad batch
                logger.exception("KV event publisher: batch after event %d failed; retrying", cursor)
                self._stop.wait(0.1)

    def _publish_new(self, cursor: int) -> int:
        """Serve replay requests, then publish what followed ``cursor``; returns the new cursor."""
        if self._replay is not None and self._replay.poll(0):
            self._serve_replay()
        if not self.buffer.get_events(after_id=cursor, timeout=self.poll_interval_s, max_events=1):
            return cursor
        # Coalesce: let the engine run a few steps before taking the GIL again, so a
        # busy engine sees at most one publisher wake-up per batch_interval_s.
        self._stop.wait(self.batch_interval_s)
        events = self.buffer.get_events(after_id=cursor)
        if events[0].event_id > cursor + 1:
            self.num_events_lost += events[0].event_id - cursor - 1
            snapshot = self._snapshot()
            if snapshot is not None:
                self._send(snapshot_to_vllm_events(snapshot, self.hash_format), events[-1].timestamp)
                self.num_resyncs += 1
                self.last_event_id = snapshot.last_event_id
                return snapshot.last_event_id
            self._seq += 1  # leave a hole in the sequence: subscribers see the loss
        self._send(to_vllm_events(events, self.hash_format), events[-1].timestamp)
        self.last_event_id = events[-1].event_id
        return events[-1].event_id

    def _snapshot(self) -> KVSnapshot | None:
        if self.snapshot_fn is None:
            return None
        try:
            return self.snapshot_fn()
        except Exception:  # logged; e.g. the engine stopped: fall back to a sequence gap
            logger.warning("KV event publisher: snapshot for resync failed; leaving a sequence gap", exc_info=True)
            return None

    def _send(self, wire_events: list[dict], ts: float) -> None:
        if not wire_events:
            return
        if not self.include_token_ids:
            for event in wire_events:
                if event["type"] == "BlockStored":
                    event["token_ids"] = []
        payload = encode_batch(ts, wire_events, self.data_parallel_rank, self.event_encoding)
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq, payload))  # PUB drops at HWM, never blocks
        self._replay_log.append((self._seq, payload))
        self._seq += 1
        self.num_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not [identity, b"", start_seq]: ignore, as vLLM does
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._replay_log):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    @staticmethod
    def binds(endpoint: str) -> bool:
        """Whether the PUB socket binds ``endpoint`` (wildcard, ipc and inproc endpoints:
        vLLM's rule) rather than connecting to it."""
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
        """Bind or connect (``binds`` of the endpoint as given). Returns the endpoint actually
        bound (``tcp://127.0.0.1:*`` picks a free port), or ``endpoint`` when connecting."""
        if bind:
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint
