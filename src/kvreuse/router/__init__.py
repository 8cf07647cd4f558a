"""The KV-aware router: a separate process in front of N executors (SPEC section 5).

::

    client ─▶ RouterApp ─▶ PromptHasher (tokenizer + kvreuse.cache.hashing) ─▶ block keys
                  │                                                        │
                  │           KVIndex (key -> executors, per level) ◀──────┘ overlaps
                  │               ▲ events (ZMQ or SSE), snapshots
                  ▼               │
             RoutingPolicy ─▶ choice ─▶ httpx proxy ─▶ executor (kvreuse serve)

``docs/router.md`` has the design and the consistency model.
"""
