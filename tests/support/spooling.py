"""Spool contents for the agent's delivery tests: a small real trace, committed the way the agent does."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from stepdoctor.spool import Spool


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small real Kineto Chrome trace recorded once with plain torch.profiler."""
    import torch

    path = tmp_path_factory.mktemp("trace") / "t.json"
    model = torch.nn.Linear(16, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            prof.step()
    prof.export_chrome_trace(str(path))
    return path.read_bytes()


def spool_traces(spool: Spool, trace: bytes, count: int, server: str | None, run: str = "r1") -> list[str]:
    """Commit ``count`` captures the way the agent does (export, rename, sidecar); returns their keys."""
    directory = spool.run_dir("proj", run)
    keys = []
    for index in range(count):
        stem = Spool.new_stem()
        Spool.export_partial(directory, stem).write_bytes(trace)
        key = uuid.uuid4().hex
        window = {"index": index, "first_step": 10 * index, "last_step": 10 * index + 2}
        sidecar = {"idempotency_key": key, "project": "proj", "run": run, "rank": 0, "window": window}
        Spool.commit_capture(directory, stem, {**sidecar, "server": server, "metadata": {"host": "h"}})
        keys.append(key)
    return keys


def run_training(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a training script (``python -c code args...``) as a user would: no ``STEPDOCTOR_*`` from the
    test's environment but ``env``, and agent errors raised (a mishandled one fails the script)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**base, "STEPDOCTOR_RAISE_ERRORS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def agent_lines(stderr: str) -> list[str]:
    """The agent's own stderr lines (torch's and Kineto's are left out)."""
    return [line for line in stderr.splitlines() if line.startswith("stepdoctor:")]
