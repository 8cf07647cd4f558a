"""What the executor's server and the router share, so neither imports the other.

- ``protocol``: the OpenAI request bodies (pydantic) and ``usage_dict``.
- ``chat_prompt``: chat messages -> prompt token ids (and per-message retention ranges).
- ``errors``: OpenAI's error shape (``APIError``, ``error_body``, ``error_response``).
- ``probe``: the tokenizer probe an executor publishes and a router checks.
- ``connection``: noticing a client that disconnected.
- ``body``: a raw body -> JSON, or the 400 naming what is wrong with it.
- ``middleware``: the body-size limit and the API key, before any route runs.
- ``access_log``: uvicorn with query strings (``?api_key=``) redacted in its access log.

Nothing here imports from ``kvreuse.server`` or ``kvreuse.router``.
"""
