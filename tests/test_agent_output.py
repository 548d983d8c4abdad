"""What a training script prints at exit: one stderr line saying what was captured, where it is, and
what was uploaded, whatever the script does with ``logging``."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from support import spooling
from support.fake_server import TOKEN, FakeServer, free_port
from support.spooling import TrainingForks, agent_lines

training_forks = spooling.training_forks  # each script in a fork of one process that imported torch

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


def run_script(forks: TrainingForks, spool: Path, steps: int, **env: str) -> subprocess.CompletedProcess[str]:
    return forks.run(SCRIPT, str(spool), str(steps), **env)


def test_without_a_server_it_says_where_the_traces_are(tmp_path: Path, training_forks: TrainingForks) -> None:
    out = run_script(training_forks, tmp_path, 8)
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    run_dir = tmp_path / "out" / "r1"
    assert line.startswith(f"stepdoctor: 2 traces captured for out/r1, in {run_dir} (no STEPDOCTOR_SERVER")
    assert f"stepdoctor analyze {run_dir}" in line and f"tensorboard --logdir {tmp_path}" in line
    assert len(list(run_dir.glob("*.pt.trace.json.gz"))) == 2


def test_with_a_server_it_says_what_was_uploaded(tmp_path: Path, training_forks: TrainingForks) -> None:
    with FakeServer() as server:
        out = run_script(training_forks, tmp_path, 8, STEPDOCTOR_SERVER=server.url, STEPDOCTOR_TOKEN=TOKEN)
        assert len(server.uploads) == 2
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    assert line == (
        f"stepdoctor: 2 traces captured for out/r1; 2 uploaded to {server.url} "
        f"(local copies in {tmp_path / 'uploaded'}), nothing left to send"
    )


def test_an_older_server_without_the_series_endpoint_is_said_in_the_same_line(
    tmp_path: Path, training_forks: TrainingForks
) -> None:
    with FakeServer(series_endpoint=False) as server:
        out = run_script(training_forks, tmp_path, 8, STEPDOCTOR_SERVER=server.url, STEPDOCTOR_TOKEN=TOKEN)
        assert len(server.uploads) == 2 and server.series  # it was tried
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    assert line.endswith(
        f"nothing left to send, the step series stays in {tmp_path} (the server has no step-series endpoint)"
    )
    assert list(tmp_path.rglob("*.stepdoctor.series"))


def test_with_the_server_down_it_says_what_waits_and_how_to_send_it(
    tmp_path: Path, training_forks: TrainingForks
) -> None:
    server = FakeServer(start=False)
    out = run_script(
        training_forks, tmp_path, 8, STEPDOCTOR_SERVER=server.url, STEPDOCTOR_FLUSH_TIMEOUT="0.5"
    )
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in agent_lines(out.stderr) if "captured" in line]
    assert f"2 traces captured for out/r1; 0 uploaded to {server.url}, 2 traces (" in line
    assert f"waiting in {tmp_path} for the next run or `stepdoctor sync`" in line


@pytest.mark.parametrize("steps", [1])
def test_a_loop_too_short_to_capture_says_so(
    tmp_path: Path, training_forks: TrainingForks, steps: int
) -> None:
    out = run_script(training_forks, tmp_path, steps)
    assert out.returncode == 0, out.stderr
    (line,) = agent_lines(out.stderr)
    assert line.startswith("stepdoctor: 0 traces captured for out/r1 (the loop ran ")
    assert "recording starts at step 2" in line  # skip 1, warm up 1


# Leaving the `with` block is timed inside the script; the default exit budget applies (no
# STEPDOCTOR_FLUSH_TIMEOUT), so this shows what a user's script pays when the server is down.
TIMED_EXIT = """
import sys, time, torch, stepdoctor
model = torch.nn.Linear(8, 2)
with stepdoctor.profile("out", "r1", spool=sys.argv[1], skip_first=1, warmup=1, active=2, repeat=2) as prof:
    for _ in range(8):
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
    left_at = time.monotonic()
print(f"exit took {time.monotonic() - left_at:.2f}")
"""


def test_a_refused_connection_ends_the_exit_wait_at_once_and_says_what_stayed(
    tmp_path: Path, training_forks: TrainingForks
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    out = training_forks.run(TIMED_EXIT, str(tmp_path), STEPDOCTOR_SERVER=url, STEPDOCTOR_TOKEN=TOKEN)
    assert out.returncode == 0, out.stderr
    took = float(out.stdout.split("exit took ")[1])
    assert took < 6, took  # the old 10 s flush budget ran out in full
    (line,) = [line for line in agent_lines(out.stderr) if "captured" in line]
    assert f"2 traces captured for out/r1; 0 uploaded to {url}, 2 traces (" in line
    assert line.endswith(
        f"waiting in {tmp_path} for the next run or `stepdoctor sync` "
        "(server unreachable: ConnectionRefusedError: [Errno 111] Connection refused)"
    )
    assert len(list(tmp_path.glob("out/r1/*.stepdoctor.meta"))) == 2


def test_a_hung_server_costs_the_exit_at_most_the_default_budget(
    tmp_path: Path, training_forks: TrainingForks
) -> None:
    with socket.socket() as hung:  # listens, never accepts nor reads
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        out = training_forks.run(TIMED_EXIT, str(tmp_path), STEPDOCTOR_SERVER=url, STEPDOCTOR_TOKEN=TOKEN)
    assert out.returncode == 0, out.stderr
    took = float(out.stdout.split("exit took ")[1])
    assert took < 7, took  # budget 2 s (the old one was 10 s)
    (line,) = [line for line in agent_lines(out.stderr) if "captured" in line]
    assert f"2 traces captured for out/r1; 0 uploaded to {url}, 2 traces (" in line
    assert f"waiting in {tmp_path} for the next run or `stepdoctor sync` (" in line
    assert len(list(tmp_path.glob("out/r1/*.stepdoctor.meta"))) == 2
