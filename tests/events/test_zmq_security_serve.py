"""Issue 31, finding 4, on a real ``kvreuse serve``: with API keys and CURVE, a subscriber
without credentials receives nothing while one holding an allowed key decodes a tenant's
prompt; without CURVE, events bound beyond loopback under API keys get a start-up warning."""

from __future__ import annotations

import time

import httpx
import zmq
import zmq.auth

from kvreuse.events.decoder import BlockStored, decode_batch
from tests.serve_process import free_port, running_servers

BASE = [
    "--model",
    "tiny:llama",
    "--kv-cache-memory",
    "0.0002",
    "--max-model-len",
    "512",
    "--served-model-name",
    "tiny",
    "--api-key",
    "admin-key",
    "--api-key",
    "acme-key:acme",
    "--log-level",
    "warning",
]


def _received(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sock.poll(0):
        out.append(sock.recv_multipart())
    return out


def test_events_of_a_keyed_server_reach_only_allowed_subscribers(tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    zmq.auth.create_certificates(str(keys), "server")
    zmq.auth.create_certificates(str(keys), "router")
    (allowed / "router.key").write_bytes((keys / "router.key").read_bytes())
    sealed_pub, open_pub = free_port(), free_port()
    sealed = [
        *BASE,
        "--kv-events-endpoint",
        f"tcp://*:{sealed_pub}",
        "--kv-events-curve-secret-key",
        str(keys / "server.key_secret"),
        "--kv-events-curve-clients-dir",
        str(allowed),
    ]
    exposed = [*BASE, "--kv-events-endpoint", f"tcp://*:{open_pub}", "--kv-events-bind-host", "0.0.0.0"]
    logs = tmp_path / "sealed.log", tmp_path / "exposed.log"
    ctx = zmq.Context()
    with running_servers([(free_port(), sealed, logs[0]), (free_port(), exposed, logs[1])]) as (url, _):
        server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
        plain = ctx.socket(zmq.SUB)
        keyed = ctx.socket(zmq.SUB)
        keyed.curve_publickey, keyed.curve_secretkey = zmq.auth.load_certificate(str(keys / "router.key_secret"))
        keyed.curve_serverkey = server_public
        for sock in (plain, keyed):
            sock.linger = 0
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{sealed_pub}")
        try:
            got, prompts, deadline = [], [], time.monotonic() + 60
            while not got:  # PUB drops until the handshake completes: ask until the keyed one hears
                assert time.monotonic() < deadline, "the allowed subscriber received nothing"
                prompt = [(len(prompts) * 97 + i * 13) % 1500 + 100 for i in range(40)]
                prompts.append(prompt)
                r = httpx.post(
                    f"{url}/v1/completions",
                    headers={"Authorization": "Bearer acme-key"},
                    timeout=60,
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                )
                assert r.status_code == 200, r.text
                time.sleep(0.3)
                got = _received(keyed)
            time.sleep(0.5)
            got += _received(keyed)
            assert _received(plain) == []
            stored = [e for _, _, p in got for e in decode_batch(p).events if isinstance(e, BlockStored)]
            heard = [t for e in stored for t in e.token_ids]
            assert heard == prompts[-1][: len(heard)] and len(heard) >= 16  # acme's prompt, to the key holder only
        finally:
            ctx.destroy(linger=0)
    sealed_log, exposed_log = logs[0].read_text(), logs[1].read_text()
    assert f"kvreuse: KV events bound on tcp://127.0.0.1:{sealed_pub}, CURVE" in sealed_log
    assert "kvreuse: warning: KV events" not in sealed_log
    assert (
        f"kvreuse: warning: KV events on tcp://0.0.0.0:{open_pub} can leave this host unencrypted and "
        "unauthenticated while --api-key is set: any subscriber there reads every tenant's token ids."
    ) in " ".join(exposed_log.split())
