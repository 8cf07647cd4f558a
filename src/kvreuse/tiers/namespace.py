"""The identity a stored block belongs to: which model wrote it and how its key was made.

Two executors may share a disk directory or a Redis database only for blocks whose
``TierNamespace`` is equal: same model fingerprint (weights + config, ``ModelBundle.fingerprint``),
same block-key algorithm and same block size. Anything else would read another model's KV
under a key that merely looks alike. The tenant salt needs no place here: it is folded into
the chain (``hashing.root_extra_keys``), so salted keys already differ.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from kvreuse.cache.hashing import HASH_ALGORITHMS

FORMAT_VERSION = 1
"""Bumped when the stored layout changes; part of the tag, so old entries are simply foreign."""

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class TierNamespace:
    """Model identity and hash settings; validated when built."""

    model_fingerprint: str  # full hex fingerprint of the model's weights and config
    hash_algorithm: str  # "sha256" or "xxh3_64" (--prefix-hash-algorithm)
    block_size: int  # tokens per block (--block-size)

    def __post_init__(self) -> None:
        if not self.model_fingerprint or not _HEX.fullmatch(self.model_fingerprint):
            raise ValueError(f"model_fingerprint must be lowercase hex, got {self.model_fingerprint!r}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {self.hash_algorithm!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def tag(self) -> str:
        """16 hex digits naming this namespace in file paths and Redis keys."""
        text = f"kvreuse-tier-v{FORMAT_VERSION}|{self.model_fingerprint}|{self.hash_algorithm}|{self.block_size}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]
