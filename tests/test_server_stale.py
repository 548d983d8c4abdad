"""Is this stale? One owner (``reports.is_stale``): the API and the pages flag a report from an older
engine the same way, reading writes nothing, and the re-analysis is a job of its own
(``runs.diagnosis_job.requeue_outdated``, the workers' sweep)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from stepdoctor_analysis import ENGINE_VERSION
from stepdoctor_server.core.models import Analysis, Run, Trace
from stepdoctor_server.runs.diagnosis_job import requeue_outdated_now
from support.server import drain, logged_in, small_trace_bytes, upload


def _trace_row(app: FastAPI, trace_id: int) -> tuple[str, object, int]:
    with app.state.db.session() as session:
        trace = session.get(Trace, trace_id)
        assert trace is not None
        return trace.status, trace.updated_at, trace.attempts


def test_a_stale_report_is_flagged_on_every_surface_and_redone_by_the_sweep(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    trace_id = upload(client, small_trace_bytes()).json()["id"]
    assert drain(app) == 1
    current = client.get(f"/api/v1/traces/{trace_id}").json()
    assert current["status"] == "done" and current["stale"] is False
    run_id = current["run_id"]
    assert requeue_outdated_now(app.state.db) == [], "a current report must not be redone"

    with app.state.db.session() as session:
        session.execute(
            update(Analysis).where(Analysis.trace_id == trace_id).values(engine_version="0.0.0-old")
        )
    before = _trace_row(app, trace_id)
    pages = logged_in(app, read_token)
    stale = client.get(f"/api/v1/traces/{trace_id}").json()
    report = client.get(f"/api/v1/traces/{trace_id}/report").json()
    run = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()
    page = pages.get(f"/traces/{trace_id}").text
    run_page = pages.get(f"/runs/{run_id}").text
    assert stale["stale"] is True and report["stale"] is True and run["stale"] is True
    assert 'id="stale"' in page and 'id="stale"' in run_page
    assert stale["analysis"] is not None, "the old report stays visible until it is redone"
    # Reading wrote nothing: the trace is still done, untouched.
    assert _trace_row(app, trace_id) == before and stale["status"] == "done"
    assert drain(app) == 0

    assert requeue_outdated_now(app.state.db) == [trace_id]
    assert drain(app) == 1
    fresh = client.get(f"/api/v1/traces/{trace_id}").json()
    assert fresh["stale"] is False and fresh["status"] == "done"
    assert fresh["analysis"]["engine_version"] == ENGINE_VERSION
    assert client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["stale"] is False
    assert 'id="stale"' not in pages.get(f"/traces/{trace_id}").text


def test_a_run_diagnosis_of_an_older_layout_is_stale_and_rebuilt_by_the_sweep(
    client: TestClient, app: FastAPI
) -> None:
    trace_id = upload(client, small_trace_bytes()).json()["id"]
    assert drain(app) == 1
    run_id = client.get(f"/api/v1/traces/{trace_id}").json()["run_id"]
    with app.state.db.session() as session:
        session.execute(update(Run).where(Run.id == run_id).values(diagnosis={"traces": 1, "primary": "x"}))
    assert client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["stale"] is True
    assert client.get(f"/api/v1/compare?base={run_id}&other={run_id}").status_code == 409
    requeue_outdated_now(app.state.db)
    with app.state.db.session() as session:
        rebuilt = session.scalar(select(Run.diagnosis).where(Run.id == run_id))
    assert rebuilt["diagnosis_version"] >= 2 and rebuilt["traces"] == 1
    assert client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["stale"] is False
