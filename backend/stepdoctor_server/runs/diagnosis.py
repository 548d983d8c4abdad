"""A run's diagnosis on the server: its analysed traces as the engine's ``TraceEntry``, then the
engine's ``run_verdict`` (the function ``stepdoctor analyze DIR`` calls), so the API, every page and
the CLI show one verdict for the same traces.

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

from stepdoctor_analysis.ranks import TraceEntry
from stepdoctor_analysis.run_verdict import RunVerdict, run_verdict
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


def aggregate_run(traces: Sequence[StoredTrace], *, failed: int = 0, pending: int = 0) -> RunVerdict:
    """The run's verdict over its readable reports (the others counted ``outdated``)."""
    entries = []
    for t in traces:
        doc = read_report(t.report)
        if doc is not None:
            entries.append(
                TraceEntry(
                    doc, rank=t.rank, window=t.window_index, worker=worker_of(t.meta), trace_id=t.trace_id
                )
            )
    return run_verdict(entries, failed=failed, pending=pending, outdated=len(traces) - len(entries))


def read_verdict(stored: Mapping[str, Any] | None) -> RunVerdict | None:
    """A stored diagnosis typed; None when there is none or it is another layout (stale)."""
    if not stored:
        return None
    try:
        return msgspec.convert(dict(stored), RunVerdict)
    except msgspec.ValidationError:
        return None
