"""A throwaway Redis Cluster for tests: N masters (and optional replicas) from Debian's
``redis-server`` on free loopback ports, joined by ``redis-cli --cluster create``."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    while True:
        port = random.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class RedisClusterServers:
    """``masters`` x (1 + ``replicas``) ``redis-server --cluster-enabled yes`` processes, no
    persistence, in ``workdir``. ``node_timeout_ms`` is how long a node may stay silent before
    the others mark it failed (and, with replicas, fail it over)."""

    def __init__(
        self, workdir: Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000, tls: bool = False
    ) -> None:
        self.binary = shutil.which("redis-server")
        self.cli = shutil.which("redis-cli")  # same Debian package family: redis-tools, a dependency
        self.workdir = workdir
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.tls = tls  # clients, replication and the cluster bus over TLS (make_certificates)
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            port = free_cluster_port()
            if not {port, port + 10000} & {q for p in self.ports for q in (p, p + 10000)}:
                self.ports.append(port)
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def ca_file(self) -> Path:
        return self.workdir / "tls" / "ca.crt"

    def url(self, port: int | None = None) -> str:
        """The ``--remote-cache`` URL seeded with node ``port`` (default: the first)."""
        if self.tls:
            return f"rediss+cluster://127.0.0.1:{port or self.ports[0]}?ssl_ca_certs={self.ca_file}"
        return f"redis+cluster://127.0.0.1:{port or self.ports[0]}"

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (``dbsize``, ``cluster info``: that node only)."""
        if self.tls:
            return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, ssl=True, ssl_ca_certs=str(self.ca_file))
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def start(self) -> None:
        if self.tls:
            make_certificates(self.workdir / "tls")
        for port in self.ports:
            self._start_node(port)
        subprocess.run(
            [
                self.cli,
                *(["--tls", "--cacert", str(self.ca_file)] if self.tls else []),
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_until_ok(self.ports)

    def masters(self, asked: int | None = None) -> list[int]:
        """Ports of the masters that own slots now, as node ``asked`` (default: the first
        live one) sees it."""
        live = asked or next(p for p in self.ports if p in self.processes)
        slots = self.node(live).execute_command("CLUSTER", "SLOTS")
        return sorted({int(entry[2][1]) for entry in slots})

    def wait_until_ok(self, ports: list[int], timeout_s: float = 30) -> None:
        """Until every node in ``ports`` reports ``cluster_state:ok``."""
        self.wait_for_state("ok", ports, timeout_s)

    def wait_for_state(self, state: str, ports: list[int], timeout_s: float = 30) -> None:
        """Until every node in ``ports`` reports ``cluster_state:<state>`` (``ok``, ``fail``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(self.node(p).cluster("info")["cluster_state"] == state for p in ports):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the cluster on {ports} is not {state} after {timeout_s} s; see {self.workdir}")

    def wait_replicated(self, timeout_s: float = 30) -> None:
        """Until every replica holds as many keys as its master (asynchronous replication)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pairs = []
            for port in self.processes:
                info = self.node(port).info("replication")
                if info["role"] == "slave":
                    pairs.append((int(info["master_port"]), port))
            if pairs and all(self.node(m).dbsize() == self.node(r).dbsize() for m, r in pairs):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas did not catch up: {pairs}")
            time.sleep(0.05)

    def wait_failed_over(self, dead: int, timeout_s: float = 30) -> None:
        """Until every live node sees a replica owning the slots of the dead master ``dead``
        and reports ``cluster_state:ok`` again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(dead not in self.masters(p) for p in self.processes):
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no failover of {dead} in {timeout_s} s; see {self.workdir}")
            time.sleep(0.1)
        self.wait_until_ok(list(self.processes), timeout_s)

    def kill(self, port: int) -> None:
        """SIGKILL one node, as a crash would; waits until the process is gone."""
        process = self.processes.pop(port)
        process.kill()
        process.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start a killed node again on its port: it reads its ``nodes.conf`` and rejoins as
        what it was (a master of the same slots, now empty: no persistence)."""
        self._start_node(port)
        self.wait_until_ok(list(self.processes))

    def stop(self) -> None:
        for port in list(self.processes):
            self.kill(port)

    def _start_node(self, port: int) -> None:
        node_dir = self.workdir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        certs = self.workdir / "tls"
        listen = ["--port", str(port)]
        if self.tls:  # no plain port: clients, replicas and the bus all speak TLS
            listen = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes"]
            listen += ["--tls-cert-file", str(certs / "node.crt"), "--tls-key-file", str(certs / "node.key")]
            listen += ["--tls-ca-cert-file", str(self.ca_file), "--tls-auth-clients", "no"]
        self.processes[port] = subprocess.Popen(
            [
                self.binary,
                *listen,
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(node_dir),
                "--logfile",
                str(node_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.node(port).ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {port}; see {node_dir / 'redis.log'}")


def make_certificates(folder: Path) -> None:
    """A throwaway CA (``ca.crt``) and a node certificate for 127.0.0.1 (``node.crt``,
    ``node.key``) signed by it, with Debian's ``openssl``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=kvreuse-test-ca",
        "req -newkey rsa:2048 -nodes -keyout node.key -out node.csr -subj /CN=127.0.0.1",
        "x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out node.crt -days 2 -extfile ext.cnf",
    ):
        subprocess.run(["openssl", *cmd.split()], cwd=folder, check=True, capture_output=True, timeout=60)


def running_cluster(workdir: Path, **kwargs) -> Iterator[RedisClusterServers]:
    """For a fixture (``yield from``): a running cluster (3 masters unless ``kwargs`` say
    otherwise) in ``workdir``; stopped afterwards, also when a test failed mid-way."""
    cluster = RedisClusterServers(workdir, **kwargs)
    if cluster.binary is None or cluster.cli is None:
        pytest.skip("redis-server / redis-cli not on PATH (apt-get install redis-server; .ci/run installs it)")
    if cluster.tls and shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH: the TLS cluster needs it for its certificates")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
