"""A spool that cannot be written costs windows, never the run: one line names the folder and the
reason, the exit line counts the windows as lost, and training goes on.

The disk is made full for real, portably and without root: ``RLIMIT_FSIZE`` makes the kernel refuse
any write past a size (``EFBIG``, "File too large"), for torch's C++ exporter as for Python, exactly
where a full disk refuses with ``ENOSPC``. A spool below a regular file stands for a folder that
cannot be created (root ignores permission bits, so a chmod-ed folder would not be refused).
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stepdoctor.spool import EXPORT_SUFFIX, META_SUFFIX, PARTIAL, TRACE_SUFFIX, Spool
from support import spooling
from support.fake_server import TOKEN, FakeServer
from support.spooling import TrainingForks, agent_lines, spool_traces

real_trace = spooling.real_trace  # a small real Kineto trace (module-scoped fixture)
training_forks = spooling.training_forks  # each script in a fork of one process that imported torch

# 2 windows of 2 steps; with a size limit, every file written past it is refused by the kernel.
SCRIPT = """
import resource, signal, sys, torch, stepdoctor
limit = int(sys.argv[2])
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
model = torch.nn.Linear(8, 2)
with stepdoctor.profile("out", "r1", spool=sys.argv[1], skip_first=1, warmup=1, active=2, repeat=2) as prof:
    for _ in range(8):
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
print("trained 8")
"""


def window_pieces(run_dir: Path) -> list[str]:
    """What a window's capture writes: the export (and torch's .tmp of it), the gzip, the sidecar,
    their partials, and the agent's write probe."""
    if not run_dir.exists():
        return []
    marks = (EXPORT_SUFFIX, TRACE_SUFFIX, META_SUFFIX, PARTIAL, ".tmp", "probe")
    return sorted(p.name for p in run_dir.iterdir() if any(mark in p.name for mark in marks))


FILE_LIMIT = 16 * 1024  # well under one window's export (about 40 KB)


def full_disk(tmp_path: Path) -> tuple[Path, int]:
    return tmp_path, FILE_LIMIT


def spool_below_a_file(tmp_path: Path) -> tuple[Path, int]:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the spool should be")
    return blocker / "spool", 0


@pytest.mark.parametrize(
    "make_spool,what,reason",
    [
        (full_disk, "the trace of steps 2-3", "File too large"),
        (spool_below_a_file, "traces", "Not a directory"),
    ],
    ids=["full-disk", "folder-cannot-be-created"],
)
def test_an_unwritable_spool_loses_the_windows_says_so_once_and_training_continues(
    tmp_path: Path,
    training_forks: TrainingForks,
    make_spool: Callable[[Path], tuple[Path, int]],
    what: str,
    reason: str,
) -> None:
    spool, limit = make_spool(tmp_path)
    out = training_forks.run(SCRIPT, str(spool), str(limit))  # agent errors raised: a mishandled one kills it
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "trained 8"
    run_dir = spool / "out" / "r1"
    warning, *series, summary = agent_lines(out.stderr)
    # the step series, kept in memory while the folder refuses it, is lost at exit: one more line
    assert series in (
        [],
        [
            f"stepdoctor: 1 step-series chunk(s) could not be written to {run_dir} within 2 s; "
            "those steps are missing from the run's timeline"
        ],
    )
    assert warning == (
        f"stepdoctor: cannot write {what} to {run_dir} ({reason}); "
        "windows are lost until it can be written, training continues"
    )
    assert summary.startswith(
        f"stepdoctor: 0 traces captured for out/r1, 2 lost (cannot write to {run_dir}: {reason}), "
    )
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr
    assert window_pieces(run_dir) == []  # no half export, no torch .tmp, no probe left behind


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_sync_on_a_full_disk_keeps_the_export_and_says_why(tmp_path: Path, real_trace: bytes) -> None:
    with FakeServer() as server:
        spool = Spool(tmp_path)
        (key,) = spool_traces(spool, real_trace, 1, server.url)  # committed raw, not yet compressed
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
        cmd = [sys.executable, "-m", "stepdoctor", "sync", "--spool", str(tmp_path), "--token", TOKEN]
        full = subprocess.run(
            [*cmd, "--timeout", "3"],
            env={**env, "STEPDOCTOR_RAISE_ERRORS": "1"},
            preexec_fn=lambda: _limit_file_size(1024),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert full.returncode == 1, full.stderr
        run_dir = tmp_path / "proj" / "r1"
        assert (
            f"stepdoctor: cannot write the compressed trace in {run_dir} (File too large); "
            "the trace stays there uncompressed and is tried again later"
        ) in full.stderr.splitlines()
        assert "Traceback" not in full.stderr and "internal error" not in full.stderr
        assert f"0 uploaded, 1 left in {tmp_path}" in full.stdout
        assert server.requests == []
        assert len(list(run_dir.glob(f"*{EXPORT_SUFFIX}"))) == 1
        assert [p.name for p in run_dir.iterdir() if p.name.endswith(".partial")] == []
        # space again: the same trace goes, once
        again = subprocess.run(
            [*cmd, "--timeout", "20"], env=env, capture_output=True, text=True, timeout=120
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert list(server.uploads) == [key]


def test_a_sidecar_refused_by_a_full_disk_loses_its_window_and_leaves_no_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The export went through, the commit did not (ENOSPC on the sidecar): the export goes too."""
    import torch

    import stepdoctor

    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")
    monkeypatch.delenv("STEPDOCTOR_SERVER", raising=False)
    monkeypatch.setattr("stepdoctor.spool.write_atomic", disk_full)
    model = torch.nn.Linear(8, 2)
    with stepdoctor.profile("out", "r1", spool=tmp_path, skip_first=1, warmup=1, active=2) as prof:
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
            prof.step()
    assert (prof.captured, prof.lost) == (0, 1)
    run_dir = tmp_path / "out" / "r1"
    err = capsys.readouterr().err
    assert f"stepdoctor: cannot write the trace of steps 2-3 to {run_dir} (No space left on device); " in err
    assert f"0 traces captured for out/r1, 1 lost (cannot write to {run_dir}: No space left on device)" in err
    assert window_pieces(run_dir) == []
