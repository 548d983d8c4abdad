"""A run of many ranks in the database without analysing 1,000 traces: one real upload makes the
run, then trace rows and valid stored reports (``support.reports.report``) are written directly, as
workers would, and the run's verdict is built by the server's own ``refresh_run_diagnosis``.

Each rank works ``COMPUTE_US`` (with a small deterministic wobble) and waits the rest of its
``STEP_US`` step in exposed communication; the straggler computes ``slowdown`` longer and waits that
much less (synchronised collectives: every rank's step is as long as the slowest's). Ranks sit
``per_host`` to a host, named in the agent's metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.models import Analysis, Trace
from stepdoctor_server.runs.diagnosis_job import refresh_run_diagnosis
from support.reports import report, steps
from support.server import synthetic_trace, upload

STEP_US = 100_000.0
COMPUTE_US = 60_000.0


@dataclass(frozen=True)
class ManyRanks:
    run_id: int
    trace_ids: dict[int, int]  # rank -> trace id
    straggler: int


def rank_report(rank: int, *, slow: float = 0.0) -> dict[str, object]:
    """A stored report of one rank: compute, then exposed communication up to the common step."""
    compute = COMPUTE_US * (1.0 + 0.03 * math.sin(rank * 1.7)) * (1.0 + slow)
    wait = max(2_000.0, STEP_US - compute)
    step = compute + wait
    return report(
        rank=rank,
        step_time_us=step,
        steps=steps(4),
        primary={"kind": "compute", "share": compute / step},
        metrics={
            "kinds_us": {"compute": compute, "communication": wait},
            "shares": {"compute": compute / step, "communication": wait / step},
        },
    )


def many_rank_run(
    app: FastAPI,
    client: TestClient,
    ranks: int,
    *,
    straggler: int | None = None,
    slowdown: float = 0.3,
    per_host: int = 8,
    run: str = "many-ranks",
) -> ManyRanks:
    """A run of ``ranks`` analysed ranks (one trace each), the straggler at ``straggler`` (default
    rank ``0.613 × ranks``), and its stored verdict."""
    slow = int(0.613 * ranks) if straggler is None else straggler
    made = upload(client, synthetic_trace(), run=run, rank=0, metadata={"host": "node-000", "pid": 1}).json()
    run_id = int(made["run_id"])
    ids = {0: int(made["id"])}
    with app.state.db.session() as session:
        first = session.get(Trace, ids[0])
        assert first is not None
        team_id = first.team_id
        rows = [
            Trace(
                team_id=team_id,
                run_id=run_id,
                rank=r,
                window_index=0,
                size_bytes=1,
                sha256="0" * 64,
                storage_key=f"many-ranks/{run_id}/{r}",
                filename=f"rank{r}.json.gz",
                meta={"host": f"node-{r // per_host:03d}", "pid": 100 + r % per_host},
                status="done",
            )
            for r in range(1, ranks)
        ]
        session.add_all(rows)
        session.flush()
        ids.update({t.rank: t.id for t in rows if t.rank is not None})
        first.status = "done"
        session.add_all(
            Analysis(
                trace_id=ids[r],
                engine_version=str(rep["engine_version"]),
                schema_version=int(str(rep["schema_version"])),
                primary_kind="compute",
                primary_share=0.6,
                report=rep,
                duration_ms=1,
            )
            for r in range(ranks)
            for rep in [rank_report(r, slow=slowdown if r == slow else 0.0)]
        )
    with app.state.db.session() as session:
        refresh_run_diagnosis(session, run_id)
    return ManyRanks(run_id=run_id, trace_ids=ids, straggler=slow)
