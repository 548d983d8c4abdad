"""Regressions on the server: a run against its project's baseline (a chosen run, else the median
of its last finished runs), flagged with the numbers on the API, the run page and the run list;
computed by the run-diagnosis job (``runs.regressions``), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from stepdoctor_server.core.models import Project, Run
from stepdoctor_server.core.settings import Settings
from support.regressions import recorded_run
from support.server import TeamInfo, bearer, logged_in


@pytest.fixture
def server_settings(server_settings: Settings) -> Settings:
    return server_settings.model_copy(update={"baseline_runs": 3})


def regression(client: TestClient, run_id: int) -> dict[str, Any]:
    resp = client.get(f"/api/v1/runs/{run_id}")
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()["regression"]
    return out


def project_id(app: FastAPI, team: TeamInfo, name: str) -> int:
    with app.state.db.session() as session:
        found = session.scalar(select(Project.id).where(Project.team_id == team.id, Project.name == name))
        assert found is not None
        return int(found)


def test_a_run_slower_than_its_baseline_beyond_the_threshold_is_flagged_with_the_numbers(
    app: FastAPI, team: TeamInfo, client: TestClient, admin_token: str
) -> None:
    base = recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    slow = recorded_run(app, team.id, "proj", "slow", step_ms=112.0)
    first = regression(client, base)
    assert not first["regressed"] and first["note"].startswith("no baseline yet")
    r = regression(client, slow)
    assert r["regressed"] and r["reasons"] == ["step_time"]
    c = r["comparison"]
    assert (c["basis"], c["candidate_ms"], c["baseline_ms"], c["change"]) == ("profiled", 112.0, 100.0, 0.12)
    assert r["baseline"]["kind"] == "median" and r["baseline"]["names"] == ["base"]
    # The same status in the run list of the API, on the run page and in the project's run list.
    listed = {i["id"]: i["regression"] for i in client.get("/api/v1/runs?project=proj").json()["items"]}
    assert listed[slow] == r and not listed[base]["regressed"]
    pages = logged_in(app, admin_token)
    page = pages.get(f"/runs/{slow}").text
    assert 'id="regression"' in page and "Regressed" in page
    assert "112.00 ms vs baseline 100.00 ms (+12.0%, limit +5.0%)" in page
    assert (
        "profiled step time (capture windows" in page
        and "the median of the last 1 finished run(s) (base)" in page
    )
    listing = pages.get(f"/projects/{project_id(app, team, 'proj')}").text
    assert listing.count("regressed: ") == 1
    assert (
        "regressed: profiled (capture windows) step time 112.00 ms vs baseline 100.00 ms (+12.0%" in listing
    )


def test_a_run_within_the_threshold_is_not_flagged(app: FastAPI, team: TeamInfo, client: TestClient) -> None:
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    near = recorded_run(app, team.id, "proj", "near", step_ms=104.0)
    r = regression(client, near)
    assert not r["regressed"] and r["reasons"] == []
    assert (r["comparison"]["candidate_ms"], r["comparison"]["change"]) == (104.0, 0.04)
    pages = logged_in(app, client.headers["Authorization"].removeprefix("Bearer "))
    assert "regressed: " not in pages.get(f"/projects/{project_id(app, team, 'proj')}").text
    assert "No regression" in pages.get(f"/runs/{near}").text


def test_a_changed_verdict_kind_is_flagged_even_at_the_same_step_time(
    app: FastAPI, team: TeamInfo, client: TestClient, admin_token: str
) -> None:
    recorded_run(app, team.id, "proj", "base", step_ms=100.0, kind="compute")
    other = recorded_run(app, team.id, "proj", "input", step_ms=100.0, kind="input")
    r = regression(client, other)
    assert r["regressed"] and r["reasons"] == ["verdict"]
    c = r["comparison"]
    assert (c["baseline_verdict"], c["candidate_verdict"], c["verdict_changed"], c["change"]) == (
        "compute",
        "input",
        True,
        0.0,
    )
    page = logged_in(app, admin_token).get(f"/runs/{other}").text
    assert "The verdict changed from compute to input." in page


def test_the_baseline_is_the_median_of_the_last_finished_runs(
    app: FastAPI, team: TeamInfo, client: TestClient
) -> None:
    """``baseline_runs`` = 3: the oldest run and the unfinished one (a trace still waiting) are left out."""
    recorded_run(app, team.id, "proj", "old", step_ms=500.0)
    for name, ms in (("a", 100.0), ("b", 300.0), ("c", 110.0)):
        recorded_run(app, team.id, "proj", name, step_ms=ms)
    recorded_run(app, team.id, "proj", "waiting", step_ms=900.0, pending=True)
    run = recorded_run(app, team.id, "proj", "new", step_ms=114.0)
    r = regression(client, run)
    assert r["baseline"]["kind"] == "median" and r["baseline"]["names"] == ["c", "b", "a"]
    assert (r["comparison"]["baseline_ms"], r["comparison"]["change"], r["regressed"]) == (
        110.0,
        0.0364,
        False,
    )
    other = recorded_run(app, team.id, "other-project", "new", step_ms=1000.0)
    assert regression(client, other)["baseline"] is None  # another project's runs are not its baseline


def test_a_crashed_run_is_not_in_the_median_baseline(
    app: FastAPI, team: TeamInfo, client: TestClient
) -> None:
    """A run whose series ended with an exit chunk saying the loop raised is ``stopped`` by the
    run's liveness (``series.liveness_of``), not finished: the median leaves it out."""
    from stepdoctor_server.runs.series import liveness_of

    recorded_run(app, team.id, "proj", "a", step_ms=100.0, series_ms=50.0)
    crashed = recorded_run(app, team.id, "proj", "crashed", step_ms=100.0, series_ms=500.0, crashed=True)
    with app.state.db.session() as session:
        assert liveness_of(session, crashed) == "stopped"
    assert not regression(client, crashed)["finished"]
    run = recorded_run(app, team.id, "proj", "new", step_ms=100.0, series_ms=52.0)
    r = regression(client, run)
    assert r["baseline"]["names"] == ["a"] and r["comparison"]["baseline_ms"] == 50.0


def test_the_unprofiled_steady_state_is_the_basis_when_both_runs_have_a_series(
    app: FastAPI, team: TeamInfo, client: TestClient, admin_token: str
) -> None:
    """Profiled steps are equal (100 ms); the steps users pay for went from 50 to 60 ms."""
    recorded_run(app, team.id, "proj", "base", step_ms=100.0, series_ms=50.0)
    run = recorded_run(app, team.id, "proj", "new", step_ms=100.0, series_ms=60.0)
    r = regression(client, run)
    c = r["comparison"]
    assert (c["basis"], c["candidate_ms"], c["baseline_ms"], r["regressed"]) == (
        "unprofiled",
        60.0,
        50.0,
        True,
    )
    page = logged_in(app, admin_token).get(f"/runs/{run}").text
    assert "Basis: unprofiled steady-state median step time" in page


def test_a_chosen_baseline_is_set_over_the_api_and_the_statuses_are_redone(
    app: FastAPI, team: TeamInfo, client: TestClient, make_token: Callable[..., str]
) -> None:
    fast = recorded_run(app, team.id, "proj", "fast", step_ms=50.0)
    recorded_run(app, team.id, "proj", "mid", step_ms=100.0)
    recorded_run(app, team.id, "proj", "mid2", step_ms=100.0)
    new = recorded_run(app, team.id, "proj", "new", step_ms=100.0)
    assert not regression(client, new)["regressed"]  # against the median of 50, 100 and 100 ms
    pid = project_id(app, team, "proj")
    read = bearer(make_token("read"))
    refused = client.put(f"/api/v1/projects/{pid}/baseline", json={"run_id": fast}, headers=read)
    assert refused.status_code == 403
    resp = client.put(
        f"/api/v1/projects/{pid}/baseline", json={"run_id": fast}, headers=bearer(make_token("upload"))
    )
    assert resp.status_code == 200, resp.text
    assert (
        resp.json()["kind"] == "chosen" and resp.json()["run_id"] == fast and new in resp.json()["recomputed"]
    )
    r = regression(client, new)
    assert r["regressed"] and r["baseline"]["kind"] == "chosen" and r["baseline"]["names"] == ["fast"]
    assert (r["comparison"]["baseline_ms"], r["comparison"]["change"]) == (50.0, 1.0)
    assert regression(client, fast)["baseline"] is None  # the baseline itself is compared with nothing
    assert client.get(f"/api/v1/projects/{pid}/baseline", headers=read).json()["run_name"] == "fast"
    elsewhere = recorded_run(app, team.id, "other", "x", step_ms=1.0)
    bad = client.put(f"/api/v1/projects/{pid}/baseline", json={"run_id": elsewhere})
    assert bad.status_code == 422 and "not a run of project proj" in bad.json()["error"]["message"]
    assert client.put(f"/api/v1/projects/{pid}/baseline").status_code == 422  # no body
    assert client.put("/api/v1/projects/999999/baseline", json={"run_id": fast}).status_code == 404
    back = client.put(f"/api/v1/projects/{pid}/baseline", json={"run_id": None})
    assert back.json()["kind"] == "median" and not regression(client, new)["regressed"]


def test_the_run_page_form_chooses_the_baseline(
    app: FastAPI, team: TeamInfo, client: TestClient, admin_token: str
) -> None:
    fast = recorded_run(app, team.id, "proj", "fast", step_ms=50.0)
    recorded_run(app, team.id, "proj", "mid", step_ms=150.0)
    new = recorded_run(app, team.id, "proj", "new", step_ms=100.0)
    pages = logged_in(app, admin_token)
    assert f'action="/runs/{fast}/baseline"' in pages.get(f"/runs/{fast}").text
    resp = pages.post(
        f"/runs/{fast}/baseline",
        content="action=set",
        headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://testserver"},
        follow_redirects=False,
    )
    assert resp.status_code == 303 and resp.headers["location"] == f"/runs/{fast}#regression"
    assert "This run is the project's baseline." in pages.get(f"/runs/{fast}").text
    assert regression(client, new)["baseline"]["names"] == ["fast"] and regression(client, new)["regressed"]
    cross = pages.post(
        f"/runs/{fast}/baseline",
        content="action=clear",
        headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": "https://evil.example"},
        follow_redirects=False,
    )
    assert cross.status_code == 403
    assert regression(client, new)["baseline"]["kind"] == "chosen"  # nothing changed


def test_reading_pages_and_the_api_never_writes_a_status(
    app: FastAPI, team: TeamInfo, client: TestClient
) -> None:
    """The status is the job's: a run whose stored status is cleared stays without one however
    often it is read."""
    run = recorded_run(app, team.id, "proj", "a", step_ms=100.0)
    with app.state.db.session() as session:
        session.get(Run, run).regression = None
    client.get(f"/api/v1/runs/{run}")
    client.get("/api/v1/runs")
    with app.state.db.session() as session:
        assert session.scalar(select(Run.regression).where(Run.id == run)) is None


def test_a_series_that_changes_without_a_new_diagnosis_is_rechecked_by_the_sweep(
    app: FastAPI, team: TeamInfo, client: TestClient
) -> None:
    """The run's status was computed on profiled steps (no series yet); its series arrives later:
    the workers' sweep redoes it on the unprofiled basis, once."""
    from stepdoctor_server.jobs.defer import SWEEPS
    from stepdoctor_server.runs.regressions import recheck_series_now
    from stepdoctor_server.runs.series import store_chunk
    from support.regressions import series_chunk

    assert recheck_series_now in SWEEPS
    recorded_run(app, team.id, "proj", "base", step_ms=100.0, series_ms=50.0)
    run = recorded_run(app, team.id, "proj", "new", step_ms=100.0)
    assert regression(client, run)["comparison"]["basis"] == "profiled"
    assert not regression(client, run)["regressed"]
    with app.state.db.session() as session:
        found = session.get(Run, run)
        assert found is not None
        store_chunk(session, found, series_chunk(200, 60.0))
    assert recheck_series_now(app.state.db) == [run]
    r = regression(client, run)
    assert (r["comparison"]["basis"], r["comparison"]["candidate_ms"], r["regressed"]) == (
        "unprofiled",
        60.0,
        True,
    )
    assert recheck_series_now(app.state.db) == []  # nothing new: nothing redone
