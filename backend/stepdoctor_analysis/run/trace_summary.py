"""One trace of a run, as much of its report as the run's verdict reads: ``TraceSummary``.

A run's verdict (``run_verdict``) is a function of these records only, so a server stores one per
analysed trace and folds it into the run's aggregate (``run_aggregate.RunAggregate``) without
re-reading every report, and ``stepdoctor analyze DIR`` keeps one per rank file instead of every
parsed trace. ``summary_of`` is the one function that makes one from a typed report.

- Identity: ``rank``/``worker`` as ``rank_of`` resolves them (the caller's rank, else the report's,
  else the process that wrote it), the capture ``window``, the server's ``trace_id`` and the host.
- ``key`` orders a run's traces (the server's trace id, the CLI's file index): merged cards and
  findings keep the text of the first trace that raised them, and sums run in this order, so the
  verdict is the same whatever order the summaries arrived in.
- Figures are copied as the report holds them (no rounding), so a verdict over summaries equals
  one over the reports, to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ..report.contract import Recommendation, ReportDoc
from .job import removable_shares, span_us, step_count, step_time_us
from .memory import WindowEnds, window_ends

SUMMARY_VERSION = 2  # the layout of ``TraceSummary``: a stored one of another version is rebuilt


@dataclass(frozen=True)
class TraceEntry:
    """One analysed trace: its typed report and what the caller knows of where it came from.

    ``rank``: from upload metadata, else the report's own (``distributedInfo``). ``worker``: the
    process that wrote it when no rank is known (``host_pid``: the TensorBoard file name for the
    CLI, the agent's host and pid for the server); never a name the server gave the file, so the
    windows of one process stay windows of one worker.
    """

    report: ReportDoc
    rank: int | None = None
    window: int | None = None
    worker: str | None = None
    trace_id: int | None = None  # the server's id of the trace, when it has one
    host: str | None = None  # the machine it ran on, when known (the run page groups ranks by node)


def rank_of(entry: TraceEntry) -> tuple[int | None, str | None]:
    """(rank, worker) of one trace: the caller's rank, else the report's, else the caller's worker."""
    if entry.rank is not None:
        return entry.rank, None
    if entry.report.rank is not None:
        return entry.report.rank, None
    return None, entry.worker


class TraceSummary(msgspec.Struct, kw_only=True):
    """What the run verdict reads of one trace (module docstring)."""

    summary_version: int = SUMMARY_VERSION
    key: int  # the trace's place in its run (server trace id, CLI file index)
    rank: int | None  # resolved (``rank_of``)
    worker: str | None  # the process, when no rank is known
    window: int | None = None
    trace_id: int | None = None
    host: str | None = None
    engine_version: str
    schema_version: int
    steps: int  # ``job.step_count``: its weight in step-time means
    step_time_us: float  # ``job.step_time_us``
    span_us: float  # ``job.span_us``: its weight in shares, removable time and cards
    breakdown: dict[str, float]  # TensorBoard's categories, µs per step
    shares: dict[str, float]  # kind (and "other") -> fraction of the step
    kinds_us: dict[str, float]  # kind -> µs per step (``metrics.kinds_us``, else shares × step)
    removable: dict[str, tuple[float, str]]  # ``job.removable_shares``: kind -> (fraction, basis)
    arrival_us: float | None  # step start -> first collective
    exposed_us_by_type: dict[str, float] = msgspec.field(default_factory=dict)  # collective -> µs per step
    gpu_utilization: float | None = None
    primary_kind: str  # the trace's own verdict
    primary_share: float
    primary_note: str = ""
    recommendations: list[Recommendation] = msgspec.field(default_factory=list)  # best first
    findings: list[Recommendation] = msgspec.field(default_factory=list)
    # step-end memory per device, for the run's leak across windows (``memory_run.run_leak``)
    memory_ends: list[WindowEnds] = msgspec.field(default_factory=list)

    @property
    def wait_us(self) -> float:
        """Exposed communication per step: what it waits for the other ranks (or the wire)."""
        return self.kinds_us.get("communication", 0.0)

    @property
    def busy_us(self) -> float:
        """The work before its collectives: step time minus the wait."""
        return max(0.0, self.step_time_us - self.wait_us)

    @property
    def first_card(self) -> Recommendation | None:
        return self.recommendations[0] if self.recommendations else None


def summary_of(entry: TraceEntry, key: int | None = None) -> TraceSummary:
    """The trace's summary. ``key`` defaults to its trace id, else its window."""
    doc = entry.report
    rank, worker = rank_of(entry)
    step = step_time_us(doc)
    gpu = doc.metrics.gpu
    arrival = doc.metrics.communication.arrival_ns_per_step
    if key is None:
        key = entry.trace_id if entry.trace_id is not None else (entry.window or 0)
    return TraceSummary(
        key=key,
        rank=rank,
        worker=worker,
        window=entry.window,
        trace_id=entry.trace_id,
        host=entry.host,
        engine_version=doc.engine_version,
        schema_version=doc.schema_version,
        steps=step_count(doc),
        step_time_us=step,
        span_us=span_us(doc),
        breakdown=msgspec.structs.asdict(doc.breakdown),
        shares=dict(doc.metrics.shares),
        kinds_us=dict(doc.metrics.kinds_us)
        if doc.metrics.kinds_us
        else {kind: v * step for kind, v in doc.metrics.shares.items()},
        removable=removable_shares(doc),
        arrival_us=arrival / 1e3 if arrival is not None else None,
        exposed_us_by_type=_exposed_by_type(doc),
        gpu_utilization=gpu.utilization if gpu is not None else None,
        primary_kind=doc.primary.kind,
        primary_share=doc.primary.share,
        primary_note=doc.primary.note,
        recommendations=list(doc.recommendations),
        findings=list(doc.findings),
        memory_ends=window_ends(doc),
    )


def _exposed_by_type(doc: ReportDoc) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in doc.metrics.communication.by_type:
        out[c.type] = out.get(c.type, 0.0) + c.exposed_ns_per_step / 1e3
    return out


def encode(summary: TraceSummary) -> bytes:
    return msgspec.json.encode(summary)


def decode(data: bytes | str) -> TraceSummary | None:
    """A stored summary typed; None when it is another layout (rebuilt from the report)."""
    try:
        s = msgspec.json.decode(data, type=TraceSummary)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return s if s.summary_version == SUMMARY_VERSION else None
