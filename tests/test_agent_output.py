"""What a training script prints at exit: one stderr line saying what was captured, where it is, and
what was uploaded, whatever the script does with ``logging``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.fake_server import TOKEN, FakeServer

# Captures 2 windows of 2 steps (skip 1, warm-up 1) from a tiny CPU loop; no logging configured.
SCRIPT = """
import sys, torch, stepdoctor
steps = int(sys.argv[2])
model = torch.nn.Linear(8, 2)
with stepdoctor.profile("out", "r1", spool=sys.argv[1], skip_first=1, warmup=1, active=2, repeat=2) as prof:
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
print("trained", steps)
"""


def run_script(spool: Path, steps: int, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(spool), str(steps)],
        env={**base, "STEPDOCTOR_RAISE_ERRORS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def agent_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("stepdoctor:")]


def test_without_a_server_it_says_where_the_traces_are(tmp_path: Path) -> None:
    out = run_script(tmp_path, 8)
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    run_dir = tmp_path / "out" / "r1"
    assert line.startswith(f"stepdoctor: 2 traces captured for out/r1, in {run_dir} (no STEPDOCTOR_SERVER")
    assert f"stepdoctor analyze {run_dir}" in line and f"tensorboard --logdir {tmp_path}" in line
    assert len(list(run_dir.glob("*.pt.trace.json.gz"))) == 2


def test_with_a_server_it_says_what_was_uploaded(tmp_path: Path) -> None:
    with FakeServer() as server:
        out = run_script(tmp_path, 8, STEPDOCTOR_SERVER=server.url, STEPDOCTOR_TOKEN=TOKEN)
        assert len(server.uploads) == 2
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    assert line == (
        f"stepdoctor: 2 traces captured for out/r1; 2 uploaded to {server.url} "
        f"(local copies in {tmp_path / 'uploaded'}), nothing left to send"
    )


def test_with_the_server_down_it_says_what_waits_and_how_to_send_it(tmp_path: Path) -> None:
    server = FakeServer(start=False)
    out = run_script(tmp_path, 8, STEPDOCTOR_SERVER=server.url, STEPDOCTOR_FLUSH_TIMEOUT="0.5")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in agent_lines(out.stderr) if "captured" in line]
    assert f"2 traces captured for out/r1; 0 uploaded to {server.url}, 2 traces (" in line
    assert f"waiting in {tmp_path} for the next run or `stepdoctor sync`" in line


@pytest.mark.parametrize("steps", [1])
def test_a_loop_too_short_to_capture_says_so(tmp_path: Path, steps: int) -> None:
    out = run_script(tmp_path, steps)
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    assert line.startswith("stepdoctor: 0 traces captured for out/r1 (the loop ran ")
    assert "recording starts at step 2" in line  # skip 1, warm up 1
