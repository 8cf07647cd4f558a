"""KV cache events: the records the pool emits (``records``), the bounded numbered buffer
(``buffer``), the vLLM-compatible ZMQ publisher (``publisher``) and the wire decoder
(``decoder``). Events flow out only: pool -> buffer -> publisher -> router index."""
