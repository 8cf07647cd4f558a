"""``GET /dashboard`` (one self-contained page) and ``GET /v1/kv_cache_stats`` (what it polls)."""

from __future__ import annotations

import re

from .fresh_app import fresh_client

PROMPT = [(i * 31) % 2000 + 100 for i in range(40)]  # 2 full blocks of 16 + 8 tokens


def test_dashboard_is_one_self_contained_page(client):
    r = client.get("/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    for endpoint in ("/v1/kv_cache_stats", "/v1/kv_cache_events/stream"):
        assert endpoint in page
    assert "--event-buffer-max-size" in page  # what to do when events are off
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)  # nothing fetched from elsewhere
    assert "api_key" in page and "Authorization" in page


def test_stats_without_events_says_they_are_off(client):
    r = client.get("/v1/kv_cache_stats")
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["events"] == {"enabled": False}
    assert s["num_free_blocks"] + s["num_cached_blocks"] + s["num_used_blocks"] == s["num_blocks"]


def test_stats_are_exact_after_known_requests(tiny_llama):
    with fresh_client(tiny_llama, event_buffer_max_size=1000, api_key="k") as (client, engine):
        auth = {"Authorization": "Bearer k"}
        assert client.get("/dashboard").status_code == 200  # the page is open; its data is not
        assert client.get("/v1/kv_cache_stats").status_code == 401
        total = engine.engine.pool.num_blocks
        before = client.get("/v1/kv_cache_stats", headers=auth).json()
        assert before["num_free_blocks"] == total and before["blocks_by_priority"] == {}
        assert before["events"] == {
            "enabled": True,
            "max_size": 1000,
            "num_events": 1,
            "first_event_id": 0,
            "last_event_id": 0,
            "num_dropped": 0,
        }  # the "created" event

        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
        s = client.get("/v1/kv_cache_stats", headers=auth).json()
        # 40 prompt tokens: 2 full blocks registered and cached, the partial third freed.
        assert (s["num_free_blocks"], s["num_cached_blocks"], s["num_used_blocks"]) == (total - 2, 2, 0)
        assert s["blocks_by_priority"] == {"35": 2} and s["evictions_by_priority"] == {}
        assert s["prefix_cache"] == {"queries_tokens": 40, "hits_tokens": 0, "hit_rate": 0.0}
        assert s["tokens_computed"] == 40 and s["num_running"] == s["num_waiting"] == 0
        assert s["events"]["last_event_id"] == 2  # one "stored" event per registered block

        assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
        s = client.get("/v1/kv_cache_stats", headers=auth).json()
        # The same prompt again: both full blocks hit (the last token's block is always computed).
        assert s["prefix_cache"] == {"queries_tokens": 80, "hits_tokens": 32, "hit_rate": 0.4}
        assert s["tokens_computed"] == 40 + 8 and s["num_cached_blocks"] == 2


def test_stats_show_the_tiers_with_exact_counts(tiny_llama):
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.0002, host_cache_memory_gib=0.002) as (client, engine):
        blocks = engine.engine.pool.num_blocks
        assert client.get("/v1/kv_cache_stats").json()["tiers"]["host"]["offloaded_blocks"] == 0
        n = 16 * (blocks - 1)  # each prompt fills all but one device block (16-token blocks)
        a = [(i * 31) % 2000 + 100 for i in range(n)]
        b = [(i * 17) % 2000 + 100 for i in range(n)]
        for prompt in (a, b, a):  # b pushes a's blocks down to the host; a comes back up
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
        # b needed all but one cached block of a: a's first block stayed on the device
        details = r.json()["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == n - 16  # every block but the one holding the last token
        assert details["cached_tokens_by_tier"] == {"device": 16, "host": n - 32, "disk": 0, "remote": 0, "object": 0}
        tiers = client.get("/v1/kv_cache_stats").json()["tiers"]
        assert tiers["hits_tokens"] == {"device": 16, "host": n - 32}
        host = tiers["host"]
        assert host["onboarded_blocks"] == blocks - 3 and host["offloaded_blocks"] >= blocks - 3
        assert sum(host["blocks_by_priority"].values()) == host["num_cached_blocks"]
        assert 'id="hostheld"' in client.get("/dashboard").text


def test_the_event_panel_recovers_after_a_reset(client, tmp_path):
    # The page's own frame handler (between its frame:begin/end markers), run in node on the
    # frames a restarted server sends: the reset is not parsed as an event, and the cursor
    # moves to the reset's last_event_id (before: ?after=undefined, a 400 forever).
    import json
    import shutil
    import subprocess

    import pytest

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    page = client.get("/dashboard").text
    source = page[page.index("// frame:begin") : page.index("// frame:end")]
    frames = [
        'id: 7\nevent: kv_event\ndata: {"event_id": 7, "data": {"type": "stored"}}',
        'event: reset\ndata: {"last_event_id": 2, "after": 7, "reason": "event ids went back"}',
        ": keepalive",
        'id: 1\nevent: kv_event\ndata: {"event_id": 1, "data": {"type": "created"}}',
        'event: other\ndata: {"x": 1}',
    ]
    script = (
        source
        + f"""
const seen = [], cursors = [];
let last = 5;
for (const f of {json.dumps(frames)}) {{
  last = applyFrame(f, last, (ev) => seen.push(ev.event_id), (r) => seen.push("reset@" + r.last_event_id));
  cursors.push(last);
}}
console.log(JSON.stringify({{seen, cursors}}));
"""
    )
    (tmp_path / "frames.js").write_text(script)
    out = subprocess.run([node, str(tmp_path / "frames.js")], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == {"seen": [7, "reset@2", 1], "cursors": [7, 2, 2, 1, 1]}
