"""What the executor's server and the router share, so neither imports the other.

- ``protocol``: the OpenAI request bodies (pydantic) and ``usage_dict``.
- ``chat_prompt``: chat messages -> prompt token ids (and per-message retention ranges).
- ``errors``: OpenAI's error shape (``APIError``, ``error_body``, ``error_response``).
- ``probe``: the tokenizer probe an executor publishes and a router checks.
- ``connection``: noticing a client that disconnected.

Nothing here imports from ``kvreuse.server`` or ``kvreuse.router``.
"""
