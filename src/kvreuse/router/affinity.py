"""``prompt_cache_key`` affinity: requests sharing a key prefer one executor while it is not overloaded.

OpenAI's clients send ``prompt_cache_key`` to say "these requests share a prefix" (one agent,
one conversation) before any of it is cached. The router remembers which executor a key's last
request went to and sends the next one there, unless that executor's load is more than
``slack`` blocks above the least-loaded candidate's, where ``slack`` is what recomputing the
prompt elsewhere costs (its blocks, at least ``MIN_SLACK_BLOCKS``): the same trade the KV
policy makes between overlap and load. Otherwise, or when the key is new or its executor is
down, the policy's choice stands and becomes the key's. Keys are remembered LRU, at most
``max_keys``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvreuse.router.policy import Candidate, Decision

MIN_SLACK_BLOCKS = 16  # a short prompt's key still holds through small load differences
MAX_KEYS = 100_000
MAX_KEY_CHARS = 1024  # OpenAI's limit on prompt_cache_key


def prompt_cache_key(body: object) -> str | None:
    """The body's ``prompt_cache_key`` when it is a non-empty string of at most
    ``MAX_KEY_CHARS`` (the executor refuses anything else with a 400), else ``None``."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    return key if isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS else None


class Affinity:
    """Key -> the executor its requests go to. Not thread-safe: the router's event loop only."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._owner: OrderedDict[str, str] = OrderedDict()
        self.kept = 0  # decisions where the key's executor overrode the policy's choice
        self.moved = 0  # decisions where the key's executor was too loaded (or gone) and the key moved

    def owner(self, key: str) -> str | None:
        return self._owner.get(key)

    def apply(
        self, key: str, candidates: Sequence[Candidate], decision: Decision, *, dry_run: bool = False
    ) -> Decision:
        """``decision`` (the policy's, over ``candidates``), or the key's executor in its place
        while that one is a candidate within the slack. ``dry_run`` remembers nothing."""
        owner = self._owner.get(key)
        by_name = {c.name: c for c in candidates}
        choice = decision.choice
        if owner is not None and owner in by_name and owner != choice:
            least = min(c.load_blocks for c in candidates)
            mine = by_name[owner]
            if mine.load_blocks <= least + max(MIN_SLACK_BLOCKS, mine.prompt_blocks):
                choice = owner
                self.kept += 0 if dry_run else 1
            else:
                self.moved += 0 if dry_run else 1
        if not dry_run:
            self._owner[key] = choice
            self._owner.move_to_end(key)
            while len(self._owner) > self.max_keys:
                self._owner.popitem(last=False)
        return decision if choice == decision.choice else Decision(choice, decision.scores)
