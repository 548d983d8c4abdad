"""Reading a trace whose analysis came from an older engine queues it again (on demand)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from stepdoctor_analysis import ENGINE_VERSION
from stepdoctor_server.models import Analysis
from support.server import drain, small_trace_bytes, upload


def test_get_trace_requeues_a_report_from_an_older_engine(client: TestClient, app: FastAPI) -> None:
    trace_id = upload(client, small_trace_bytes()).json()["id"]
    assert drain(app) == 1
    current = client.get(f"/api/v1/traces/{trace_id}").json()
    assert current["status"] == "done" and current["stale"] is False
    assert drain(app) == 0, "a current report must not be redone"

    with app.state.db.session() as session:
        session.execute(
            update(Analysis).where(Analysis.trace_id == trace_id).values(engine_version="0.0.0-old")
        )
    stale = client.get(f"/api/v1/traces/{trace_id}").json()
    assert stale["stale"] is True and stale["status"] == "pending"
    assert stale["analysis"] is not None, "the old report stays visible while it is redone"
    assert drain(app) == 1
    fresh = client.get(f"/api/v1/traces/{trace_id}").json()
    assert fresh["stale"] is False and fresh["status"] == "done"
    assert fresh["analysis"]["engine_version"] == ENGINE_VERSION
