"""``stepdoctor analyze``: text and JSON output, and one clear line (exit 2) for every bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stepdoctor_analysis.cli import analyze as cli
from support import synthetic


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.pageable_transfer_trace(tmp_path_factory.mktemp("cli") / "rank0.json.gz")


def test_text_report_names_bottleneck_and_next_change(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([str(trace)]) == 0
    out = capsys.readouterr()
    assert "Primary bottleneck: TRANSFER" in out.out
    assert "Next optimization:" in out.out and "pin_memory=True" in out.out
    for key in ("kernel", "memcpy", "dataloader", "cpu_exec", "other"):
        assert f"\n  {key} " in out.out
    assert out.err == ""  # fast runs show no progress line


def test_json_report(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(trace), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["primary"]["kind"] == "transfer"
    assert d["recommendations"][0]["id"] == "transfer.pinned_memory"
    assert len(d["breakdown"]) == 8


def _bad_inputs(tmp: Path, good: Path) -> dict[str, tuple[Path, list[str]]]:
    (tmp / "notjson.json").write_text("this is not json {")
    full = gzip.compress(json.dumps(synthetic.TraceBuilder().to_dict() | {"pad": "x" * 5000}).encode())
    (tmp / "truncated.json.gz").write_bytes(full[: len(full) // 2])
    (tmp / "noevents.json").write_text(json.dumps({"schemaVersion": 1, "deviceProperties": []}))
    (tmp / "empty.json").write_bytes(b"")
    (tmp / "list.json").write_text("[1, 2, 3]")
    ranked = synthetic.exposed_nccl_trace(tmp / "rank0.json", steps=2, rank=0)
    return {
        "not json": (tmp / "notjson.json", []),
        "truncated gzip": (tmp / "truncated.json.gz", []),
        "no traceEvents": (tmp / "noevents.json", []),
        "empty": (tmp / "empty.json", []),
        "not an object": (tmp / "list.json", []),
        "missing": (tmp / "missing.json", []),
        "over --max-bytes": (good, ["--max-bytes", "1000"]),
        "unknown rank": (ranked, ["--rank", "7"]),
    }


def test_bad_inputs_exit_2_with_one_line(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for label, (path, extra) in _bad_inputs(tmp_path, trace).items():
        code = cli.main([str(path), *extra])
        out = capsys.readouterr()
        assert code == 2, label
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stepdoctor analyze: "), (label, out.err)
        assert "Traceback" not in out.err and out.out == "", label


def test_console_script_bad_input_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    proc = subprocess.run(
        [sys.executable, "-m", "stepdoctor", "analyze", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_engine_bug_is_one_line_exit_1(
    trace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import stepdoctor_analysis.pipeline as pipeline

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(pipeline, "analyze_path", boom)
    assert cli.main([str(trace)]) == 1
    err = capsys.readouterr().err
    assert "internal error" in err and "kaboom" in err and len(err.strip().splitlines()) == 1


def test_progress_shown_for_slow_runs() -> None:
    import io
    import time

    stream = io.StringIO()
    with cli._Progress(stream, delay=0.05) as progress:
        progress("loading big.json")
        time.sleep(0.2)
    assert "stepdoctor: loading big.json" in stream.getvalue()
    quiet = io.StringIO()
    with cli._Progress(quiet, delay=5):
        pass
    assert quiet.getvalue() == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4000000000", 4 * 10**9), ("4e9", 4 * 10**9), ("500MB", 5 * 10**8), ("4GiB", 4 * 2**30)],
)
def test_max_bytes_accepts_sizes_as_people_write_them(text: str, expected: int) -> None:
    assert cli.byte_size(text) == expected


def test_max_bytes_in_human_units_caps_the_trace(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trace.stat().st_size > 2**10
    assert cli.main([str(trace), "--max-bytes", "1KiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "1,024 byte limit" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(trace), "--max-bytes", "lots"])
    assert exit_info.value.code == 2
    assert "not a size: 'lots'" in capsys.readouterr().err


# Modules a plain ``stepdoctor analyze TRACE`` must not import: the directory/job analysis, HTA's
# deep analyses, the server, and the agent's logging setup. Import only what a command uses.
NOT_FOR_ONE_TRACE = (
    "logging",
    "socket",
    "tempfile",  # with importlib.resources: the guide's text is read only where it is shown
    "importlib.resources",
    "stepdoctor_analysis.run.ranks",
    "stepdoctor_analysis.run.job",
    "stepdoctor_analysis.analyzers.deep",
    "stepdoctor_server",
    "hta",
    "pandas",
)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_analyze_imports_only_what_one_trace_needs(trace: Path, fmt: str) -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from stepdoctor.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main(['analyze', '--format', {fmt!r}, sys.argv[1]])\n"
        "print(json.dumps({'rc': rc, 'modules': sorted(sys.modules)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(trace)], capture_output=True, text=True, timeout=120
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, out.stderr
    loaded = [m for m in got["modules"] if m.split(".")[0] in NOT_FOR_ONE_TRACE or m in NOT_FOR_ONE_TRACE]
    assert loaded == []
