"""The command line's rough edges: a typo'd team is refused, every error is one line with exit
status 2, sizes print in a unit that fits, and a size limit is named by its option."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdoctor_analysis.cli import analyze as analyze_cli
from stepdoctor_analysis.cli import trim as trim_cli
from stepdoctor_analysis.cli.analyze import byte_text
from stepdoctor_server import cli
from stepdoctor_server.core.settings import get_settings
from support.synthetic import sync_bound_trace


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The CLI (which reads the environment) on a fresh, migrated SQLite data dir."""
    monkeypatch.setenv("STEPDOCTOR_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("STEPDOCTOR_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    assert cli.main(["db", "upgrade"]) == 0
    yield tmp_path / "data"
    get_settings.cache_clear()


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_token_create_refuses_an_unknown_team_unless_asked_to_create_it(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert cli.main(["token", "create", "--team", "nosuchteam"]) == 2
    out = capsys.readouterr()
    assert _one_line(out.err) == (
        "stepdoctor token: no team named 'nosuchteam'; add --create-team to create it"
    )
    assert "sdt_" not in out.out
    assert cli.main(["token", "list", "--team", "nosuchteam"]) == 2  # nothing was kept
    capsys.readouterr()
    assert cli.main(["token", "create", "--team", "nosuchteam", "--create-team"]) == 0
    out = capsys.readouterr().out
    assert "created team 'nosuchteam'" in out and out.strip().splitlines()[-1].startswith("sdt_")
    assert cli.main(["token", "create", "--team", "nosuchteam"]) == 0  # it exists now


def test_token_revoke_of_an_unknown_id_is_one_line_and_exit_2(data_dir: Path) -> None:
    assert cli.main(["token", "create", "--team", "ops", "--create-team"]) == 0
    env = os.environ | {"STEPDOCTOR_DATA_DIR": str(data_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "stepdoctor", "token", "revoke", "999", "--team", "ops"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert done.returncode == 2
    assert _one_line(done.stderr) == "stepdoctor token: team 'ops' has no token #999"


def test_a_malformed_setting_is_one_line_and_exit_2(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEPDOCTOR_PORT", "eighty")
    get_settings.cache_clear()
    assert cli.main(["token", "list", "--team", "ops"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("stepdoctor token: invalid setting port: ")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (812, "812 B"), (24_166, "23.6 KiB"), (4_823_450, "4.6 MiB"), (1_299_227_607, "1.21 GiB")],
)
def test_byte_text_picks_the_unit_that_fits(n: int, text: str) -> None:
    assert byte_text(n) == text


def test_trim_prints_sizes_in_a_unit_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = sync_bound_trace(tmp_path / "t.json")
    dst = tmp_path / "cut.json"
    assert trim_cli.main([str(src), str(dst), "--steps", "1-2"]) == 0
    out = capsys.readouterr().out
    assert f"{byte_text(src.stat().st_size)} -> {byte_text(dst.stat().st_size)}" in out
    assert "0.0 MiB" not in out and "KiB" in out


def test_a_size_limit_error_names_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = sync_bound_trace(tmp_path / "t.json")
    dst = tmp_path / "cut.json"
    assert trim_cli.main([str(src), str(dst), "--steps", "1-2", "--max-bytes", "1KiB"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "raise --max-bytes" in err and "max_bytes" not in err.replace("--max-bytes", "")
    assert not dst.exists()
    assert analyze_cli.main([str(src), "--max-bytes", "1KiB"]) == 2
    assert "raise --max-bytes" in _one_line(capsys.readouterr().err)


def test_a_database_without_the_schema_says_to_migrate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEPDOCTOR_DATA_DIR", str(tmp_path / "fresh"))
    monkeypatch.delenv("STEPDOCTOR_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    try:
        assert cli.main(["token", "revoke", "999", "--team", "default"]) == 2
        line = _one_line(capsys.readouterr().err)
    finally:
        get_settings.cache_clear()
    assert line.startswith("stepdoctor token: database error at sqlite:")
    assert line.endswith("run `stepdoctor db upgrade` first)")


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback() -> None:
    """``stepdoctor analyze trace | head``: the report's reader leaves after a few bytes."""
    from support.fixtures import fixture

    proc = subprocess.Popen(
        [sys.executable, "-m", "stepdoctor.cli", "analyze", "--format", "json",
         str(fixture("trace_filter/sampled_rank-0.json.gz"))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10).startswith(b"{")
    proc.stdout.close()  # the reader is gone; the report is longer than a pipe holds
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


def test_a_broken_pipe_that_is_not_stdout_stays_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's socket or child pipe breaking (an upload cut off) is a failure to report, not
    the quiet exit of a reader that left: only a closed stdout gets that."""
    from stepdoctor import cli as dispatcher

    def upload_cut_off(_argv: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(dispatcher, "upload_cut_off", upload_cut_off, raising=False)
    monkeypatch.setitem(
        dispatcher.COMMANDS, "sync", dispatcher.Command("stepdoctor.cli:upload_cut_off", None, "")
    )
    with pytest.raises(BrokenPipeError):
        dispatcher.main(["sync"])
