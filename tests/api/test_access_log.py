"""Query strings are redacted in uvicorn's access log (``kvreuse.api.access_log``), for the
executor and the router alike (both serve through ``uvicorn_server``)."""

from __future__ import annotations

import logging

from kvreuse.api.access_log import ACCESS_LOGGER, RedactQuery, redact_path, uvicorn_server


def test_every_query_value_is_redacted_and_names_are_kept():
    assert redact_path("/dashboard?api_key=s3cret") == "/dashboard?api_key=***"
    assert (
        redact_path("/v1/kv_cache_events/stream?after=5&api_key=k")
        == "/v1/kv_cache_events/stream?after=***&api_key=***"
    )
    assert redact_path("/dashboard?s3cret") == "/dashboard?***"
    assert redact_path("/health") == "/health"


def test_the_filter_rewrites_uvicorns_access_records():
    record = logging.LogRecord(
        ACCESS_LOGGER,
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/dashboard?api_key=s3cret", "1.1", 200),
        None,
    )
    assert RedactQuery().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /dashboard?api_key=*** HTTP/1.1" 200'


def test_uvicorn_server_installs_the_filter_once():
    from fastapi import FastAPI

    for _ in range(2):
        uvicorn_server(FastAPI(), host="127.0.0.1", port=0, log_level="warning")
    assert sum(isinstance(f, RedactQuery) for f in logging.getLogger(ACCESS_LOGGER).filters) == 1
