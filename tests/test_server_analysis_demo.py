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


def _demo(env: dict[str, str], cwd: Path, port: int) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stepdoctor_server.demo", "--port", str(port), "--steps", "10", "--no-wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_demo_trains_uploads_and_diagnoses_both_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    port = _free_port()
    env = {
        **os.environ,
        "STEPDOCTOR_DATA_DIR": str(tmp_path / "data"),
        "STEPDOCTOR_DATABASE_URL": "",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # where the agent's default spool would be
    }
    env.pop("STEPDOCTOR_SPOOL", None)
    out = _demo(env, tmp_path, port)
    assert f"Dashboard:    http://127.0.0.1:{port}/" in out
    assert re.search(r"Login token:  sdt_\S+", out)
    first = set()
    for run in ("workers0", "workers2"):
        line = re.search(
            rf"^  ({run}-\d{{8}}-\d{{6}}): ({KINDS})-bound \(\d+% of step time\), mean step [\d.]+ (ms|s)",
            out,
            re.M,
        )
        assert line, out
        first.add(line.group(1))
    # One step time per run: the analysed one (demo_train prints none of its own).
    assert len(re.findall(r"\d (ms|s)\b", out)) == 2 and "ms/step" not in out, out
    assert "New runs " in out and "earlier run" not in out
    # Everything the demo wrote is in the data directory (`make clean` removes it), the spool too.
    assert list((tmp_path / "data" / "spool").rglob("*.pt.trace.json.gz")), (
        "the demo's traces are not spooled there"
    )
    assert not (tmp_path / "cache").exists(), list((tmp_path / "cache").rglob("*"))
    # The server was stopped: nothing listens on the port any more.
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0

    # A second demo on the same data starts fresh runs, and says it joins the earlier ones.
    again = _demo(env, tmp_path, port)
    assert "join 2 earlier run(s) of project 'demo'" in again, again
    second = set(re.findall(r"^  (workers[02]-\d{8}-\d{6}): ", again, re.M))
    assert len(second) == 2 and not second & first
