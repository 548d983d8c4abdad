"""The console script's exit (``stepdoctor.cli.entry``): ``analyze`` ends without the interpreter's
teardown once its report is flushed, and only when nothing else runs that atexit would wait for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.fixtures import fixture

TRACE = fixture("trace_filter/sampled_rank-0.json.gz")


def _entry(tmp_path: Path, argv: list[str], *, thread: bool = False) -> tuple[int, str, bool]:
    """Run ``entry()`` in a fresh process with an atexit hook; whether the hook ran tells whether
    the interpreter's teardown did."""
    mark = tmp_path / "teardown-ran"
    script = (
        "import atexit, sys, threading, time\n"
        f"atexit.register(lambda: open({str(mark)!r}, 'w').close())\n"
        + ("threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n" if thread else "")
        + f"sys.argv = ['stepdoctor', *{argv!r}]\n"
        "from stepdoctor.cli import entry\n"
        "entry()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout, mark.exists()


def test_analyze_skips_the_teardown_and_still_writes_its_whole_report(tmp_path: Path) -> None:
    rc, out, teardown = _entry(tmp_path, ["analyze", "--format", "json", str(TRACE)])
    assert rc == 0 and json.loads(out)["primary"]["kind"]  # flushed whole before the exit
    assert not teardown


def test_analyze_keeps_its_exit_status_on_bad_input(tmp_path: Path) -> None:
    rc, out, teardown = _entry(tmp_path, ["analyze", str(tmp_path / "missing.json")])
    assert (rc, out, teardown) == (2, "", False)


def test_another_thread_alive_keeps_the_ordinary_exit(tmp_path: Path) -> None:
    """A thread left running (a library's, say) may have atexit work: the ordinary exit runs it."""
    rc, out, teardown = _entry(tmp_path, ["analyze", "--format", "json", str(TRACE)], thread=True)
    assert rc == 0 and json.loads(out) and teardown


@pytest.mark.parametrize("argv", [["--version"], ["analyze", "--help"]])
def test_other_exits_are_ordinary(tmp_path: Path, argv: list[str]) -> None:
    """--version is no command; --help exits through argparse's SystemExit before ``main`` returns."""
    rc, out, teardown = _entry(tmp_path, argv)
    assert rc == 0 and out and teardown


def test_a_stream_that_cannot_flush_keeps_the_ordinary_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast exit needs the report flushed first; a flush that fails (a closed or broken stream)
    leaves the exit to Python, which reports it, rather than losing it in ``os._exit``."""
    import io
    import os

    from stepdoctor import cli

    class Broken(io.StringIO):
        def flush(self) -> None:
            raise OSError(32, "Broken pipe")

    def no_fast_exit(code: int) -> None:
        raise AssertionError(f"os._exit({code}) after a failed flush")

    monkeypatch.setattr(os, "_exit", no_fast_exit)
    monkeypatch.setattr("sys.stdout", Broken())
    with pytest.raises(SystemExit) as ended:
        cli.finish(3, "analyze")
    assert ended.value.code == 3
