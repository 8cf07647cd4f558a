"""ZeroMQ CURVE for the KV-event sockets: events encrypted on the wire, and only subscribers
whose public keys are allowed can connect (the ZAP handler of ``zmq.auth``).

Keys are ``zmq.auth`` certificate files, made with pyzmq::

    python -c "import zmq.auth; zmq.auth.create_certificates('keys', 'server')"  # keys/server.key{,_secret}
    python -c "import zmq.auth; zmq.auth.create_certificates('clients', 'router')"  # one per subscriber

The executor gets ``--kv-events-curve-secret-key keys/server.key_secret`` and
``--kv-events-curve-clients-dir clients`` (the ``*.key`` public files of the allowed
subscribers; copy only those there). A subscriber sets ``curve_serverkey`` to the server's
public key and its own key pair (``curve_publickey``, ``curve_secretkey``); a socket
without them, or with a key not in the directory, completes no handshake and receives nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveServer:
    """The publisher's CURVE key pair and the directory of allowed subscribers' public keys."""

    public_key: bytes  # Z85, 40 bytes
    secret_key: bytes  # Z85, 40 bytes
    clients_dir: str

    @classmethod
    def load(cls, secret_key_file: str, clients_dir: str | None) -> CurveServer:
        """Read a ``zmq.auth`` secret certificate and check the clients directory. Raises
        ``ValueError`` naming the flag: a missing or public-only key file, no clients
        directory (encryption without an allow-list would let anyone who knows the server's
        public key subscribe), or a directory holding no ``*.key`` file."""
        if not zmq.has("curve"):
            raise ValueError("--kv-events-curve-secret-key: this libzmq was built without CURVE")
        if not os.path.isfile(secret_key_file):
            raise ValueError(f"--kv-events-curve-secret-key: no such file {secret_key_file!r}")
        try:
            public, secret = zmq.auth.load_certificate(secret_key_file)
        except (ValueError, OSError) as exc:
            raise ValueError(
                f"--kv-events-curve-secret-key: {secret_key_file!r} is not a zmq.auth certificate ({exc})"
            ) from None
        if secret is None:
            raise ValueError(
                f"--kv-events-curve-secret-key: {secret_key_file!r} holds no secret key "
                "(give the .key_secret file, not the public .key)"
            )
        if clients_dir is None:
            raise ValueError(
                "--kv-events-curve-secret-key needs --kv-events-curve-clients-dir: the public keys "
                "of the subscribers allowed to connect"
            )
        if not os.path.isdir(clients_dir) or not any(n.endswith(".key") for n in os.listdir(clients_dir)):
            raise ValueError(
                f"--kv-events-curve-clients-dir: {clients_dir!r} holds no subscriber public key "
                "(*.key files made by zmq.auth.create_certificates)"
            )
        return cls(public, secret, clients_dir)

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server; call before it binds or connects."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True

    def start_authenticator(self, context: zmq.Context) -> ThreadAuthenticator:
        """Start ``context``'s ZAP handler allowing the clients directory's keys (one per
        context; stop it when the sockets close)."""
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=self.clients_dir)
        return auth
