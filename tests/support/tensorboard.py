"""A real ``tensorboard`` with torch-tb-profiler on a log dir, and its plugin's HTTP API."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

PLUGIN = "/data/plugin/pytorch_profiler"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plugin_get(base: str, path: str, **params: Any) -> Any:
    resp = httpx.get(f"{base}{path}", params=params, timeout=10)
    assert resp.status_code == 200, f"{path} {params}: {resp.status_code} {resp.text[:300]}"
    return resp.json()


@contextmanager
def tensorboard_plugin(logdir: Path, log_path: Path) -> Iterator[str]:
    """Run tensorboard on ``logdir``; yields the profiler plugin's base URL."""
    port = _free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
    try:
        yield f"http://127.0.0.1:{port}{PLUGIN}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_run(base: str, run: str, log_path: Path, timeout: float = 90.0) -> None:
    """Block until the plugin lists ``run`` and has finished loading."""
    deadline = time.monotonic() + timeout
    runs: Any = None
    while time.monotonic() < deadline:
        try:
            runs = httpx.get(f"{base}/runs", timeout=2).json()
            if run in runs["runs"] and not runs["loading"]:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"plugin never listed {run!r}: {runs}\n{log_path.read_text(errors='replace')}")
