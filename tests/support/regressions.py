"""Recorded runs for the regression tests: a run with an analysed trace of a given step time and
verdict (and, optionally, a step series), its diagnosis built by the real run-diagnosis job."""

from __future__ import annotations

import array
import time
import uuid
from typing import Any

from fastapi import FastAPI
from sqlalchemy import select

from stepdoctor.series import encode_chunk
from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
from stepdoctor_server.core.models import Analysis, Project, Run, Trace
from stepdoctor_server.runs.diagnosis_job import refresh_run_diagnosis
from stepdoctor_server.runs.series import store_chunk
from support.reports import report


def series_chunk(
    steps: int, wall_ms: float, *, profiled: tuple[int, int] | None = None, clean: bool = True
) -> bytes:
    """One final chunk of ``steps`` steps of ``wall_ms`` each (profiled ones 3x slower), by the
    agent's own encoder; ``clean=False``: the loop raised (a crashed run)."""
    walls = [int(wall_ms * 1e6)] * steps
    if profiled is not None:
        for i in range(profiled[0], profiled[1] + 1):
            walls[i] *= 3
    header = {
        "format": 1,
        "kind": "stepdoctor.series",
        "stream": uuid.uuid4().hex[:12],
        "seq": 0,
        "rank": 0,
        "first_step": 0,
        "count": steps,
        "t_end": time.time(),
        "final": True,
        "clean_exit": clean,
        "anomaly": {"k": 1.5, "window": 50, "warmup": 5, "min_ms": 1.0},
        "profiled": [list(profiled)] if profiled else [],
        "windows": [{"first_step": profiled[0], "last_step": profiled[1], "reason": "schedule"}]
        if profiled
        else [],
        "anomalies": [],
    }
    columns = [
        ("wall_ns", array.array("q", walls)),
        ("data_ns", array.array("q", [-1] * steps)),
        ("mem_step", array.array("q", [])),
        ("mem_kind", array.array("q", [])),
        ("mem_a", array.array("q", [])),
        ("mem_b", array.array("q", [])),
    ]
    return encode_chunk(header, columns)


def recorded_run(
    app: FastAPI,
    team_id: int,
    project: str,
    name: str,
    *,
    step_ms: float,
    kind: str = "compute",
    series_ms: float | None = None,
    pending: bool = False,
    crashed: bool = False,
    **report_over: Any,
) -> int:
    """A run with one analysed trace (``step_ms`` per profiled step, bound by ``kind``), and a step
    series of steady ``series_ms`` steps when given; its diagnosis (and regression status) is then
    computed by the run-diagnosis job's own function. ``pending``: one more trace still waits;
    ``crashed``: the series' exit chunk says the loop raised;
    ``report_over``: more fields of the trace's report (e.g. recommendations)."""
    with app.state.db.session() as session:
        proj = session.scalar(select(Project).where(Project.team_id == team_id, Project.name == project))
        if proj is None:
            proj = Project(team_id=team_id, name=project)
            session.add(proj)
            session.flush()
        run = Run(project_id=proj.id, name=name)
        session.add(run)
        session.flush()
        for i, status in enumerate(["done", *(["pending"] if pending else [])]):
            trace = Trace(
                team_id=team_id,
                run_id=run.id,
                rank=0,
                window_index=i,
                size_bytes=1,
                sha256="0" * 64,
                storage_key=uuid.uuid4().hex,
                filename=f"{name}-{i}.pt.trace.json",
                status=status,
            )
            session.add(trace)
            session.flush()
            if status == "done":
                shares = {kind: 1.0}
                session.add(
                    Analysis(
                        trace_id=trace.id,
                        engine_version=ENGINE_VERSION,
                        schema_version=SCHEMA_VERSION,
                        primary_kind=kind,
                        report=report(step_time_us=step_ms * 1e3, metrics={"shares": shares}, **report_over),
                    )
                )
        if series_ms is not None:
            store_chunk(session, run, series_chunk(200, series_ms, profiled=(20, 22), clean=not crashed))
        run_id = run.id
    with app.state.db.session() as session:
        refresh_run_diagnosis(session, run_id)
    return run_id
