"""Run-level diagnosis from the per-trace reports of one run (all ranks, all capture windows).

Pure: takes report dicts (as stored in ``analyses.report``) and returns a JSON-ready dict, so the
worker, the API and the tests share one definition of "what is this run bound by".

Conventions:
- A report's step time is its ``step_time_us``, else the sum of its breakdown: the breakdown parts
  partition each step's wall time (TensorBoard's priority walk), so they add up to the average step.
- Breakdown and bottleneck shares are weighted by each report's step count, so a 6-step window
  counts six times a 1-step one. A report without ``steps`` counts once.
- The primary kind is the kind with the largest step-time-weighted share over all reports, i.e.
  the kind that owns the most wall time of the run, not the most frequent per-rank label.
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
from typing import Any

from stepdoctor_analysis import BOTTLENECK_KINDS, BREAKDOWN_CATEGORIES
from stepdoctor_analysis.ranks import RankVerdict, rank_verdict
from stepdoctor_analysis.ranks import TraceEntry as RankEntry

# Breakdown categories in the TensorBoard plugin's priority order; unknown keys are kept after these.
CATEGORIES = BREAKDOWN_CATEGORIES
# The bottleneck vocabulary; a report's ``metrics.shares`` also carries unattributed time ("other"),
# which is kept in the shares but can never be the primary kind.
KINDS = BOTTLENECK_KINDS
DIAGNOSIS_VERSION = 1


@dataclass(frozen=True)
class TraceReport:
    """One analysed trace of a run: where it came from and its engine report."""

    trace_id: int
    rank: int | None
    window_index: int | None
    report: Mapping[str, Any]


def step_time_us(report: Mapping[str, Any]) -> float:
    """Average step wall time of one report, in µs: its own figure, else the breakdown's sum."""
    if _num(report.get("step_time_us")) > 0:
        return _num(report["step_time_us"])
    breakdown = report.get("breakdown") or {}
    return float(sum(_num(v) for v in breakdown.values()))


def step_count(report: Mapping[str, Any]) -> int:
    steps = report.get("steps")
    return len(steps) if isinstance(steps, list) and steps else 1


def kind_shares(report: Mapping[str, Any]) -> dict[str, float]:
    """Bottleneck kind -> share of step time: every kind's (``metrics.shares``) when the report has
    them, else the primary and secondary verdicts."""
    all_kinds = (report.get("metrics") or {}).get("shares")
    if isinstance(all_kinds, Mapping) and all_kinds:
        return {str(k): _num(v) for k, v in all_kinds.items()}
    shares: dict[str, float] = {}
    entries = [report.get("primary") or {}, *(report.get("secondary") or [])]
    for entry in entries:
        if isinstance(entry, Mapping) and entry.get("kind"):
            kind = str(entry["kind"])
            shares[kind] = max(shares.get(kind, 0.0), _num(entry.get("share")))
    return shares


def aggregate_run(reports: Sequence[TraceReport], *, failed: int = 0, pending: int = 0) -> dict[str, Any]:
    """Combine every analysed trace of a run into one diagnosis (see the module docstring)."""
    if not reports:
        return {
            "diagnosis_version": DIAGNOSIS_VERSION,
            "traces": 0,
            "failed": failed,
            "pending": pending,
            "primary": None,
        }
    weights = [step_count(r.report) for r in reports]
    times = [step_time_us(r.report) for r in reports]
    breakdown = _weighted_breakdown(reports, weights)
    shares = _weighted_shares(reports, weights, times)
    primary_kind = _primary_kind(shares)
    verdict = rank_verdict([RankEntry(r.report, rank=r.rank, window=r.window_index) for r in reports])
    ranks = [asdict(s) for s in verdict.ranks]
    spread = _spread(verdict)
    stragglers = [asdict(st) | {"why": st.sentence()} for st in verdict.stragglers]
    return {
        "diagnosis_version": DIAGNOSIS_VERSION,
        "engine_version": _common(r.report.get("engine_version") for r in reports),
        "schema_version": _common(r.report.get("schema_version") for r in reports),
        "traces": len(reports),
        "failed": failed,
        "pending": pending,
        "windows": len({r.window_index for r in reports}),
        "steps": sum(weights),
        "step_time_us": _weighted_mean(times, weights),
        "breakdown": breakdown,
        "primary": None
        if primary_kind is None
        else {"kind": primary_kind, "share": round(shares[primary_kind], 6)},
        "shares": {k: round(v, 6) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        "recommendations": merge_recommendations(reports),
        "findings": merge_findings(reports),
        "ranks": ranks,
        "rank_spread": spread,
        "stragglers": stragglers,
    }


def merge_recommendations(reports: Sequence[TraceReport]) -> list[dict[str, Any]]:
    """One entry per recommendation id, ranked by how often it was a trace's *first* advice.

    Ties go to how many traces gave it at all, then to the largest expected speedup.
    """
    merged: dict[str, dict[str, Any]] = {}
    for tr in reports:
        for pos, rec in enumerate(tr.report.get("recommendations") or []):
            if not isinstance(rec, Mapping) or not rec.get("id"):
                continue
            entry = merged.setdefault(str(rec["id"]), {**rec, "traces": 0, "first_in": 0, "ranks": []})
            entry["traces"] += 1
            entry["first_in"] += pos == 0
            if tr.rank is not None and tr.rank not in entry["ranks"]:
                entry["ranks"].append(tr.rank)
            if _num(rec.get("expected_speedup")) > _num(entry.get("expected_speedup")):
                entry["expected_speedup"] = rec.get("expected_speedup")
    for entry in merged.values():
        entry["ranks"].sort()
    return sorted(
        merged.values(),
        key=lambda e: (-e["first_in"], -e["traces"], -_num(e.get("expected_speedup")), str(e["id"])),
    )


def merge_findings(reports: Sequence[TraceReport]) -> list[dict[str, Any]]:
    """One entry per finding id with the number of traces that raised it."""
    merged: dict[str, dict[str, Any]] = {}
    for tr in reports:
        for finding in tr.report.get("findings") or []:
            fid = finding_id(finding)
            if fid is None:
                continue
            entry = merged.setdefault(fid, {**finding, "id": fid, "traces": 0})
            entry["traces"] += 1
    return sorted(merged.values(), key=lambda e: (-e["traces"], e["id"]))


def finding_id(finding: Any) -> str | None:
    """Stable identity of a finding across runs: its rule id (``id``/``rule``), else its title."""
    if not isinstance(finding, Mapping):
        return None
    for key in ("id", "rule", "title"):
        if finding.get(key):
            return str(finding[key])
    return None


def _primary_kind(shares: Mapping[str, float]) -> str | None:
    """The bottleneck kind owning the most time (ties broken by name, so the result is stable)."""
    candidates = [k for k in shares if k in KINDS] or list(shares)
    return max(candidates, key=lambda k: (shares[k], k)) if candidates else None


def _weighted_breakdown(reports: Sequence[TraceReport], weights: Sequence[int]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for tr, w in zip(reports, weights, strict=True):
        for key, value in (tr.report.get("breakdown") or {}).items():
            sums[str(key)] += _num(value) * w
    total = sum(weights)
    keys = [k for k in CATEGORIES if k in sums] + sorted(k for k in sums if k not in CATEGORIES)
    return {k: sums[k] / total for k in keys}


def _weighted_shares(
    reports: Sequence[TraceReport], weights: Sequence[int], times: Sequence[float]
) -> dict[str, float]:
    """Kind -> fraction of all profiled step time attributed to it, over every report."""
    owned: dict[str, float] = defaultdict(float)
    total = 0.0
    for tr, w, t in zip(reports, weights, times, strict=True):
        # A report without a breakdown still votes, with unit weight per step.
        span = (t if t > 0 else 1.0) * w
        total += span
        for kind, share in kind_shares(tr.report).items():
            owned[kind] += share * span
    return {k: v / total for k, v in owned.items()} if total else {}


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


def _num(value: Any) -> float:
    """A numeric field as float; missing or non-numeric (e.g. a speedup given as text) counts as 0."""
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, int | float):
        return float(value)
    return 0.0
