"""A run's diagnosis on the server: its analysed traces as the engine's ``TraceEntry``, each made
once into its compact ``TraceSummary`` (stored per analysis, ``diagnosis_job``), then the engine's
``run_verdict.verdict_of`` over those (the function ``stepdoctor analyze DIR`` calls), so the API,
every page and the CLI show one verdict for the same traces.

What the server adds is where each trace came from: the rank the upload gave, the capture window,
and the process (the agent's host and pid) when no rank is known. The name the server gives a stored
file is never a worker name: two windows of one process are windows, not two ranks. A stored report
that does not decode as the contract (another engine wrote it) is left out and counted ``outdated``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from stepdoctor_analysis.run.trace_summary import TraceEntry, TraceSummary, summary_of
from stepdoctor_analysis.run.verdict import RunVerdict, verdict_of
from stepdoctor_server.traces.reports import read_report


@dataclass(frozen=True)
class StoredTrace:
    """One analysed trace of a run as stored: its upload rank, window, metadata and report."""

    trace_id: int
    rank: int | None
    window_index: int | None
    meta: Mapping[str, Any] | None
    report: Mapping[str, Any]


def worker_of(meta: Mapping[str, Any] | None) -> str | None:
    """The process a trace came from (``host_pid``), from the agent's metadata; None when unknown."""
    if not meta:
        return None
    host = meta.get("host") or meta.get("hostname")
    pid = meta.get("pid")
    if host is None and pid is None:
        return None
    return f"{host or 'host'}_{pid if pid is not None else '?'}"


def host_of(meta: Mapping[str, Any] | None) -> str | None:
    """The machine a trace ran on, from the agent's metadata; None when unknown."""
    host = (meta or {}).get("host") or (meta or {}).get("hostname")
    return str(host) if host is not None else None


def summary_of_stored(trace: StoredTrace) -> TraceSummary | None:
    """A stored trace's summary (keyed by its trace id); None when its report does not decode."""
    doc = read_report(trace.report)
    if doc is None:
        return None
    entry = TraceEntry(
        doc,
        rank=trace.rank,
        window=trace.window_index,
        worker=worker_of(trace.meta),
        trace_id=trace.trace_id,
        host=host_of(trace.meta),
    )
    return summary_of(entry, key=trace.trace_id)


def aggregate_run(traces: Sequence[StoredTrace], *, failed: int = 0, pending: int = 0) -> RunVerdict:
    """The run's verdict over its readable reports, in the order given (the others counted ``outdated``)."""
    summaries = [s for t in traces if (s := summary_of_stored(t)) is not None]
    return verdict_of(summaries, failed=failed, pending=pending, outdated=len(traces) - len(summaries))


def read_verdict(stored: Mapping[str, Any] | None) -> RunVerdict | None:
    """A stored diagnosis typed; None when there is none or it is another layout (stale)."""
    if not stored:
        return None
    try:
        return msgspec.convert(dict(stored), RunVerdict)
    except msgspec.ValidationError:
        return None
