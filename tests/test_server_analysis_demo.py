"""The README's one command: ``python -m stepdoctor_server.demo`` from an empty data dir to a diagnosis."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stepdoctor_analysis import BOTTLENECK_KINDS

KINDS = "|".join(BOTTLENECK_KINDS)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_demo_trains_uploads_and_diagnoses_both_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    port = _free_port()
    env = {
        **os.environ,
        "STEPDOCTOR_DATA_DIR": str(tmp_path / "data"),
        "STEPDOCTOR_SPOOL": str(tmp_path / "spool"),
        "STEPDOCTOR_DATABASE_URL": "",
    }
    done = subprocess.run(
        [sys.executable, "-m", "stepdoctor_server.demo", "--port", str(port), "--steps", "10", "--no-wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"Dashboard:    http://127.0.0.1:{port}/" in out
    assert re.search(r"Login token:  sdt_\S+", out)
    for run in ("workers0", "workers2"):
        assert re.search(
            rf"^  {run}: ({KINDS})-bound \(\d+% of step time\), mean step [\d.]+ ms", out, re.M
        ), out
    # The server was stopped: nothing listens on the port any more.
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
