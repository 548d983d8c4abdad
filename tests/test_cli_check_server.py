"""``stepdoctor check --server``: runs named ``project/run`` read from a real running server
(``stepdoctor serve`` in a subprocess) with recorded runs, mixed with a local run recorded by the
agent in a real CPU loop; exit codes 0, 1 and 2, the JSON twin, and network and auth errors."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import delete, select, update

from stepdoctor.cli import main
from stepdoctor.series import SeriesSettings
from stepdoctor_server.auth import tokens as auth
from stepdoctor_server.core.models import Analysis, Run, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app
from support.regressions import recorded_run
from support.series_loops import run_loop
from support.server import migrated_sqlite_env, serve_subprocess


@dataclass(frozen=True)
class Served:
    url: str
    token: str
    local: Path  # a run recorded by the agent: ~5 ms steps


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server whose project ``proj`` holds ``fast`` (50 ms steady steps), ``slow`` (60 ms),
    ``tiny`` (1 ms) and ``empty`` (nothing analysed, no series), recorded through the server's
    own diagnosis job; and a local run of a real CPU loop."""
    data = tmp_path_factory.mktemp("check-server")
    env = migrated_sqlite_env(data / "data")
    app = create_app(Settings(data_dir=data / "data", workers=0))
    try:
        with app.state.db.session() as session:
            team, _ = auth.get_or_create_team(session, "default")
            team_id = team.id
            _, token = auth.create_token(session, team, scope="read", name="ci")
        recorded_run(app, team_id, "proj", "fast", step_ms=100.0, series_ms=50.0)
        recorded_run(app, team_id, "proj", "slow", step_ms=100.0, series_ms=60.0)
        recorded_run(app, team_id, "proj", "tiny", step_ms=2.0, series_ms=1.0)
        recorded_run(app, team_id, "proj", "empty", step_ms=1.0, pending=True)
        with app.state.db.session() as session:
            empty = session.scalar(select(Run.id).where(Run.name == "empty"))
            done = select(Trace.id).where(Trace.run_id == empty, Trace.status == "done")
            session.execute(delete(Analysis).where(Analysis.trace_id.in_(done)))
            session.execute(delete(Trace).where(Trace.id.in_(done)))
            session.execute(update(Run).where(Run.id == empty).values(diagnosis=None))
    finally:
        app.state.db.dispose()
    spool = data / "spool"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("STEPDOCTOR_SERVER", raising=False)
        mp.setenv("STEPDOCTOR_RAISE_ERRORS", "1")
        run_loop(spool, "local", 100, step_s=0.005, series_settings=SeriesSettings(anomaly_capture=False))
    with serve_subprocess(env) as server:
        yield Served(url=server.url, token=token, local=spool / "proj" / "local")


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_server_runs_pass_and_fail_the_gate(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPDOCTOR_TOKEN", served.token)
    code, out, err = check(capsys, "proj/slow", "--baseline", "proj/fast", "--server", served.url)
    assert (code, err) == (1, "") and out.count("\n") == 1
    assert out.startswith(
        "stepdoctor check: REGRESSION: unprofiled steady-state median step time 60.00 ms vs baseline 50.00 ms (+20.0%"
    )
    code, out, _ = check(capsys, "proj/fast", "--baseline", "proj/slow", "--server", served.url)
    assert code == 0 and out.startswith("stepdoctor check: ok: unprofiled")
    code, out, _ = check(
        capsys, "proj/slow", "--baseline", "proj/fast", "--server", served.url, "--max-regression", "25%"
    )
    assert code == 0


def test_json_gives_the_same_answer_as_data(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("proj/slow", "--baseline", "proj/fast", "--server", served.url, "--token", served.token)
    code, out, _ = check(capsys, *args, "--format", "json")
    result = json.loads(out)
    assert (code, result["exit_code"], result["basis"], result["regression"]) == (1, 1, "unprofiled", True)
    assert (result["candidate_ms"], result["baseline_ms"], result["change"]) == (60.0, 50.0, 0.2)
    assert result["candidate"] == {
        "source": "proj/slow",
        "unprofiled_median_ms": 60.0,
        "profiled_ms": 100.0,
        "verdict": "compute",
        "steps": 200,
    }


def test_a_local_candidate_against_a_server_baseline(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local loop's steps (~5 ms) against the server's 50 ms run pass, against its 1 ms run fail."""
    token = ("--server", served.url, "--token", served.token)
    code, out, _ = check(capsys, str(served.local), "--baseline", "proj/fast", *token, "--format", "json")
    result = json.loads(out)
    assert (code, result["basis"], result["baseline"]["source"]) == (0, "unprofiled", "proj/fast")
    assert result["candidate"]["source"] == str(served.local) and result["candidate"]["steps"] == 100
    code, out, _ = check(capsys, str(served.local), "--baseline", "proj/tiny", *token)
    assert code == 1 and "REGRESSION" in out


def test_bad_token_unknown_run_nothing_comparable_and_no_server_are_one_line_and_exit_2(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEPDOCTOR_TOKEN", raising=False)
    cases = {
        "bad token": (
            ["--token", "sdt_not-a-token"],
            "proj/slow",
            "HTTP 401: invalid, expired or revoked token",
        ),
        "no token": ([], "proj/slow", "HTTP 401: missing bearer token"),
        "unknown run": (["--token", served.token], "proj/nope", "HTTP 404: run proj/nope not found"),
        "empty run": (["--token", served.token], "proj/empty", "nothing comparable: proj/slow has"),
    }
    for name, (extra, baseline, message) in cases.items():
        code, out, err = check(capsys, "proj/slow", "--baseline", baseline, "--server", served.url, *extra)
        assert (code, out) == (2, ""), name
        assert err.count("\n") == 1 and message in err, (name, err)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    code, out, err = check(capsys, "proj/slow", "--baseline", "proj/fast", "--server", closed, "--token", "t")
    assert (code, out) == (2, "") and err.count("\n") == 1 and "cannot reach the server" in err
    code, _, err = check(
        capsys, "proj/slow", "--baseline", "proj/fast", "--server", "ftp://x", "--token", "t"
    )
    assert code == 2 and "--server must be an http:// or https:// URL" in err
    # Without --server, project/run is a local path as before.
    code, _, err = check(capsys, "proj/slow", "--baseline", "proj/fast")
    assert code == 2 and "proj/slow: no such trace file or run directory" in err


def test_check_and_the_servers_regression_flag_agree(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """``slow``'s baseline on the server is the median of the runs before it (``fast`` alone): the
    server's stored comparison and ``check``'s are the engine's one answer."""
    import httpx

    runs = httpx.get(
        f"{served.url}/api/v1/runs",
        params={"project": "proj"},
        headers={"Authorization": f"Bearer {served.token}"},
    ).json()["items"]
    server = next(r for r in runs if r["name"] == "slow")["regression"]
    assert server["baseline"]["names"] == ["fast"] and server["regressed"]
    args = ("proj/slow", "--baseline", "proj/fast", "--server", served.url, "--token", served.token)
    code, out, _ = check(capsys, *args, "--format", "json")
    result = json.loads(out)
    keys = (
        "basis",
        "candidate_ms",
        "baseline_ms",
        "change",
        "max_regression",
        "regression",
        "verdict_changed",
    )
    assert {k: result[k] for k in keys} == {k: server["comparison"][k] for k in keys}
    assert code == 1
