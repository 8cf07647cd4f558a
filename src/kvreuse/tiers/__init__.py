"""Lower cache levels below the device pool: the block codec and the disk and Redis stores.

Edge components only (IO, files, sockets); nothing here touches the engine or the pool.
See docs/tiers.md.
"""

from kvreuse.tiers.block_codec import BlockRecord, CorruptBlock, ForeignBlock, decode_block, encode_block
from kvreuse.tiers.namespace import TierNamespace

__all__ = ["BlockRecord", "CorruptBlock", "ForeignBlock", "TierNamespace", "decode_block", "encode_block"]
