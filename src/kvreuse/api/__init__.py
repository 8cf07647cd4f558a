"""What the executor's server and the router share, so neither imports the other.

- ``protocol``: the OpenAI request bodies (pydantic) and ``usage_dict``.
- ``chat_prompt``: chat messages -> prompt token ids (and per-message retention ranges).
- ``errors``: OpenAI's error shape (``APIError``, ``error_body``, ``error_response``).
- ``probe``: the tokenizer probe an executor publishes and a router checks.
- ``connection``: noticing a client that disconnected.
- ``body``: a raw body -> JSON, or the 400 naming what is wrong with it.
- ``middleware``: the body-size limit, the API key and the tenant's in-flight slot, before any route runs.
- ``tenants``: API keys -> tenants, the tenant's salt, the admin-only routes.
- ``tenant_limits``: ``--tenant-limits FILE`` and the default flags -> ``TenantLimits``.
- ``limiter``: the per-tenant policy (in-flight slots, token buckets; an injected clock).
- ``limit_metrics``: its Prometheus view.
- ``access_log``: uvicorn with query strings (``?api_key=``) redacted in its access log.

Nothing here imports from ``kvreuse.server`` or ``kvreuse.router``.
"""
