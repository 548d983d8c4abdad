"""Run-level diagnosis from the per-trace reports of one run (all ranks, all capture windows).

Pure: takes reports as stored in ``analyses.report``, reads each typed (``reports.read_report``,
the contract's ``ReportDoc``) and returns a JSON-ready dict, so the worker, the API and the tests
share one definition of "what is this run bound by". A stored report that does not decode is
outdated (another engine wrote it): it is left out and counted in ``outdated``.

Conventions:
- A report's step time is its ``step_time_us``, else the sum of its breakdown: the breakdown parts
  partition each step's wall time (TensorBoard's priority walk), so they add up to the average step.
- Breakdown and bottleneck shares are weighted by each report's step count, so a 6-step window
  counts six times a 1-step one. A report without ``steps`` counts once.
- The primary kind is the run's limiter, chosen by ``stepdoctor_analysis.job.job_limiter`` (which
  ``stepdoctor analyze DIR`` calls too) with ``diagnose.choose_limiter``, the per-trace rule, from
  the step-time-weighted shares and removable time of every report: a
  measured wait outranks an estimated compute speedup, compute-bound only when the device is busy
  and no wait gains as much. Recommendations are re-ranked on the same run-level removable time, so
  the verdict, shares and first recommendation all come from one aggregate, never from one trace.
- Ranks, windows and stragglers come from ``stepdoctor_analysis.ranks.rank_verdict``, the function
  ``stepdoctor analyze DIR`` calls too: traces group by rank (upload metadata, else the report's
  ``distributedInfo`` rank), several traces of a rank are its windows, and a straggler is a rank whose
  work before its collectives (step time minus exposed communication) exceeds the other ranks'
  median by 10%, with the kind of work that made it slow.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import msgspec

from stepdoctor_analysis import BOTTLENECK_KINDS, BREAKDOWN_CATEGORIES
from stepdoctor_analysis.contract import Recommendation, ReportDoc
from stepdoctor_analysis.diagnose import MIN_CARD_SPEEDUP, sure_share
from stepdoctor_analysis.job import job_limiter, step_count, step_time_us
from stepdoctor_analysis.ranks import RankVerdict, rank_verdict, straggler_advice, with_straggler_advice
from stepdoctor_analysis.ranks import TraceEntry as RankEntry
from stepdoctor_server.reports import read_report

# Breakdown categories in the TensorBoard plugin's priority order; unknown keys are kept after these.
CATEGORIES = BREAKDOWN_CATEGORIES
# The bottleneck vocabulary; a report's ``metrics.shares`` also carries unattributed time ("other"),
# which is kept in the shares but can never be the primary kind.
KINDS = BOTTLENECK_KINDS
DIAGNOSIS_VERSION = 1


@dataclass(frozen=True)
class TraceReport:
    """One analysed trace of a run: where it came from and its engine report (as stored; ``doc``
    is the same report typed, None when it does not decode)."""

    trace_id: int
    rank: int | None
    window_index: int | None
    report: Mapping[str, Any]

    @cached_property
    def doc(self) -> ReportDoc | None:
        return read_report(self.report)


def readable(reports: Sequence[TraceReport]) -> list[TraceReport]:
    """The reports that decode as the contract's ``ReportDoc``; the others are outdated."""
    return [r for r in reports if r.doc is not None]


def aggregate_run(reports: Sequence[TraceReport], *, failed: int = 0, pending: int = 0) -> dict[str, Any]:
    """Combine every analysed trace of a run into one diagnosis (see the module docstring)."""
    typed = readable(reports)
    # Only present when some are: a run whose reports all decode keeps its diagnosis unchanged.
    outdated = {"outdated": len(reports) - len(typed)} if len(typed) < len(reports) else {}
    reports = typed
    if not reports:
        return {
            "diagnosis_version": DIAGNOSIS_VERSION,
            "traces": 0,
            "failed": failed,
            "pending": pending,
            **outdated,
            "primary": None,
        }
    weights = [step_count(r.report) for r in reports]
    times = [step_time_us(r.report) for r in reports]
    breakdown = _weighted_breakdown(reports, weights)
    limiter = job_limiter([r.report for r in reports])  # the same function ``analyze DIR`` calls
    shares, removable = limiter.shares, limiter.removable
    primary_kind, reason = limiter.kind, limiter.reason
    recommendations = merge_recommendations(reports, weights, times, primary_kind)
    verdict = rank_verdict([RankEntry(r.report, rank=r.rank, window=r.window_index) for r in reports])
    ranks = [asdict(s) for s in verdict.ranks]
    spread = _spread(verdict)
    stragglers = [asdict(st) | {"why": st.sentence()} for st in verdict.stragglers]
    if (card := straggler_advice(verdict)) is not None:  # the same card ``analyze DIR`` leads with
        card |= {"traces": len(reports), "first_in": 0, "ranks": []}
        recommendations = with_straggler_advice(recommendations, card, primary_kind)
    return {
        "diagnosis_version": DIAGNOSIS_VERSION,
        "engine_version": _common(_doc(r).engine_version for r in reports),
        "schema_version": _common(_doc(r).schema_version for r in reports),
        "traces": len(reports),
        "failed": failed,
        "pending": pending,
        **outdated,
        "windows": len({r.window_index for r in reports}),
        "steps": sum(weights),
        "step_time_us": _weighted_mean(times, weights),
        "breakdown": breakdown,
        "primary": None
        if primary_kind is None
        else {
            "kind": primary_kind,
            "share": round(shares.get(primary_kind, 0.0), 6),
            "gain": round(1.0 / max(1.0 - removable[primary_kind][0], 0.05), 3),
            "basis": removable[primary_kind][1],
            "reason": reason,
            "note": _note(primary_kind, recommendations, reports),
        },
        "shares": {k: round(v, 6) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        "removable": {k: {"share": round(v[0], 6), "basis": v[1]} for k, v in removable.items()},
        # Same weighting as the shares, so the run page's "GPU utilization" and "compute" agree:
        # utilization (any kernel running) >= compute + exposed communication share.
        "gpu_utilization": _weighted_utilization(reports, weights, times),
        "recommendations": recommendations,
        "findings": merge_findings(reports),
        "ranks": ranks,
        "rank_spread": spread,
        "stragglers": stragglers,
    }


def merge_recommendations(
    reports: Sequence[TraceReport],
    weights: Sequence[int] | None = None,
    times: Sequence[float] | None = None,
    primary_kind: str | None = None,
) -> list[dict[str, Any]]:
    """One entry per recommendation id, its gain recomputed over the whole run.

    Each id's removable time is averaged over every report's profiled time (a report without it
    contributes nothing), so one window's optimistic figure does not stand for the run; cards are
    ranked like the per-trace ones (measured waits before estimates), those gaining no more than
    ``MIN_CARD_SPEEDUP`` are dropped, and the primary kind's best card leads. Outdated reports
    (``doc`` None) are left out.
    """
    reports = readable(reports)
    weights = weights or [step_count(r.report) for r in reports]
    times = times or [step_time_us(r.report) for r in reports]
    total = sum((t if t > 0 else 1.0) * w for t, w in zip(times, weights, strict=True)) or 1.0
    merged: dict[str, dict[str, Any]] = {}
    for tr, w, t in zip(reports, weights, times, strict=True):
        span = (t if t > 0 else 1.0) * w
        for pos, rec in enumerate(_doc(tr).recommendations):
            if not rec.id:
                continue
            entry = merged.setdefault(
                rec.id,
                {**_plain(rec), "traces": 0, "first_in": 0, "ranks": [], "_removable": 0.0, "_span": None},
            )
            entry["traces"] += 1
            entry["first_in"] += pos == 0
            if tr.rank is not None and tr.rank not in entry["ranks"]:
                entry["ranks"].append(tr.rank)
            removable = _removable_fraction(rec, t)
            entry["_removable"] += removable * span
            if rec.expected_speedup_range is not None and removable > 0:
                entry["_span"] = entry["_span"] or [0.0, 0.0]
                for i in (0, 1):
                    entry["_span"][i] += _fraction_of(rec.expected_speedup_range[i]) * span
    out = []
    for entry in merged.values():
        entry["ranks"].sort()
        frac = entry.pop("_removable") / total
        rng = entry.pop("_span")
        entry["removable_share"] = round(frac, 6)
        entry["expected_speedup"] = round(1.0 / max(1.0 - frac, 0.05), 3)
        entry["expected_speedup_range"] = (
            [round(1.0 / max(1.0 - v / total, 0.05), 3) for v in rng] if rng is not None else None
        )
        if entry.get("change") and entry["expected_speedup"] > MIN_CARD_SPEEDUP:
            out.append(entry)
    out.sort(
        key=lambda e: (
            -sure_share(
                e["removable_share"],
                str(e.get("basis") or "measured"),
                str(e.get("kind") or ""),
                e["expected_speedup_range"][0] if e.get("expected_speedup_range") else None,
            ),
            -e["traces"],
            str(e["id"]),
        )
    )
    own = next((e for e in out if e.get("kind") == primary_kind), None)
    return out if own is None else [own, *(e for e in out if e is not own)]


def _fraction_of(speedup: float) -> float:
    """The removable fraction of the step behind a speedup ``1 / (1 - f)``."""
    return 1.0 - 1.0 / speedup if speedup > 1.0 else 0.0


def _removable_fraction(rec: Recommendation, step_us: float) -> float:
    """A recommendation's removable share of its trace's step (µs figure, else from the speedup)."""
    us = rec.removable_us_per_step
    if us > 0 and step_us > 0:
        return min(us / step_us, 0.95)
    return _fraction_of(rec.expected_speedup)


def _note(kind: str, recs: Sequence[Mapping[str, Any]], reports: Sequence[TraceReport]) -> str:
    """Why the run's first recommendation is not about its primary kind ("" when it is)."""
    if recs and recs[0].get("kind") == kind:
        return ""
    for tr in reports:
        p = _doc(tr).primary
        if p.kind == kind and p.note:
            return p.note
    nxt = f" The next optimization targets {recs[0].get('kind')} instead." if recs else ""
    return f"No recommendation in this run's traces changes its {kind} time." + nxt


def merge_findings(reports: Sequence[TraceReport]) -> list[dict[str, Any]]:
    """One entry per finding id (its rule id, else its title) with the number of traces that raised
    it; outdated reports are left out."""
    merged: dict[str, dict[str, Any]] = {}
    for tr in readable(reports):
        for finding in _doc(tr).findings:
            fid = finding.id or finding.title
            if not fid:
                continue
            entry = merged.setdefault(fid, {**_plain(finding), "id": fid, "traces": 0})
            entry["traces"] += 1
    return sorted(merged.values(), key=lambda e: (-e["traces"], e["id"]))


def _weighted_utilization(
    reports: Sequence[TraceReport], weights: Sequence[int], times: Sequence[float]
) -> float | None:
    """Run-level GPU utilization: each GPU report's ``metrics.gpu.utilization`` weighted by its time."""
    num = den = 0.0
    for tr, w, t in zip(reports, weights, times, strict=True):
        gpu = _doc(tr).metrics.gpu
        util = gpu.utilization if gpu is not None else None
        if util is not None:
            span = (t if t > 0 else 1.0) * w
            num += float(util) * span
            den += span
    return round(num / den, 6) if den else None


def _weighted_breakdown(reports: Sequence[TraceReport], weights: Sequence[int]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for tr, w in zip(reports, weights, strict=True):
        for key, value in msgspec.structs.asdict(_doc(tr).breakdown).items():
            sums[key] += value * w
    total = sum(weights)
    keys = [k for k in CATEGORIES if k in sums] + sorted(k for k in sums if k not in CATEGORIES)
    return {k: sums[k] / total for k in keys}


def _spread(verdict: RankVerdict) -> dict[str, Any] | None:
    """Min/median/max of per-rank step time, and the busy-time spread stragglers are judged on."""
    known = [r for r in verdict.ranks if (r.rank is not None or r.worker) and r.step_time_us > 0]
    if len(known) < 2:
        return None
    times = [r.step_time_us for r in known]
    return {
        "min_us": min(times),
        "median_us": statistics.median(times),
        "max_us": max(times),
        "max_over_min": max(times) / min(times),
        "basis": verdict.basis,
        "median_busy_us": verdict.median_busy_us,
        "busy_spread": verdict.spread,
    }


def _weighted_mean(values: Sequence[float], weights: Sequence[int]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0


def _common(values: Iterable[Any]) -> Any:
    """The single value all reports share, or the sorted list when they differ."""
    distinct = sorted({v for v in values if v is not None}, key=str)
    return distinct[0] if len(distinct) == 1 else (distinct or None)


def _doc(tr: TraceReport) -> ReportDoc:
    """The typed report of a trace already filtered by ``readable``."""
    doc = tr.doc
    if doc is None:  # pragma: no cover - callers filter with ``readable`` first
        raise ValueError(f"trace {tr.trace_id}: its report is outdated")
    return doc


def _plain(rec: Recommendation) -> dict[str, Any]:
    """A recommendation or finding as JSON values, in the report's key order."""
    out: dict[str, Any] = msgspec.to_builtins(rec)
    return out
