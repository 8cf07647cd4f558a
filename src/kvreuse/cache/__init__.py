"""The KV cache: blocks, the pool, eviction policies, retention, the one block-hash chain and
per-request admission. Nothing here touches a tensor or does IO, so the router and the
simulator import it without torch."""
