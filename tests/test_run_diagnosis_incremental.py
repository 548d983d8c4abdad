"""The server's run diagnosis folded from stored per-trace summaries equals the verdict over every
stored report (``runs.diagnosis.aggregate_run``, the from-scratch path): after the first refresh,
a late rank, a re-analysis that creates a straggler, a deleted trace, and with summaries missing
(an older engine's analyses) or of another layout; each analysis gets exactly one summary row."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select, update

from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_server.core.models import Analysis, Run, Trace, TraceSummaryRecord
from stepdoctor_server.jobs.claims import SqlJobQueue
from stepdoctor_server.jobs.pool import process_one
from stepdoctor_server.runs import diagnosis_job
from stepdoctor_server.runs.diagnosis import StoredTrace, aggregate_run
from stepdoctor_server.runs.diagnosis_job import refresh_run_diagnosis
from support.many_ranks import many_rank_run, rank_report
from support.server import synthetic_trace, upload

RANKS = 24


def _stored(app: FastAPI, run_id: int) -> dict[str, Any]:
    with app.state.db.session() as session:
        diagnosis = session.scalar(select(Run.diagnosis).where(Run.id == run_id))
    assert diagnosis is not None
    return {k: v for k, v in diagnosis.items() if k != "computed_at"}


def _scratch(app: FastAPI, run_id: int) -> dict[str, Any]:
    """The verdict over every stored report of the run, as the server computed it before summaries."""
    with app.state.db.session() as session:
        rows = session.execute(
            select(Trace.id, Trace.rank, Trace.window_index, Trace.meta, Analysis.report)
            .join(Analysis, Analysis.trace_id == Trace.id)
            .where(Trace.run_id == run_id)
            .order_by(Trace.id)
        ).all()
        counts = dict(
            session.execute(
                select(Trace.status, func.count()).where(Trace.run_id == run_id).group_by(Trace.status)
            ).all()
        )
    verdict = aggregate_run(
        [StoredTrace(*r) for r in rows],
        failed=counts.get("failed", 0),
        pending=counts.get("pending", 0) + counts.get("running", 0),
    )
    out: dict[str, Any] = msgspec.to_builtins(verdict)
    out.pop("computed_at")
    return out


def _refresh(app: FastAPI, run_id: int) -> None:
    with app.state.db.session() as session:
        refresh_run_diagnosis(session, run_id)


def _analysis(trace_id: int, rank: int, slow: float = 0.0) -> Analysis:
    return Analysis(
        trace_id=trace_id,
        engine_version=ENGINE_VERSION,
        schema_version=SCHEMA_VERSION,
        primary_kind="compute",
        primary_share=0.6,
        report=rank_report(rank, slow=slow),
        duration_ms=1,
    )


def _summary_rows(app: FastAPI, run_id: int) -> tuple[int, int]:
    with app.state.db.session() as session:
        rows = session.scalar(select(func.count()).where(TraceSummaryRecord.run_id == run_id))
        analyses = session.scalar(
            select(func.count()).select_from(Analysis).join(Trace).where(Trace.run_id == run_id)
        )
    return int(rows or 0), int(analyses or 0)


def test_run_diagnosis_from_summaries_equals_the_verdict_over_every_report(
    app: FastAPI, client: TestClient
) -> None:
    run = many_rank_run(app, client, RANKS, straggler=-1)  # no straggler yet
    first = _stored(app, run.run_id)
    assert first == _scratch(app, run.run_id) and first["stragglers"] == []
    assert _summary_rows(app, run.run_id) == (RANKS, RANKS)

    # a late rank
    with app.state.db.session() as session:
        team_id = session.scalar(select(Trace.team_id).where(Trace.id == run.trace_ids[0]))
        late = Trace(
            team_id=team_id,
            run_id=run.run_id,
            rank=RANKS,
            window_index=0,
            size_bytes=1,
            sha256="0" * 64,
            storage_key=f"late/{run.run_id}",
            filename="late.json.gz",
            meta={"host": "node-late", "pid": 7},
            status="done",
        )
        session.add(late)
        session.flush()
        session.add(_analysis(late.id, RANKS))
    _refresh(app, run.run_id)
    assert _stored(app, run.run_id) == _scratch(app, run.run_id)
    assert _stored(app, run.run_id)["traces"] == RANKS + 1

    # rank 7 re-analysed (a new analysis row, as the worker writes it): now it is the straggler
    with app.state.db.session() as session:
        session.execute(delete(Analysis).where(Analysis.trace_id == run.trace_ids[7]))
        session.add(_analysis(run.trace_ids[7], 7, slow=0.3))
    _refresh(app, run.run_id)
    again = _stored(app, run.run_id)
    assert again == _scratch(app, run.run_id)
    assert [s["rank"] for s in again["stragglers"]] == [7]
    assert _summary_rows(app, run.run_id) == (RANKS + 1, RANKS + 1)

    # a trace deleted
    with app.state.db.session() as session:
        session.execute(delete(Trace).where(Trace.id == run.trace_ids[3]))
    _refresh(app, run.run_id)
    assert _stored(app, run.run_id) == _scratch(app, run.run_id)
    assert _stored(app, run.run_id)["traces"] == RANKS


def test_missing_or_other_layout_summaries_are_made_from_the_reports(
    app: FastAPI, client: TestClient
) -> None:
    run = many_rank_run(app, client, 12, straggler=5)
    expected = _stored(app, run.run_id)
    # an older engine's analyses: no summary rows; a fresh process: nothing held
    with app.state.db.session() as session:
        session.execute(delete(TraceSummaryRecord).where(TraceSummaryRecord.run_id == run.run_id))
    diagnosis_job._HELD.clear()
    _refresh(app, run.run_id)
    assert _stored(app, run.run_id) == expected
    assert _summary_rows(app, run.run_id) == (12, 12)
    # one summary of another layout: rebuilt from its report, the verdict unchanged
    with app.state.db.session() as session:
        session.execute(
            update(TraceSummaryRecord)
            .where(TraceSummaryRecord.trace_id == run.trace_ids[5])
            .values(summary=b'{"summary_version": 0}')
        )
    diagnosis_job._HELD.clear()
    _refresh(app, run.run_id)
    assert _stored(app, run.run_id) == expected
    assert [s["rank"] for s in expected["stragglers"]] == [5]
    with app.state.db.session() as session:
        data = session.scalar(
            select(TraceSummaryRecord.summary).where(TraceSummaryRecord.trace_id == run.trace_ids[5])
        )
    assert data is not None and b'"summary_version":0' not in data
    # a report that no longer decodes: counted outdated, like before summaries
    with app.state.db.session() as session:
        session.execute(
            update(Analysis).where(Analysis.trace_id == run.trace_ids[2]).values(report={"not": "a report"})
        )
        session.execute(delete(TraceSummaryRecord).where(TraceSummaryRecord.trace_id == run.trace_ids[2]))
    _refresh(app, run.run_id)
    assert _stored(app, run.run_id) == _scratch(app, run.run_id)
    assert _stored(app, run.run_id)["outdated"] == 1


def test_a_finished_traces_summary_is_stored_before_the_runs_verdict_is_due(
    app: FastAPI, client: TestClient
) -> None:
    """While other traces of the run wait and the verdict is not due (``diagnosis_due``), the trace
    that just finished still gets its summary, made from the report it just stored."""
    ids = [upload(client, synthetic_trace(), run="spread", rank=r).json()["id"] for r in range(3)]
    queue = SqlJobQueue(app.state.db)
    settings = app.state.settings

    def one() -> None:
        assert process_one(app.state.db, queue, app.state.store, settings, "test:1:0")

    one()  # the first: no verdict yet, so it is due
    run_id = client.get(f"/api/v1/traces/{ids[0]}").json()["run_id"]
    assert _stored(app, run_id)["traces"] == 1
    one()  # the second, within DIAGNOSIS_MIN_INTERVAL with one still pending: summary only
    assert _summary_rows(app, run_id) == (2, 2)
    assert _stored(app, run_id)["traces"] == 1
    one()  # the last always refreshes
    assert _stored(app, run_id)["traces"] == 3
    assert _summary_rows(app, run_id) == (3, 3)
    assert _stored(app, run_id) == _scratch(app, run_id)
