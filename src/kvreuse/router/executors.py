"""The executors behind a router: what each one is (``ExecutorInfo``, from its
``GET /v1/kvreuse/info``) and how it is doing (``Executor``: health and load).

Executors can share a router only when their block keys agree: same model identity
(``model_id`` hashes weights, config, tokenizer and dtype), block size and hash algorithm.
``check_compatible`` refuses anything else with a message naming every executor's values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreuse.router.prompt_keys import HashSettings


class IncompatibleExecutors(ValueError):
    """Executors whose block keys would not agree (different model or hash settings)."""


class ExecutorAuthError(ValueError):
    """An executor answered 401 to the router's own calls: the key given with
    ``--executor-api-key`` is missing or wrong."""


@dataclass(frozen=True)
class ExecutorInfo:
    url: str
    model: str  # served model name (what clients put in "model")
    model_name: str  # the loaded model's name (a --model spec the router can load)
    model_id: str
    block_size: int
    hash_algorithm: str
    tokenizer_path: str | None
    max_model_len: int
    events: dict[str, Any]  # {"http": bool, "zmq_endpoint": str | None, "zmq_bound": bool, ...}
    tokenizer_probe: dict[str, Any]
    instance_id: str | None = None  # one per executor process: a new one means it restarted
    remote_store: str | None = None  # identity of the remote store it shares (None: none, or an older executor)
    num_blocks: int = 0  # its device KV pool, in blocks (0: not reported)
    eos_token_ids: tuple[int, ...] | None = None  # what ends its requests (None: not reported)
    object_store: str | None = None  # identity of the S3 bucket and prefix it shares (None: none, or older)

    @classmethod
    def from_json(cls, url: str, d: dict) -> ExecutorInfo:
        """Raises ``ValueError`` naming the field when the info is incomplete."""
        try:
            return cls(
                url,
                d["model"],
                d.get("model_name") or d["model"],
                d["model_id"],
                int(d["block_size"]),
                d["hash_algorithm"],
                d.get("tokenizer_path"),
                int(d.get("max_model_len") or 0),
                dict(d.get("events") or {}),
                dict(d.get("tokenizer_probe") or {}),
                d.get("instance_id"),
                d.get("remote_store"),
                int(d.get("num_blocks") or 0),
                None if d.get("eos_token_ids") is None else tuple(int(t) for t in d["eos_token_ids"]),
                object_store=d.get("object_store"),
            )
        except KeyError as exc:
            raise ValueError(f"{url}/v1/kvreuse/info lacks {exc.args[0]!r}: is it a kvreuse executor?") from None

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def settings(self) -> HashSettings:
        return HashSettings(self.model_id, self.block_size, self.hash_algorithm)

    @property
    def zmq_endpoint(self) -> str | None:
        """The ZMQ PUB endpoint to subscribe to, or ``None`` (follow SSE instead). Only a
        publisher that *bound* its socket can be subscribed to: one that connects sends to
        whoever bound that address, and a router connecting there too would hear nothing.
        An executor that does not say (``zmq_bound`` absent) is followed over SSE."""
        endpoint = self.events.get("zmq_endpoint")
        return endpoint if endpoint and self.events.get("zmq_bound") is True else None


def check_compatible(infos: Sequence[ExecutorInfo]) -> HashSettings:
    """The shared hash settings. Raises ``IncompatibleExecutors`` if they differ."""
    if not infos:
        raise IncompatibleExecutors("no executor answered GET /v1/kvreuse/info")
    settings = {info.settings for info in infos}
    if len(settings) == 1:
        return infos[0].settings
    lines = "\n".join(
        f"  {i.url}: model {i.model_name!r} (model_id {i.model_id}), block_size {i.block_size}, hash {i.hash_algorithm}"
        for i in infos
    )
    raise IncompatibleExecutors(
        "executors disagree on model identity or hash settings, so their KV block keys cannot be "
        f"compared; run one router per model/settings:\n{lines}"
    )


_GAUGE = re.compile(r"^(kvreuse:num_blocks_used|kvreuse:num_requests_waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def parse_load_metrics(text: str) -> dict[str, float]:
    """``kvreuse:num_blocks_used`` and ``kvreuse:num_requests_waiting`` from a Prometheus page
    (missing ones are left out)."""
    return {m.group(1).split(":", 1)[1]: float(m.group(2)) for m in _GAUGE.finditer(text)}


@dataclass
class Executor:
    """One executor's state as the router sees it. Event-loop only."""

    url: str
    info: ExecutorInfo | None = None
    healthy: bool = False
    # its place in the router's --executor list (``Router`` sets it): what a client, a tenant or
    # a scraper is told instead of the URL (``label``); None outside a router
    id: int | None = None
    in_flight: int = 0  # requests the router has sent and not finished
    in_flight_blocks: int = 0  # their prompt blocks
    remote: dict[str, float] = field(default_factory=dict)  # last /metrics load gauges
    requests_routed: int = 0
    failures: int = 0  # requests that failed before their first byte here
    last_error: str | None = None
    # when a byte of any of its streams last came (time.monotonic()): a stream that stalls
    # while others still get bytes is waiting there (queued, preempted), not on a hung executor
    last_byte_at: float = field(default=0.0, repr=False, compare=False)
    # called when it is marked down: the reads waiting on it (kvreuse.router.deadline.within)
    on_down: set[Callable[[], None]] = field(default_factory=set, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.url

    @property
    def label(self) -> str:
        """What messages to clients call it ("executor 1"): never its address, which only
        admin routes and the router's own log name."""
        return "an executor" if self.id is None else f"executor {self.id}"

    def scrub(self, text: str) -> str:
        """``text`` (a reason it was marked down, say) with its address, and the host:port
        part of it, replaced by ``label``: fit to tell a client."""
        netloc = re.escape(self.url.split("://", 1)[-1].rstrip("/"))
        return re.sub(rf"(?<![\w.-]){netloc}(?![\w.-])", self.label, text.replace(self.url, self.label))

    @property
    def load_blocks(self) -> float:
        """Active blocks: the router's own count, or the executor's if larger (other
        clients), plus a prompt's worth per queued request."""
        used = self.remote.get("num_blocks_used", 0.0)
        waiting = self.remote.get("num_requests_waiting", 0.0)
        per_request = self.in_flight_blocks / self.in_flight if self.in_flight else 0.0
        return max(float(self.in_flight_blocks), used + waiting * per_request)

    def begin(self, blocks: int) -> None:
        self.in_flight += 1
        self.in_flight_blocks += blocks
        self.requests_routed += 1

    def end(self, blocks: int) -> None:
        self.in_flight -= 1
        self.in_flight_blocks -= blocks

    def mark_down(self, reason: str) -> None:
        """Take it out of routing; every ``on_down`` callback runs (the reads waiting on it
        then end unless a byte comes within their grace)."""
        self.healthy = False
        self.last_error = reason
        for callback in list(self.on_down):
            callback()

    def status(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "in_flight_blocks": self.in_flight_blocks,
            "load_blocks": self.load_blocks,
            "requests_routed": self.requests_routed,
            "failures": self.failures,
            "last_error": self.last_error,
            "model_id": None if self.info is None else self.info.model_id,
            "instance_id": None if self.info is None else self.info.instance_id,
        }
