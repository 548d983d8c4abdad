"""The run verdict at 8, 128 and 1,000 ranks: folded one trace at a time (``RunAggregate``) versus
recomputed from every stored report each time a trace finishes (the server before summaries).

    .venv/bin/python bench/run_aggregate.py [--ranks 8 128 1000]

Ranks are real HTA fixture reports with their rank fields rewritten and rank 0.613 N's compute
stretched 30% (``tests/support/rank_reports``). Per refresh at N ranks:
- ``reports``: decode N stored report JSONs + ``run_verdict`` (what every refresh cost before);
- ``summaries``: ``verdict_of`` over N summaries (a process that holds none: decode N summaries);
- ``fold``: one re-analysed rank replaced in a held ``RunAggregate`` + its verdict.
Totals: a refresh after every one of the N traces (the worst case; the server refreshes at most
every 5 s while traces wait): ``fold`` measured; ``reports`` measured up to 128 ranks and, at 1,000,
integrated from 10 sampled sizes (marked ~). Prints seconds and ratios; asserts nothing.

``--server``: the same runs stored in a SQLite database (trace and analysis rows, as workers write
them) and ``refresh_run_diagnosis`` timed: the verdict over every stored report (``aggregate_run``,
the refresh before summaries), the first refresh (every summary made from its report), a refresh
after one re-analysed rank (the process holds the aggregate), and one in a fresh process (every
stored summary decoded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

from stepdoctor_analysis.report.contract import ReportDoc, to_dict  # noqa: E402
from stepdoctor_analysis.run.aggregate import RunAggregate  # noqa: E402
from stepdoctor_analysis.run.trace_summary import TraceEntry, TraceSummary, decode, encode, summary_of  # noqa: E402
from stepdoctor_analysis.run.verdict import run_verdict, verdict_of  # noqa: E402
from support.rank_reports import base_reports, rank_reports, with_compute  # noqa: E402


def best(fn: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def from_reports(stored: list[bytes]) -> None:
    """A refresh before summaries: every stored report decoded, then the verdict over them."""
    run_verdict(
        [
            TraceEntry(msgspec.json.decode(b, type=ReportDoc), window=0, trace_id=r)
            for r, b in enumerate(stored)
        ]
    )


def from_summaries(packed: list[bytes]) -> None:
    """A refresh in a process that holds no aggregate: every stored summary decoded."""
    verdict_of([s for b in packed if (s := decode(b)) is not None])


def fold(agg: RunAggregate, summary: TraceSummary) -> None:
    """A refresh with the run's aggregate held: one re-analysed rank replaced."""
    agg.replace(summary)
    agg.verdict()


def fold_all(summaries: list[TraceSummary]) -> RunAggregate:
    """A run's N traces folded in one at a time, a verdict after each."""
    agg = RunAggregate()
    for s in summaries:
        agg.add(s)
        agg.verdict()
    return agg


def measure(n: int, base: ReportDoc) -> str:
    slow = int(0.613 * n)
    docs = rank_reports([base], n, straggler=slow)
    stored = [msgspec.json.encode(to_dict(d)) for d in docs]  # as the database holds them
    summaries = [summary_of(TraceEntry(d, window=0, trace_id=r)) for r, d in enumerate(docs)]
    packed = [encode(s) for s in summaries]
    agg = RunAggregate(summaries)
    agg.verdict()
    again = summary_of(TraceEntry(with_compute(base, 1.01, rank=0, world_size=n), window=0, trace_id=0))
    per_reports = best(lambda: from_reports(stored))
    per_summaries = best(lambda: from_summaries(packed))
    per_fold = best(lambda: fold(agg, again), repeat=5)
    t0 = time.perf_counter()
    found = [s.rank for s in fold_all(summaries).verdict().stragglers]
    fold_total = time.perf_counter() - t0
    if n <= 128:
        t0 = time.perf_counter()
        for k in range(1, n + 1):
            from_reports(stored[:k])
        reports_total, mark = time.perf_counter() - t0, " "
    else:  # integrate sampled refresh costs over k = 1..n
        ks = [max(1, round(n * i / 10)) for i in range(1, 11)]
        reports_total = statistics.fmean(best(partial(from_reports, stored[:k]), repeat=1) for k in ks) * n
        mark = "~"
    return (
        f"{n:>6} {per_reports:>15.4f}s {per_summaries:>17.4f}s {per_fold:>12.4f}s "
        f"{mark}{reports_total:>12.2f}s {fold_total:>10.2f}s {reports_total / fold_total:>6.1f}x  "
        f"{found} (injected {slow})"
    )


def measure_server(n: int, base: ReportDoc, data_dir: Path) -> str:
    from sqlalchemy import delete, select

    from stepdoctor_server.core import migrate
    from stepdoctor_server.core.database import Database
    from stepdoctor_server.core.models import Analysis, Project, Run, Team, Trace
    from stepdoctor_server.core.settings import Settings
    from stepdoctor_server.runs import diagnosis_job
    from stepdoctor_server.runs.diagnosis import StoredTrace, aggregate_run

    settings = Settings(data_dir=data_dir, workers=0)
    migrate.upgrade(settings)
    db = Database(settings)
    slow = int(0.613 * n)
    reports = [to_dict(d) for d in rank_reports([base], n, straggler=slow)]

    def analysis(trace_id: int, report: dict[str, object]) -> Analysis:
        return Analysis(
            trace_id=trace_id,
            engine_version=str(report["engine_version"]),
            schema_version=1,
            report=report,
            duration_ms=1,
        )

    with db.session() as s:
        team = Team(name=f"bench-{n}")
        s.add(team)
        s.flush()
        project = Project(team_id=team.id, name="bench")
        s.add(project)
        s.flush()
        run = Run(project_id=project.id, name=f"ranks-{n}", tags=[])
        s.add(run)
        s.flush()
        traces = [
            Trace(
                team_id=team.id,
                run_id=run.id,
                rank=r,
                window_index=0,
                size_bytes=1,
                sha256="0" * 64,
                storage_key=f"bench/{n}/{r}",
                filename=f"rank{r}.json.gz",
                meta={"host": f"node-{r // 8}"},
                status="done",
            )
            for r in range(n)
        ]
        s.add_all(traces)
        s.flush()
        ids = [t.id for t in traces]
        s.add_all(analysis(i, rep) for i, rep in zip(ids, reports, strict=True))
        run_id = run.id

    def refresh() -> float:
        t0 = time.perf_counter()
        with db.session() as s:
            diagnosis_job.refresh_run_diagnosis(s, run_id)
        return time.perf_counter() - t0

    def old_refresh() -> float:
        t0 = time.perf_counter()
        with db.session() as s:
            rows = s.execute(
                select(Trace.id, Trace.rank, Trace.window_index, Trace.meta, Analysis.report)
                .join(Analysis, Analysis.trace_id == Trace.id)
                .where(Trace.run_id == run_id)
                .order_by(Trace.id)
            ).all()
            aggregate_run([StoredTrace(*r) for r in rows])
        return time.perf_counter() - t0

    old = old_refresh()
    diagnosis_job._HELD.clear()
    first = refresh()
    with db.session() as s:  # rank 0 re-analysed
        s.execute(delete(Analysis).where(Analysis.trace_id == ids[0]))
        s.add(analysis(ids[0], to_dict(with_compute(base, 1.01, rank=0, world_size=n))))
    held = refresh()
    diagnosis_job._HELD.clear()
    fresh = refresh()
    with db.session() as s:
        stored = s.scalar(select(Run.diagnosis).where(Run.id == run_id)) or {}
    db.dispose()
    found = [st["rank"] for st in stored.get("stragglers", [])]
    return (
        f"{n:>6} {old:>15.3f}s {first:>14.3f}s {held:>13.3f}s {fresh:>14.3f}s {old / held:>8.1f}x  "
        f"{found} (injected {slow})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 128, 1000])
    ap.add_argument("--server", action="store_true", help="time refresh_run_diagnosis on SQLite instead")
    args = ap.parse_args()
    base = base_reports(1)[0]
    if args.server:
        print(
            f"{'ranks':>6} {'reports/refresh':>16} {'first refresh':>15} {'held refresh':>14} "
            f"{'fresh process':>15} {'ratio':>9}  stragglers found"
        )
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.ranks:
                print(measure_server(n, base, Path(tmp) / f"n{n}"), flush=True)
        return
    print(
        f"{'ranks':>6} {'reports/refresh':>16} {'summaries/refresh':>18} {'fold/refresh':>13} "
        f"{'reports total':>14} {'fold total':>11} {'ratio':>7}  stragglers found"
    )
    for n in args.ranks:
        print(measure(n, base), flush=True)


if __name__ == "__main__":
    main()
