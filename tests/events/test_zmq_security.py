"""The KV-event sockets inside the tenant seal: loopback unless asked otherwise, CURVE that
admits only the allowed subscribers' keys, and token ids left out on request."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
import zmq.auth

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.curve import CurveServer
from kvreuse.events.decoder import BlockStored, decode_batch
from kvreuse.events.publisher import ZmqEventPublisher, is_local

BS = 4


def _store(pool: BlockPool, first: int) -> list[int]:
    """Register one 2-block chain of fresh tokens (a BlockStored on the wire); its tokens."""
    tokens = list(range(first, first + 2 * BS))
    hashes = hash_token_blocks(tokens, BS, model_id="m")
    blocks = pool.allocate(2)
    for i, b in enumerate(blocks):
        pool.register(b, hashes[i], hashes[i - 1] if i else None, tokens[i * BS : (i + 1) * BS], depth=i)
    pool.release(reversed(blocks))
    return tokens


def _sub(
    ctx: zmq.Context, endpoint: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None
) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _received(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sock.poll(0):
        out.append(sock.recv_multipart())
    return out


@pytest.fixture
def keys(tmp_path):
    """A server key pair, an allowed subscriber ("router") and one not allowed ("intruder")."""
    for name, folder in (("server", "server"), ("router", "router"), ("intruder", "intruder")):
        (tmp_path / folder).mkdir()
        zmq.auth.create_certificates(str(tmp_path / folder), name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "router.key").write_bytes((tmp_path / "router" / "router.key").read_bytes())
    load = zmq.auth.load_certificate
    return {
        "curve": CurveServer.load(str(tmp_path / "server" / "server.key_secret"), str(allowed)),
        "router": load(str(tmp_path / "router" / "router.key_secret")),
        "intruder": load(str(tmp_path / "intruder" / "intruder.key_secret")),
        "server_public": str(tmp_path / "server" / "server.key"),
    }


def test_curve_events_reach_only_an_allowed_subscriber(keys):
    buf = EventBuffer(10_000)
    pool = BlockPool(64, BS, events=buf)
    curve: CurveServer = keys["curve"]
    pub = ZmqEventPublisher(buf, "tcp://127.0.0.1:*", curve=curve, batch_interval_s=0.0).start()
    ctx = zmq.Context()
    try:
        plain = _sub(ctx, pub.endpoint)  # no credentials at all
        intruder = _sub(ctx, pub.endpoint, keys["intruder"], curve.public_key)  # valid keys, not allowed
        allowed = _sub(ctx, pub.endpoint, keys["router"], curve.public_key)
        sent, got, first = [], [], 1000
        deadline = time.monotonic() + 20
        while not got:  # PUB drops until the handshake completes: publish until the allowed one hears
            assert time.monotonic() < deadline, "the allowed subscriber received nothing"
            sent.append(_store(pool, first))
            first += 2 * BS
            time.sleep(0.05)
            got = _received(allowed)
        for _ in range(10):  # more batches while the others keep trying to handshake
            sent.append(_store(pool, first))
            first += 2 * BS
            time.sleep(0.05)
        time.sleep(0.3)
        got += _received(allowed)
        assert _received(plain) == [] and _received(intruder) == []
        stored = [e for _, _, payload in got for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        heard = [t for e in stored for t in e.token_ids]
        assert heard and heard == [t for chain in sent[len(sent) - len(heard) // (2 * BS) :] for t in chain]
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_curve_replay_serves_only_an_allowed_client(keys):
    buf = EventBuffer(1000)
    pool = BlockPool(16, BS, events=buf)
    curve: CurveServer = keys["curve"]
    pub = ZmqEventPublisher(
        buf, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", curve=curve, batch_interval_s=0.0
    ).start()
    ctx = zmq.Context()
    try:
        _store(pool, 100)
        deadline = time.monotonic() + 10
        while pub.num_batches == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        answers = {}
        for name, creds in (("plain", None), ("allowed", keys["router"])):
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            if creds is not None:
                dealer.curve_publickey, dealer.curve_secretkey = creds
                dealer.curve_serverkey = curve.public_key
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            answers[name] = dealer.recv_multipart() if dealer.poll(2000) else None
        assert answers["plain"] is None
        assert answers["allowed"] is not None and int.from_bytes(answers["allowed"][1], "big") == 0
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_token_ids_can_be_left_out_of_events():
    buf = EventBuffer(1000)
    pool = BlockPool(16, BS, events=buf)
    pub = ZmqEventPublisher(
        buf, "tcp://127.0.0.1:*", include_token_ids=False, context=zmq.Context(), batch_interval_s=0.0
    ).start()
    ctx = zmq.Context()
    try:
        sub = _sub(ctx, pub.endpoint)
        deadline, got = time.monotonic() + 10, []
        while not got:
            assert time.monotonic() < deadline
            _store(pool, 10 * len(buf.get_events()) + 500)
            time.sleep(0.05)
            got = _received(sub)
        stored = [e for _, _, p in got for e in decode_batch(p).events if isinstance(e, BlockStored)]
        assert stored and all(e.token_ids == [] and len(e.block_hashes) == 2 for e in stored)
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_a_star_host_binds_loopback_unless_asked_otherwise():
    buf = EventBuffer(10)
    ctx = zmq.Context()
    try:
        local = ZmqEventPublisher(buf, "tcp://*:*", replay_endpoint="tcp://*:*", context=ctx)
        assert local.endpoint.startswith("tcp://127.0.0.1:") and local.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert local.bound and not local.leaves_host
        everywhere = ZmqEventPublisher(buf, "tcp://*:*", bind_host="0.0.0.0", context=ctx)
        assert everywhere.endpoint.startswith("tcp://0.0.0.0:") and everywhere.bound and everywhere.leaves_host
        star = ZmqEventPublisher(buf, "tcp://*:*", bind_host="*", context=ctx)
        assert star.endpoint.startswith("tcp://0.0.0.0:") and star.leaves_host
        for pub in (local, everywhere, star):
            pub.close()
    finally:
        ctx.term()


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.0.0.2:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://10.0.0.2:5557", False),
        ("tcp://[::]:5557", False),
        ("tcp://eth0:5557", False),
    ],
)
def test_is_local(endpoint, local):
    assert is_local(endpoint) is local


def test_curve_setup_errors_name_the_flag(keys, tmp_path):
    server_secret = str(tmp_path / "server" / "server.key_secret")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (
            (str(tmp_path / "nope"), str(tmp_path / "allowed")),
            f"--kv-events-curve-secret-key: no such file {str(tmp_path / 'nope')!r}",
        ),
        (
            (keys["server_public"], str(tmp_path / "allowed")),
            f"--kv-events-curve-secret-key: {keys['server_public']!r} holds no secret key (give the .key_secret "
            "file, not the public .key)",
        ),
        (
            (server_secret, None),
            "--kv-events-curve-secret-key needs --kv-events-curve-clients-dir: the public keys "
            "of the subscribers allowed to connect",
        ),
        (
            (server_secret, str(empty)),
            f"--kv-events-curve-clients-dir: {str(empty)!r} holds no subscriber public "
            "key (*.key files made by zmq.auth.create_certificates)",
        ),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as caught:
            CurveServer.load(*args)
        assert str(caught.value) == message


def _serve(*flags: str):
    from kvreuse.cli import build_parser

    return build_parser().parse_args(["serve", *flags])


def test_serve_flags_build_the_publisher_they_describe(keys, tmp_path):
    from kvreuse.events import zmq_options

    buf = EventBuffer(10)
    args = _serve(
        "--kv-events-endpoint",
        "tcp://*:*",
        "--kv-events-no-token-ids",
        "--kv-events-curve-secret-key",
        str(tmp_path / "server" / "server.key_secret"),
        "--kv-events-curve-clients-dir",
        str(tmp_path / "allowed"),
    )
    zmq_options.check_arguments(args)
    pub = zmq_options.publisher_from_args(args, buf, lambda: buf.snapshot(BlockPool(1, BS)))
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.include_token_ids
        assert pub.curve is not None and pub.curve.public_key == keys["curve"].public_key
    finally:
        pub.close()
    assert _serve().kv_events_bind_host == "127.0.0.1"


def test_security_flags_without_an_endpoint_are_refused():
    from kvreuse.events import zmq_options

    for flags, flag in (
        (("--kv-events-no-token-ids",), "--kv-events-no-token-ids"),
        (("--kv-events-curve-secret-key", "k"), "--kv-events-curve-secret-key"),
        (("--kv-events-curve-clients-dir", "d"), "--kv-events-curve-clients-dir"),
    ):
        with pytest.raises(ValueError) as caught:
            zmq_options.check_arguments(_serve(*flags))
        assert str(caught.value) == f"{flag} needs --kv-events-endpoint (the events are off without it)"
    with pytest.raises(ValueError, match="^--kv-events-curve-clients-dir needs --kv-events-curve-secret-key$"):
        zmq_options.check_arguments(_serve("--kv-events-endpoint", "tcp://*:*", "--kv-events-curve-clients-dir", "d"))
    zmq_options.check_arguments(_serve("--kv-events-replay-endpoint", "tcp://*:*"))  # ignored, as before


def test_a_start_up_warning_when_events_leave_the_host_under_api_keys(keys):
    from kvreuse.events.zmq_options import seal_warning

    buf = EventBuffer(10)
    ctx = zmq.Context()
    pubs = {
        "local": ZmqEventPublisher(buf, "tcp://*:*", context=ctx),
        "exposed": ZmqEventPublisher(buf, "tcp://*:*", bind_host="0.0.0.0", context=ctx),
        "hashes": ZmqEventPublisher(buf, "tcp://*:*", bind_host="0.0.0.0", include_token_ids=False, context=ctx),
        "curve": ZmqEventPublisher(buf, "tcp://*:*", bind_host="0.0.0.0", curve=keys["curve"]),
    }
    try:
        exposed = pubs["exposed"].endpoint
        assert seal_warning(pubs["exposed"], api_keys=True) == (
            f"KV events on {exposed} can leave this host unencrypted and unauthenticated while --api-key is set: "
            "any subscriber there reads every tenant's token ids. Bind them to loopback (--kv-events-bind-host "
            "127.0.0.1), or set --kv-events-curve-secret-key and --kv-events-curve-clients-dir"
        )
        assert "every tenant's block hashes" in seal_warning(pubs["hashes"], api_keys=True)
        assert seal_warning(pubs["exposed"], api_keys=False) is None  # no keys: nothing is sealed
        assert seal_warning(pubs["local"], api_keys=True) is None
        assert seal_warning(pubs["curve"], api_keys=True) is None
    finally:
        for pub in pubs.values():
            pub.close()
        ctx.term()


def test_an_endpoint_that_cannot_be_opened_is_a_value_error_naming_the_flag(keys, tmp_path):
    """A port in use or a malformed endpoint is a one-line start-up error naming the flag (not a
    ZMQError traceback), and the publisher leaves no socket or ZAP handler behind."""
    from kvreuse.events import zmq_options

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        taken.bind("tcp://127.0.0.1:*")
        port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        curve = (
            "--kv-events-curve-secret-key",
            str(tmp_path / "server" / "server.key_secret"),
            "--kv-events-curve-clients-dir",
            str(tmp_path / "allowed"),
        )
        cases = [
            (
                ("--kv-events-endpoint", f"tcp://*:{port}"),
                f"--kv-events-endpoint: cannot bind 'tcp://*:{port}': Address already in use "
                f"(addr='tcp://127.0.0.1:{port}')",
            ),
            (
                ("--kv-events-endpoint", f"tcp://*:{port}", *curve),
                f"--kv-events-endpoint: cannot bind 'tcp://*:{port}': Address already in use "
                f"(addr='tcp://127.0.0.1:{port}')",
            ),
            (
                ("--kv-events-endpoint", "tcp://*:*", "--kv-events-replay-endpoint", f"tcp://*:{port}", *curve),
                f"--kv-events-replay-endpoint: cannot bind 'tcp://*:{port}': Address already in use "
                f"(addr='tcp://127.0.0.1:{port}')",
            ),
            (
                ("--kv-events-endpoint", "bogus"),
                "--kv-events-endpoint: cannot connect 'bogus': Invalid argument (addr='bogus')",
            ),
        ]
        buf = EventBuffer(10)
        threads = {t.name for t in threading.enumerate()}
        for flags, message in cases:
            args = _serve(*flags)
            zmq_options.check_arguments(args)
            with pytest.raises(ValueError) as caught:
                zmq_options.publisher_from_args(args, buf, lambda: buf.snapshot(BlockPool(1, BS)))
            assert str(caught.value) == message
        time.sleep(0.2)  # a ZAP handler's thread ends soon after its stop()
        assert {t.name for t in threading.enumerate()} == threads
    finally:
        taken.close(linger=0)
        ctx.term()
