"""The tenant seal covers telemetry: tenant names on ``/metrics`` only for an admin key (or
``--metrics-tenant-labels``), ``/docs`` and ``/redoc`` answer as ``/openapi.json`` does, and a
CURVE publisher is not advertised to routers as open for subscription."""

from __future__ import annotations

import pytest
import zmq
import zmq.auth
from fastapi.testclient import TestClient

from kvreuse.api.limiter import LimitExceeded, TenantLimiter
from kvreuse.api.tenant_limits import Limits, TenantLimits

KEYS = ["admin-key", "acme-key:acme", "globex-key:globex"]
ADMIN, ACME = {"Authorization": "Bearer admin-key"}, {"Authorization": "Bearer acme-key"}


def _limiter() -> TenantLimiter:
    """acme: 2 in flight (a third refused) and 50 tokens charged; globex: 1 in flight."""
    limiter = TenantLimiter(
        TenantLimits(default=Limits(max_in_flight=2), tenants={"acme": Limits(max_in_flight=2, tokens_per_minute=1000)})
    )
    done = limiter.open("acme")
    done.reserve(30, 20)
    done.close()
    limiter.open("acme"), limiter.open("acme"), limiter.open("globex")
    with pytest.raises(LimitExceeded):
        limiter.open("acme")
    return limiter


def _tenant_lines(client: TestClient, headers: dict | None = None) -> list[str]:
    text = client.get("/metrics", headers=headers or {}).text
    return [line for line in text.splitlines() if line.startswith("kvreuse:tenant_")]


NAMED = [
    'kvreuse:tenant_requests_refused_total{reason="max_in_flight",tenant="acme"} 1.0',
    'kvreuse:tenant_requests_in_flight{tenant="acme"} 2.0',
    'kvreuse:tenant_requests_in_flight{tenant="globex"} 1.0',
    'kvreuse:tenant_tokens_charged_total{tenant="acme"} 50.0',
]
SUMMED = [
    'kvreuse:tenant_requests_refused_total{reason="max_in_flight",tenant="(all)"} 1.0',
    'kvreuse:tenant_requests_in_flight{tenant="(all)"} 3.0',
    'kvreuse:tenant_tokens_charged_total{tenant="(all)"} 50.0',
]


def test_metrics_name_tenants_only_to_an_admin_key(async_engine):
    from kvreuse.server.api_server import build_app

    with TestClient(build_app(async_engine, api_key=KEYS, served_model_name="tiny", limiter=_limiter())) as c:
        assert _tenant_lines(c, ADMIN) == NAMED
        for headers in (None, ACME, {"Authorization": "Bearer wrong"}):  # no key, a tenant's, a bad one
            assert _tenant_lines(c, headers) == SUMMED
            text = c.get("/metrics", headers=headers or {}).text
            assert "acme" not in text and "globex" not in text
            assert "kvreuse:num_blocks_total" in text  # the rest stays open for scrapers


def test_metrics_tenant_labels_opt_in_names_them_to_everyone(async_engine):
    from kvreuse.server.api_server import build_app

    app = build_app(
        async_engine, api_key=KEYS, served_model_name="tiny", limiter=_limiter(), metrics_tenant_labels=True
    )
    with TestClient(app) as c:
        assert _tenant_lines(c) == NAMED


def test_docs_and_redoc_answer_as_the_api_description_does(async_engine):
    from kvreuse.server.api_server import build_app

    with TestClient(build_app(async_engine, api_key=KEYS, served_model_name="tiny")) as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            r = c.get(path)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key"), path
            assert c.get(path, headers=ACME).status_code == 200, path
            assert c.get(path, headers=ADMIN).status_code == 200, path
        page = c.get("/docs", headers=ADMIN)
        assert page.headers["content-type"].startswith("text/html")
        assert "SwaggerUIBundle({spec: {" in page.text and '"/v1/completions"' in page.text
        assert 'Redoc.init({"openapi": ' in c.get("/redoc", headers=ADMIN).text
    with TestClient(build_app(async_engine, served_model_name="tiny")) as c:  # no keys: all open
        assert [c.get(p).status_code for p in ("/openapi.json", "/docs", "/redoc")] == [200, 200, 200]
        assert "/docs" not in c.get("/openapi.json").json()["paths"]


def test_a_curve_publisher_is_not_advertised_as_open_to_subscribers(async_engine, tmp_path):
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.events.curve import CurveServer
    from kvreuse.events.publisher import ZmqEventPublisher
    from kvreuse.server.api_server import build_app

    for name in ("server", "router"):
        zmq.auth.create_certificates(str(tmp_path), name)
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "router.key").write_bytes((tmp_path / "router.key").read_bytes())
    curve = CurveServer.load(str(tmp_path / "server.key_secret"), str(tmp_path / "allowed"))
    buffer = EventBuffer(10)
    plain = ZmqEventPublisher(buffer, "tcp://127.0.0.1:*", context=zmq.Context())
    sealed = ZmqEventPublisher(buffer, "tcp://127.0.0.1:*", curve=curve)
    try:
        for publisher, bound in ((plain, True), (sealed, False)):
            with TestClient(build_app(async_engine, served_model_name="tiny", publisher=publisher)) as c:
                events = c.get("/v1/kvreuse/info").json()["events"]
                assert (events["zmq_endpoint"], events["zmq_bound"]) == (publisher.endpoint, bound)
    finally:
        plain.close()
        sealed.close()
