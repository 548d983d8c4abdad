"""The agent in real training processes: killed mid-capture, several ranks, a server that is down."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepdoctor import sync
from stepdoctor.spool import EXPORT_SUFFIX, META_SUFFIX, PARTIAL, TRACE_SUFFIX
from support.fake_server import TOKEN, FakeServer

KILL_IN_COMMIT = """
import os, signal, sys
from stepdoctor import spool
from stepdoctor.demo_train import main
real_commit = spool.Spool.commit_capture
windows = []
def commit(directory, stem, sidecar):
    windows.append(stem)
    if len(windows) == 2:  # the second window is exported, its sidecar not yet written: die now
        os.kill(os.getpid(), signal.SIGTERM)
    return real_commit(directory, stem, sidecar)
spool.Spool.commit_capture = staticmethod(commit)
sys.exit(main(sys.argv[1:]))
"""

# An agent bug raised on the delivery thread (STEPDOCTOR_RAISE_ERRORS=1) must fail the test, not just warn.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def agent_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPDOCTOR_", "RANK", "WORLD_SIZE"))}
    env.update(
        {"STEPDOCTOR_RAISE_ERRORS": "1", "STEPDOCTOR_PROJECT": "proc", "STEPDOCTOR_TOKEN": TOKEN}, **extra
    )
    return env


def demo_cmd(spool: Path, run: str, *args: str) -> list[str]:
    base = ["--run", run, "--spool", str(spool), "--skip-first", "1", "--warmup", "1", "--active", "2"]
    light = ["--sample-ms", "0.2", "--batch-size", "8", "--hidden", "64"]
    return [sys.executable, "-m", "stepdoctor.demo_train", *base, *light, *args]


def sidecar_keys(spool: Path) -> set[str]:
    return {json.loads(p.read_text())["idempotency_key"] for p in spool.glob(f"*/*/*{META_SUFFIX}")}


def test_sigterm_between_export_and_commit_never_uploads_the_half_capture(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-c",
        KILL_IN_COMMIT,
        *demo_cmd(tmp_path, "killed", "--repeat", "3", "--steps", "12")[3:],
    ]
    proc = subprocess.run(cmd, env=agent_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    run_dir = tmp_path / "proc" / "killed"
    leftovers = {p.name.split(".", 2)[-1] for p in run_dir.iterdir()}
    assert f"{EXPORT_SUFFIX.lstrip('.')}{PARTIAL}" in leftovers  # the interrupted window's export
    keys = sidecar_keys(tmp_path)
    assert len(keys) == 1  # only the committed first window
    with FakeServer() as server:
        assert (
            sync.main(["--spool", str(tmp_path), "--server", server.url, "--token", TOKEN, "--timeout", "10"])
            == 0
        )
        assert set(server.uploads) == keys and len(server.requests) == 1
    assert not any(run_dir.iterdir())  # the dead process's partial export was cleaned up, never sent


def test_sigterm_at_a_random_moment_leaves_a_consistent_spool(tmp_path: Path) -> None:
    cmd = demo_cmd(
        tmp_path,
        "random",
        "--every",
        "3",
        "--repeat",
        "0",
        "--steps",
        "400",
        "--server",
        "http://127.0.0.1:9",
    )
    proc = subprocess.Popen(cmd, env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"*/*/*{META_SUFFIX}")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.37)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    committed = list(tmp_path.glob(f"*/*/*{META_SUFFIX}"))
    assert committed
    for sidecar in committed:  # every committed capture is whole, gzip or raw
        stem = sidecar.name[: -len(META_SUFFIX)]
        gz, raw = sidecar.with_name(stem + TRACE_SUFFIX), sidecar.with_name(stem + EXPORT_SUFFIX)
        data = gzip.decompress(gz.read_bytes()) if gz.exists() else raw.read_bytes()
        assert "traceEvents" in json.loads(data)
    keys = sidecar_keys(tmp_path)
    with FakeServer() as server:
        assert (
            sync.main(["--spool", str(tmp_path), "--server", server.url, "--token", TOKEN, "--timeout", "20"])
            == 0
        )
        assert set(server.uploads) == keys
    assert not (tmp_path / "failed").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "uploaded" not in p.parts]
    assert len(list(tmp_path.glob(f"uploaded/*/*/*{TRACE_SUFFIX}"))) == len(keys)


def test_two_ranks_as_separate_processes_land_in_one_run(tmp_path: Path) -> None:
    with FakeServer() as server:
        procs = [
            subprocess.Popen(
                demo_cmd(tmp_path, "ddp", "--steps", "6", "--repeat", "1", "--server", server.url),
                env=agent_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in (0, 1)
        ]
        outputs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert not any("Traceback" in out for out in outputs), "\n".join(outputs)
        uploads = list(server.uploads.values())
    assert sorted(u.rank for u in uploads) == [0, 1]
    assert {(u.project, u.run) for u in uploads} == {("proc", "ddp")}
    assert all(u.metadata["world_size"] == 2 and u.metadata["rank"] == u.rank for u in uploads)
    assert len({u.metadata["pid"] for u in uploads}) == 2


def test_server_down_for_the_whole_run_then_sync_cli_uploads_exactly_once(tmp_path: Path) -> None:
    server = FakeServer(start=False)
    cmd = demo_cmd(
        tmp_path, "offline", "--workers", "2", "--steps", "9", "--repeat", "2", "--server", server.url
    )
    started = time.monotonic()
    proc = subprocess.run(
        [*cmd, "--flush-timeout", "1"], env=agent_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # agent errors raise in tests
    assert "steps=9" in proc.stdout and time.monotonic() - started < 40
    (summary,) = [line for line in proc.stderr.splitlines() if "captured for" in line]
    assert summary.startswith("stepdoctor: 2 traces captured for proc/offline; 0 uploaded to " + server.url)
    assert f"waiting in {tmp_path} for the next run or `stepdoctor sync`" in summary
    keys = sidecar_keys(tmp_path)
    assert len(keys) == 2
    server.up()
    try:
        cli = [sys.executable, "-m", "stepdoctor", "sync", "--spool", str(tmp_path), "--token", TOKEN]
        done = subprocess.run(cli, env=agent_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert set(server.uploads) == keys and len(server.requests) == 2
        assert all(u.metadata["loader"]["num_workers"] == 2 for u in server.uploads.values())
    finally:
        server.down()
