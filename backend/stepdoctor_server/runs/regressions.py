"""A run against its project's baseline: the one owner of "did this run regress?" on the server.

The baseline is the run an upload or admin token chose for the project (``project_baselines``),
else the median of the project's last ``settings.baseline_runs`` finished runs before this one.
Each side is the engine's :class:`~stepdoctor_analysis.run.timeline.Side` (the unprofiled steady
median from the run's step series, the profiled step time and verdict kind from its diagnosis),
and the engine's :func:`~stepdoctor_analysis.run.timeline.compare` decides, so ``stepdoctor check``
and the server give one answer for the same two runs.

The status is computed by the run-diagnosis job (and when a baseline is chosen), stored on the
run (``runs.regression``) and only read by pages and the API: nothing is written inside a GET.
A run that newly regresses queues one webhook delivery (``webhook_deliveries``, unique per run
and regression signature), sent off the request path by ``runs.webhook``.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import msgspec
from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from stepdoctor_analysis.run.timeline import Comparison, NothingComparable, Side, compare
from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.core.database import Database, settings_of
from stepdoctor_server.core.errors import ApiError, check_id, not_found
from stepdoctor_server.core.models import (
    Project,
    ProjectBaseline,
    Run,
    SeriesStream,
    Trace,
    WebhookDelivery,
    utcnow,
)
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.runs.diagnosis import read_verdict
from stepdoctor_server.runs.series import liveness_of, run_timeline_of

log = logging.getLogger("stepdoctor.regressions")

#: The project's runs whose status is redone when its baseline changes (newest first).
RECHECK_ON_BASELINE_CHANGE = 200


class Baseline(msgspec.Struct, frozen=True, kw_only=True):
    """What a run was compared with: a chosen run, or the median of the project's recent runs."""

    kind: Literal["chosen", "median"]
    run_ids: list[int]
    names: list[str]
    side: Side

    @property
    def label(self) -> str:
        if self.kind == "chosen":
            return f"run {self.names[0]} (the project's chosen baseline)"
        return f"the median of the last {len(self.names)} finished run(s) ({', '.join(self.names)})"


class RegressionStatus(msgspec.Struct, kw_only=True):
    """A run's regression status as stored on the run (``runs.regression``) and served.

    ``side``: the run's own numbers (what later runs' median baselines read). ``comparison`` is the
    engine's answer (None with ``note`` saying why: no baseline yet, nothing comparable).
    ``reasons``: ``step_time`` (slower than the threshold allows) and/or ``verdict`` (another kind).
    """

    side: Side
    finished: bool
    baseline: Baseline | None = None
    comparison: Comparison | None = None
    regressed: bool = False
    reasons: list[str] = msgspec.field(default_factory=list)
    note: str | None = None
    computed_at: str | None = None
    series_chunks: int = 0  # chunks of the run's step series it was computed from (``recheck_series``)

    @property
    def signature(self) -> str | None:
        """What one webhook announces: the reasons, and the verdict change when there is one."""
        if not self.regressed or self.comparison is None:
            return None
        c = self.comparison
        verdict = f":{c.baseline_verdict}->{c.candidate_verdict}" if "verdict" in self.reasons else ""
        return "+".join(self.reasons) + verdict

    def summary(self) -> str:
        """One line with the numbers (the run list's marker title, the webhook's text)."""
        c = self.comparison
        if c is None:
            return self.note or "not compared"
        basis = "unprofiled steady-state" if c.basis == "unprofiled" else "profiled (capture windows)"
        text = (
            f"{basis} step time {c.candidate_ms:.2f} ms vs baseline {c.baseline_ms:.2f} ms "
            f"({100 * c.change:+.1f}%, limit +{100 * c.max_regression:.1f}%)"
        )
        if c.verdict_changed:
            text += f"; verdict {c.baseline_verdict} -> {c.candidate_verdict}"
        return text


def read_regression(stored: Mapping[str, Any] | None) -> RegressionStatus | None:
    """A stored status typed; None when there is none or it is of another layout."""
    if not stored:
        return None
    try:
        return msgspec.convert(dict(stored), RegressionStatus)
    except msgspec.ValidationError:
        return None


def run_side(session: Session, run: Run, project: Project) -> tuple[Side, bool]:
    """(the run as ``compare`` sees it, whether it is finished).

    Finished: no trace waits for analysis, and a step series, when there is one, is ``finished`` by
    ``series.liveness_of`` (every rank's latest process exited cleanly: a crashed run is
    ``stopped``, never a baseline). What ``GET .../check`` serves and what ``stepdoctor check`` compares.
    """
    verdict = read_verdict(run.diagnosis)
    analysed = verdict is not None and verdict.traces > 0
    timeline = run_timeline_of(session, run.id)
    waiting = session.scalar(
        select(Trace.id).where(Trace.run_id == run.id, Trace.status.in_(("pending", "running"))).limit(1)
    )
    side = Side(
        source=f"{project.name}/{run.name}",
        unprofiled_median_ms=timeline.unprofiled_median_ms if timeline is not None else None,
        profiled_ms=round(verdict.step_time_us / 1e3, 3)
        if analysed and verdict and verdict.step_time_us
        else None,
        verdict=verdict.primary.kind if analysed and verdict and verdict.primary else None,
        steps=timeline.steps if timeline is not None else None,
    )
    finished = (
        waiting is None
        and liveness_of(session, run.id) in (None, "finished")
        and (analysed or timeline is not None)
    )
    return side, finished


def series_chunks(session: Session, run_id: int) -> int:
    """How many step-series chunks the run has (every process): a change means a new status."""
    return int(
        session.scalar(select(func.sum(SeriesStream.chunks)).where(SeriesStream.run_id == run_id)) or 0
    )


#: A live run's status is redone at most this often (each redo reads its whole series once).
LIVE_RECHECK = timedelta(minutes=10)


def recheck_series(session: Session, *, within: timedelta = timedelta(days=1)) -> list[int]:
    """Redo the status of runs whose step series got chunks since it was computed (a run's series
    changes without a new diagnosis: its steady step time, its end). The workers' sweep, with
    webhooks; only runs heard from within ``within`` are looked at, and a run whose processes
    have not all ended at most every ``LIVE_RECHECK``."""
    open_streams = func.sum(case((SeriesStream.final.is_(False), 1), else_=0))
    recent = (
        select(
            SeriesStream.run_id,
            func.sum(SeriesStream.chunks).label("chunks"),
            open_streams.label("open"),
        )
        .where(
            SeriesStream.run_id.in_(
                select(SeriesStream.run_id).where(SeriesStream.heartbeat_at >= utcnow() - within)
            )
        )
        .group_by(SeriesStream.run_id)
        .subquery()
    )
    rows = session.execute(
        select(recent.c.run_id, recent.c.chunks, recent.c.open, Run.regression).join(
            Run, Run.id == recent.c.run_id
        )
    ).all()
    redone = []
    soon = (utcnow() - LIVE_RECHECK).isoformat()
    for run_id, chunks, still_open, stored in rows:
        status = read_regression(stored)
        if status is not None and still_open and (status.computed_at or "") > soon:
            continue  # live: its status is at most LIVE_RECHECK old
        if status is None or status.series_chunks != int(chunks or 0):
            refresh_regression(session, run_id)
            redone.append(int(run_id))
    return redone


def recheck_series_now(db: Database) -> list[int]:
    """``recheck_series`` in its own transaction (the sweep's body)."""
    with db.session() as session:
        return recheck_series(session)


def chosen_baseline(session: Session, project_id: int) -> Run | None:
    return session.scalar(
        select(Run)
        .join(ProjectBaseline, ProjectBaseline.run_id == Run.id)
        .where(ProjectBaseline.project_id == project_id)
    )


def baseline_of(session: Session, run: Run, project: Project, settings: Settings) -> Baseline | None:
    """The run's baseline: the project's chosen run (unless it is this run), else the median of
    the last ``settings.baseline_runs`` finished runs created before it (their stored sides)."""
    chosen = chosen_baseline(session, project.id)
    if chosen is not None and chosen.id != run.id:
        side, _ = run_side(session, chosen, project)
        return Baseline(kind="chosen", run_ids=[chosen.id], names=[chosen.name], side=side)
    if chosen is not None:
        return None  # the chosen baseline itself is compared with nothing
    earlier = session.execute(
        select(Run.id, Run.name, Run.regression)
        .where(Run.project_id == project.id, Run.regression.is_not(None))
        .where(or_(Run.created_at < run.created_at, and_(Run.created_at == run.created_at, Run.id < run.id)))
        .order_by(Run.created_at.desc(), Run.id.desc())
        .limit(20 * settings.baseline_runs)
    ).all()
    picked: list[tuple[int, str, Side]] = []
    for run_id, name, stored in earlier:
        status = read_regression(stored)
        if status is not None and status.finished:
            picked.append((run_id, name, status.side))
        if len(picked) == settings.baseline_runs:
            break
    if not picked:
        return None
    sides = [s for _, _, s in picked]
    return Baseline(
        kind="median",
        run_ids=[i for i, _, _ in picked],
        names=[n for _, n, _ in picked],
        side=median_side(sides, f"median of {len(sides)} run(s)"),
    )


def median_side(sides: list[Side], source: str) -> Side:
    """Several runs as one ``Side``: the median of each step time over the runs that have it, and
    their most common verdict kind (the newest run's on a tie; ``sides`` newest first)."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v]
        return round(statistics.median(known), 3) if known else None

    kinds = [s.verdict for s in sides if s.verdict]
    verdict = None
    if kinds:
        counts = Counter(kinds)
        top = max(counts.values())
        verdict = next(k for k in kinds if counts[k] == top)
    return Side(
        source=source,
        unprofiled_median_ms=median([s.unprofiled_median_ms for s in sides]),
        profiled_ms=median([s.profiled_ms for s in sides]),
        verdict=verdict,
    )


def regression_status(session: Session, run: Run, project: Project, settings: Settings) -> RegressionStatus:
    """The run against its baseline, decided by the engine's ``compare`` (the one function)."""
    side, finished = run_side(session, run, project)
    baseline = baseline_of(session, run, project, settings)
    status = RegressionStatus(
        side=side,
        finished=finished,
        baseline=baseline,
        computed_at=utcnow().isoformat(),
        series_chunks=series_chunks(session, run.id),
    )
    if baseline is None:
        status.note = "no baseline yet: no finished earlier run in this project, and none chosen"
        return status
    try:
        c = compare(side, baseline.side, max_regression=settings.regression_threshold)
    except NothingComparable as exc:
        status.note = str(exc)
        return status
    status.comparison = c
    status.reasons = [r for r, hit in (("step_time", c.regression), ("verdict", c.verdict_changed)) if hit]
    status.regressed = bool(status.reasons)
    return status


def step_comparison(
    session: Session, base: Run, base_project: Project, other: Run, other_project: Project
) -> Comparison | None:
    """``other`` against ``base`` on the best basis both have (the unprofiled steady state when both
    have a series): what the compare page and its JSON twin state, by the engine's ``compare``
    (the function ``stepdoctor check`` calls). None when nothing is comparable."""
    other_side, _ = run_side(session, other, other_project)
    base_side, _ = run_side(session, base, base_project)
    try:
        return compare(other_side, base_side, max_regression=settings_of(session).regression_threshold)
    except NothingComparable:
        return None


def refresh_regression(session: Session, run_id: int, *, notify: bool = True) -> RegressionStatus | None:
    """Recompute and store the run's regression status; queue one webhook delivery when it newly
    regressed (``notify`` and a webhook URL configured). Called where the run's diagnosis (or its
    series) was just written, in the same transaction. None when the run is gone."""
    row = session.execute(
        select(Run, Project)
        .join(Project, Project.id == Run.project_id)
        .where(Run.id == run_id)
        .execution_options(populate_existing=True)  # the diagnosis was just written by an UPDATE
    ).first()
    if row is None:
        return None
    run, project = row
    settings = settings_of(session)
    before = read_regression(run.regression)
    status = regression_status(session, run, project, settings)
    run.regression = msgspec.to_builtins(status)
    signature = status.signature
    new = signature is not None and (before is None or before.signature != signature)
    if new and notify and settings.webhook_url.get_secret_value():
        queue_delivery(session, run, project, status, settings)
    session.flush()
    return status


def queue_delivery(
    session: Session, run: Run, project: Project, status: RegressionStatus, settings: Settings
) -> bool:
    """One delivery row per (run, signature): a regression announced twice is a unique-key
    conflict, skipped. False when it was already queued (or sent)."""
    signature = status.signature
    assert signature is not None
    try:
        with session.begin_nested():
            session.add(
                WebhookDelivery(
                    run_id=run.id,
                    signature=signature[:255],
                    payload=webhook_payload(run, project, status, settings),
                    status="pending",
                    next_attempt_at=utcnow(),
                )
            )
    except IntegrityError:
        return False
    log.info("run %s: regression (%s); webhook queued", run.id, signature)
    return True


def run_link(settings: Settings, run_id: int) -> str:
    return f"{settings.public_url.rstrip('/')}/runs/{run_id}"


def webhook_payload(
    run: Run, project: Project, status: RegressionStatus, settings: Settings
) -> dict[str, Any]:
    """The JSON body: the numbers as fields, plus ``text`` for Slack/Mattermost incoming webhooks."""
    c, baseline = status.comparison, status.baseline
    assert c is not None and baseline is not None
    link = run_link(settings, run.id)
    text = (
        f"stepdoctor: run {project.name}/{run.name} regressed against {baseline.label}: "
        f"{status.summary()}. {link}"
    )
    return {
        "event": "regression",
        "text": text,
        "project": {"id": project.id, "name": project.name},
        "run": {"id": run.id, "name": run.name},
        "baseline": {
            "kind": baseline.kind,
            "run_ids": baseline.run_ids,
            "names": baseline.names,
            "label": baseline.label,
        },
        "basis": c.basis,
        "step_time_ms": {"run": c.candidate_ms, "baseline": c.baseline_ms},
        "change": c.change,
        "max_regression": c.max_regression,
        "reasons": status.reasons,
        "verdict": {"run": c.candidate_verdict, "baseline": c.baseline_verdict, "changed": c.verdict_changed},
        "link": link,
    }


# -- choosing the baseline ---------------------------------------------------------------------


def load_project(session: Session, principal: Principal, project_id: int) -> Project:
    """The caller's project (404 for a missing one and for another team's alike)."""
    project = session.get(Project, check_id("project", project_id))
    if project is None or project.team_id != principal.team_id:
        raise not_found("project", project_id)
    return project


def load_named_run(session: Session, principal: Principal, project: str, run: str) -> tuple[Run, Project]:
    """The caller's run named ``project/run`` (what ``stepdoctor check --server`` passes)."""
    row = session.execute(
        select(Run, Project)
        .join(Project, Project.id == Run.project_id)
        .where(Project.team_id == principal.team_id, Project.name == project, Run.name == run)
    ).first()
    if row is None:
        raise not_found("run", f"{project}/{run}")
    found, owner = row
    return found, owner


def set_baseline(session: Session, principal: Principal, project: Project, run: Run | None) -> list[int]:
    """Choose ``run`` as the project's baseline (None: back to the median of recent runs), then
    redo the status of the project's newest runs against it, without webhooks (a changed baseline
    is an admin's decision, not a new regression). Returns the run ids redone."""
    if not principal.allows("upload"):
        raise ApiError(403, "forbidden", "choosing a baseline needs an upload or admin token")
    if run is not None and run.project_id != project.id:
        raise ApiError(422, "invalid_request", f"run {run.id} is not a run of project {project.name}")
    current = session.get(ProjectBaseline, project.id)
    if run is None:
        if current is not None:
            session.delete(current)
    elif current is None:
        session.add(ProjectBaseline(project_id=project.id, run_id=run.id))
    else:
        current.run_id, current.created_at = run.id, utcnow()
    session.flush()
    ids = list(
        session.scalars(
            select(Run.id)
            .where(Run.project_id == project.id)
            .order_by(Run.created_at.desc(), Run.id.desc())
            .limit(RECHECK_ON_BASELINE_CHANGE)
        )
    )
    for run_id in reversed(ids):  # oldest first: a median baseline reads earlier runs' sides
        refresh_regression(session, run_id, notify=False)
    return ids
