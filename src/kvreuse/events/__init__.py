"""KV cache events: the records the pool emits (``records``, the one vocabulary every
producer and consumer speaks), the bounded numbered buffer (``buffer``), vLLM's wire schema
(``wire``), the vLLM-compatible ZMQ publisher (``publisher``) and the wire decoder into
records (``decoder``). Events flow out only: pool -> buffer -> publisher -> router index."""
