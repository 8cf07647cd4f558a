"""uvicorn for the executor and the router, with query strings redacted in the access log.

An API key may travel in a URL (the dashboard's ``?api_key=KEY``); uvicorn's access log
writes every request's path with its query. ``RedactQuery`` keeps each parameter's name and
replaces its value with ``***`` (``GET /dashboard?api_key=***``), so no key reaches a log.
"""

from __future__ import annotations

import logging
from typing import Any

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "***"


def redact_path(path: str) -> str:
    """``path`` with every query value replaced by ``***`` (a part without ``=`` is all
    value); a path without a query is unchanged."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = (f"{p.split('=', 1)[0]}={REDACTED}" if "=" in p else REDACTED for p in query.split("&"))
    return f"{base}?" + "&".join(parts)


class RedactQuery(logging.Filter):
    """Rewrites the path of uvicorn's access records (``args``: client, method, path,
    HTTP version, status); other records pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_path(args[2]), *args[3:])
        return True


def uvicorn_server(app: Any, *, host: str, port: int, log_level: str) -> Any:
    """A ``uvicorn.Server`` for ``app`` whose access log redacts query strings. Building the
    config sets up uvicorn's logging, so the filter is added after it; ``.run()`` serves."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuery) for f in access.filters):
        access.addFilter(RedactQuery())
    return uvicorn.Server(config)
