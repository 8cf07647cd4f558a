"""``BlockHash``: the key of one full KV block, the value type every layer shares.

Its own bottom module (it imports nothing of kvreuse), so the cache that computes keys
(``cache/hashing.py``) and the events that carry them (``events/``) both depend on it and not
on each other.
"""

from __future__ import annotations

from typing import NewType

__all__ = ["BlockHash"]

BlockHash = NewType("BlockHash", bytes)
"""Key of one full block: 32 bytes (sha256) or 8 bytes (xxh3_64)."""
