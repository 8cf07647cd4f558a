"""Thread-safe event counters for a store, and a warning that is logged once per failure streak.

A store that fails (full disk, Redis down) fails on every call; logging each one would bury
the log. ``FailureStreak`` logs the first failure of a streak at WARNING, the rest at DEBUG,
and one INFO line when the store works again. The counters count every failure.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter


class StoreCounters:
    """Named monotonic counts; ``snapshot()`` copies them under the lock."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in names})

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``name``; raises ``KeyError`` for a name not declared (a typo, not data)."""
        with self._lock:
            if name not in self._counts:
                raise KeyError(name)
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class FailureStreak:
    """Log the first failure of a streak loudly, the recovery once."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._lock = threading.Lock()
        self._failing = False

    def failed(self, message: str, *args) -> None:
        with self._lock:
            first, self._failing = not self._failing, True
        level = logging.WARNING if first else logging.DEBUG
        self._logger.log(level, f"{self._what}: {message}", *args)

    def succeeded(self) -> None:
        if not self._failing:  # unlocked fast path: the common case
            return
        with self._lock:
            recovered, self._failing = self._failing, False
        if recovered:
            self._logger.info("%s: working again", self._what)
