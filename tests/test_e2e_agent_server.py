"""End to end with the real pieces: the agent in a CPU training process is the client of a real
``stepdoctor serve``; traces are analysed by its worker and download byte-identical.

Phase 1 trains while the server is unreachable (everything stays in the spool); the spooled bytes
are copied aside, then ``stepdoctor sync`` delivers them. Phase 2 trains against the live server.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepdoctor_analysis import BOTTLENECK_KINDS
from support.server import cli_token, serve_subprocess

pytestmark = pytest.mark.slow


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


class _Training:
    """``demo_train`` started in the background (the test starts the server meanwhile: both cost
    seconds of CPU start-up); ``result()`` waits for it. Output goes to files, not pipes nobody reads."""

    def __init__(self, out_dir: Path, env: dict[str, str], run: str, *extra: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "stepdoctor.demo_train",
            "--run",
            run,
            "--steps",
            "14",
            "--skip-first",
            "3",
        ]
        cmd += ["--warmup", "1", "--active", "2", "--repeat", "2", "--sample-ms", "2", *extra]
        self.cmd = cmd
        self.out, self.err = out_dir / f"{run}.stdout", out_dir / f"{run}.stderr"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=err)

    def __enter__(self) -> _Training:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def result(self) -> subprocess.CompletedProcess[str]:
        self.process.wait(timeout=300)
        return subprocess.CompletedProcess(
            self.cmd, self.process.returncode, self.out.read_text(), self.err.read_text()
        )


def _wait_analysed(
    api: httpx.Client, run_id: int, expected: int, timeout: float = 180.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        traces = api.get(f"/api/v1/runs/{run_id}/traces").json()["items"]
        if len(traces) == expected and all(t["status"] in {"done", "failed"} for t in traces):
            return list(traces)
        assert time.monotonic() < deadline, f"analyses not finished: {traces}"
        time.sleep(0.2)


def _run_id(api: httpx.Client, project: str, run: str) -> int:
    runs = api.get("/api/v1/runs", params={"project": project}).json()["items"]
    return next(r["id"] for r in runs if r["name"] == run)


def test_agent_uploads_are_analysed_and_download_byte_identical(tmp_path: Path) -> None:
    server_env = {
        "STEPDOCTOR_DATA_DIR": str(tmp_path / "server"),
        "STEPDOCTOR_WORKERS": "1",
        "STEPDOCTOR_DATABASE_URL": "",
    }
    spool = tmp_path / "spool"
    agent_env = {
        "STEPDOCTOR_SPOOL": str(spool),
        "STEPDOCTOR_PROJECT": "e2e",
        "STEPDOCTOR_FLUSH_TIMEOUT": "20",
    }

    # Phase 1: the agent's server is unreachable for the whole run (the real one starts meanwhile,
    # elsewhere); training finishes and the spool keeps both windows.
    offline_env = {**agent_env, "STEPDOCTOR_SERVER": _dead_url(), "STEPDOCTOR_TOKEN": "sdt_unused"}
    with (
        _Training(tmp_path, offline_env, "offline", "--backoff-base", "0.05") as down_training,
        serve_subprocess(server_env) as server,
    ):
        upload_token, read_token = cli_token(server_env, "upload"), cli_token(server_env, "read")
        down = down_training.result()
        assert down.returncode == 0, down.stderr[-2000:]
        spooled = sorted(spool.rglob("*.pt.trace.json.gz"))
        assert len(spooled) == 2, f"expected two capture windows in the spool, got {spooled}"
        kept = tmp_path / "kept"
        kept.mkdir()
        originals = {hashlib.sha256(p.read_bytes()).hexdigest(): shutil.copy(p, kept) for p in spooled}
        for path in spooled:  # each is a complete, valid Chrome trace
            assert "traceEvents" in json.loads(gzip.decompress(path.read_bytes()))

        sync = subprocess.run(
            [
                sys.executable,
                "-m",
                "stepdoctor",
                "sync",
                "--spool",
                str(spool),
                "--server",
                server.url,
                "--token",
                upload_token,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sync.returncode == 0, sync.stderr
        assert not list(spool.glob("*/*/*.pt.trace.json.gz")), "acknowledged traces leave the queue"
        assert len(list(spool.glob("uploaded/*/*/*.pt.trace.json.gz"))) == 2  # kept as local copies

        # Phase 2: live server; metadata and the loader settings travel with each trace. It trains
        # while the worker analyses phase 1's traces.
        live_env = {**agent_env, "STEPDOCTOR_SERVER": server.url, "STEPDOCTOR_TOKEN": upload_token}
        with (
            _Training(tmp_path, live_env, "live", "--workers", "0") as live_training,
            httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {read_token}"}, timeout=30
            ) as api,
        ):
            offline = _wait_analysed(api, _run_id(api, "e2e", "offline"), expected=2)
            downloaded = {}
            for t in offline:
                resp = api.get(f"/api/v1/traces/{t['id']}/download")
                assert resp.status_code == 200
                digest = hashlib.sha256(resp.content).hexdigest()
                assert resp.headers["x-content-sha256"] == digest
                downloaded[digest] = resp.content
            assert set(downloaded) == set(originals), "downloads must be the spooled bytes, each exactly once"
            for digest, data in downloaded.items():
                assert Path(originals[digest]).read_bytes() == data

            live = live_training.result()
            assert live.returncode == 0, live.stderr[-2000:]
            run_id = _run_id(api, "e2e", "live")
            traces = _wait_analysed(api, run_id, expected=2)
            assert {t["status"] for t in traces} == {"done"}
            detail = api.get(f"/api/v1/traces/{traces[0]['id']}").json()
            meta = detail["metadata"]
            import torch

            assert meta["torch"] == torch.__version__
            assert meta["loader"]["num_workers"] == 0 and meta["loader"]["batch_size"] == 32
            assert detail["rank"] == 0 or detail["rank"] is None
            assert detail["analysis"]["report"]["breakdown"].keys() >= {
                "kernel",
                "dataloader",
                "cpu_exec",
                "other",
            }
            diagnosis = api.get(f"/api/v1/runs/{run_id}").json()["diagnosis"]
            assert diagnosis["traces"] == 2 and diagnosis["primary"]["kind"] in BOTTLENECK_KINDS
            assert diagnosis["recommendations"], "a diagnosed run names a next optimization"
