"""``stepdoctor check``: the CI gate on runs recorded by the agent (real CPU loops), their traces, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stepdoctor.cli import main
from stepdoctor.series import SeriesSettings
from stepdoctor.spool import TRACE_SUFFIX
from support.series_loops import run_loop

pytest.importorskip("stepdoctor_analysis")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs of the same loop, 5 ms and 50 ms of sleep per step (ten times apart, so a busy machine
    cannot swap them), each with its series and one trace."""
    spool = tmp_path_factory.mktemp("spool")
    settings = SeriesSettings(anomaly_capture=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("STEPDOCTOR_SERVER", raising=False)
        mp.setenv("STEPDOCTOR_RAISE_ERRORS", "1")
        run_loop(spool, "fast", 100, step_s=0.005, series_settings=settings)
        run_loop(spool, "slow", 100, step_s=0.050, series_settings=settings)
    return {name: spool / "proj" / name for name in ("fast", "slow")}


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_slower_run_fails_the_gate_and_a_faster_one_passes(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = check(capsys, str(runs["slow"]), "--baseline", str(runs["fast"]))
    assert code == 1 and out.count("\n") == 1
    assert out.startswith("stepdoctor check: REGRESSION: unprofiled steady-state median step time")
    code, out, _ = check(capsys, str(runs["fast"]), "--baseline", str(runs["slow"]))
    assert code == 0 and out.startswith("stepdoctor check: ok: unprofiled")
    code, out, _ = check(
        capsys, str(runs["slow"]), "--baseline", str(runs["fast"]), "--max-regression", "5000%"
    )
    assert code == 0  # ten times as slow is within a 5000% allowance


def test_json_gives_the_same_answer_as_data(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from stepdoctor_analysis.run.timeline import read_run_timeline

    code, out, _ = check(capsys, str(runs["slow"]), "--baseline", str(runs["fast"]), "--format", "json")
    result = json.loads(out)
    slow, fast = read_run_timeline(runs["slow"]), read_run_timeline(runs["fast"])
    assert slow is not None and fast is not None
    assert (code, result["exit_code"], result["basis"], result["regression"]) == (1, 1, "unprofiled", True)
    assert (result["candidate_ms"], result["baseline_ms"]) == (
        slow.unprofiled_median_ms,
        fast.unprofiled_median_ms,
    )
    assert result["change"] > 0.5 and result["candidate"]["steps"] == 100 and result["candidate"]["verdict"]


def test_a_tensorboard_log_folder_with_one_run_stands_for_that_run(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "logdir" / "candidate"
    run.mkdir(parents=True)
    for f in runs["slow"].iterdir():
        (run / f.name).write_bytes(f.read_bytes())
    code, out, _ = check(
        capsys, str(tmp_path / "logdir"), "--baseline", str(runs["fast"]), "--format", "json"
    )
    assert (code, json.loads(out)["basis"]) == (1, "unprofiled")


def test_two_trace_files_are_compared_on_profiled_steps_and_it_says_so(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (slow,) = runs["slow"].glob(f"*{TRACE_SUFFIX}")
    (fast,) = runs["fast"].glob(f"*{TRACE_SUFFIX}")
    code, out, _ = check(capsys, str(slow), "--baseline", str(fast), "--format", "json")
    assert (code, json.loads(out)["basis"]) == (1, "profiled")
    code, out, _ = check(capsys, str(fast), "--baseline", str(slow))
    assert code == 0 and "profiled step time (capture windows; no step series on both sides)" in out


def test_bad_input_or_nothing_comparable_exits_2_in_one_line(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (trace,) = runs["fast"].glob(f"*{TRACE_SUFFIX}")
    series_only = tmp_path / "series-only"
    series_only.mkdir()
    for f in runs["slow"].glob("*.stepdoctor.series"):
        (series_only / f.name).write_bytes(f.read_bytes())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "series-x-0000000.stepdoctor.series").write_bytes(b"SDSERIES\x01garbage")
    cases = {
        "nothing comparable": ([str(series_only), "--baseline", str(trace)], "nothing comparable"),
        "missing path": ([str(tmp_path / "nope"), "--baseline", str(trace)], "no such trace file"),
        "empty folder": ([str(tmp_path), "--baseline", str(trace)], "no trace files and no step series"),
        "bad chunk": ([str(broken), "--baseline", str(runs["fast"])], "series chunk"),
    }
    for name, (args, words) in cases.items():
        code, out, err = check(capsys, *args)
        assert (code, out) == (2, ""), name
        assert words in err and err.count("\n") == 1 and "Traceback" not in err, (name, err)
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(trace), "--baseline", str(trace), "--max-regression", "lots"])
    assert exit_info.value.code == 2 and "not a percentage" in capsys.readouterr().err


def test_the_console_script_exits_with_the_verdict(runs: dict[str, Path]) -> None:
    cmd = [sys.executable, "-m", "stepdoctor", "check", str(runs["slow"]), "--baseline", str(runs["fast"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "REGRESSION" in done.stdout, done.stderr
