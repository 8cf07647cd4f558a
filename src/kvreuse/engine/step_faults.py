"""Test-only fault injection: a step failure attributable to one request.

``EngineConfig.debug_step_faults`` (``kvreuse serve --debug-step-fault STAGE:PREFIX[@N]``,
repeatable) makes the engine step raise ``InjectedFault`` for every request whose id starts with
PREFIX, once it has produced ``N`` tokens (default 0: from its first step):

- ``forward``: the forward of any batch that holds the request's chunk raises, *after*
  ``ModelRunner.execute`` wrote the batch's KV (so the retry of the others, split off it,
  rewrites slots a failed forward touched: ``engine/forward_isolation.py``);
- ``sample``: the request's post-processing (sampling, stops, detokenising) raises
  (``engine/output_processor.py``).

Over HTTP the id is the body's ``request_id`` followed by ``-<choice>``; ``@N`` with N >= 1
makes a stream fail mid-way, after its first chunks were sent. For tests and
``bench/hardening/campaign.py`` only: it is off unless the flag is given, and a server that
serves clients must never be started with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STAGES = ("forward", "sample")

Mark = tuple[str, int]  # (request id prefix, output tokens from which it fails)


class InjectedFault(RuntimeError):
    """The failure ``--debug-step-fault`` asked for (never raised without it)."""


@dataclass(frozen=True)
class StepFaults:
    """Marked requests whose forward / post-processing fails (empty: no fault, no cost)."""

    forward: tuple[Mark, ...] = ()
    sample: tuple[Mark, ...] = ()

    @classmethod
    def parse(cls, specs: Iterable[str]) -> StepFaults:
        """``STAGE:PREFIX[@N]`` strings (``forward:fault-``, ``sample:cut-@20``). Raises
        ``ValueError`` naming the flag."""
        by_stage: dict[str, list[Mark]] = {stage: [] for stage in STAGES}
        for spec in specs:
            stage, sep, prefix = str(spec).partition(":")
            head, at, count = prefix.rpartition("@")
            prefix, after = (head, int(count)) if at and count.isdigit() else (prefix, 0)
            if not sep or stage not in by_stage or not prefix:
                raise ValueError(
                    f"--debug-step-fault must be STAGE:REQUEST_ID_PREFIX[@N] with STAGE one of "
                    f"{', '.join(STAGES)} and a non-empty prefix, got {spec!r}"
                )
            by_stage[stage].append((prefix, after))
        return cls(tuple(by_stage["forward"]), tuple(by_stage["sample"]))

    def __bool__(self) -> bool:
        return bool(self.forward or self.sample)

    def check_forward(self, requests: Iterable[tuple[str, int]]) -> None:
        """Raise ``InjectedFault`` if one of ``requests`` (a batch's ``(request id, output
        tokens so far)``) is marked ``forward``."""
        if self.forward:
            for request_id, produced in requests:
                if _marked(self.forward, request_id, produced):
                    raise InjectedFault(f"injected forward fault (request {request_id})")

    def check_sample(self, request_id: str, produced: int) -> None:
        """Raise ``InjectedFault`` if ``request_id``, with ``produced`` output tokens, is marked ``sample``."""
        if self.sample and _marked(self.sample, request_id, produced):
            raise InjectedFault(f"injected post-processing fault (request {request_id})")


def _marked(marks: tuple[Mark, ...], request_id: str, produced: int) -> bool:
    return any(request_id.startswith(prefix) and produced >= after for prefix, after in marks)
