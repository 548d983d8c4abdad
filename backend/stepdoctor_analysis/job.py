"""The verdict of a whole job (all ranks, all capture windows) from its per-trace reports.

One definition for ``stepdoctor analyze DIR`` and the server's run diagnosis (``aggregate``), so
both name the same limiter for the same traces. Reports are the JSON form (``Report.to_dict`` or
what the server stores).

- A report's step time is its ``step_time_us``, else the sum of its breakdown (the parts partition
  each step); its weight is its step count (a report without ``steps`` counts once).
- Kind shares and removable fractions are weighted by each report's steps × step time, so the
  verdict is about where the job's wall time goes, not about how many traces said what.
- The limiter is ``diagnose.choose_limiter`` applied to those run-level figures: the per-trace rule.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import BOTTLENECK_KINDS
from .diagnose import basis_of, choose_limiter, report_basis, report_removable


@dataclass(frozen=True)
class JobLimiter:
    kind: str | None
    reason: str
    shares: dict[str, float]  # kind -> fraction of all profiled step time
    removable: dict[str, tuple[float, str]]  # kind -> (run-level removable fraction, basis)


def step_time_us(report: Mapping[str, Any]) -> float:
    """Average step wall time of one report, in µs: its own figure, else the breakdown's sum."""
    if num(report.get("step_time_us")) > 0:
        return num(report["step_time_us"])
    breakdown = report.get("breakdown")
    return float(sum(num(v) for v in breakdown.values())) if isinstance(breakdown, Mapping) else 0.0


def step_count(report: Mapping[str, Any]) -> int:
    steps = report.get("steps")
    return len(steps) if isinstance(steps, list) and steps else 1


def kind_shares(report: Mapping[str, Any]) -> dict[str, float]:
    """Bottleneck kind -> share of step time: every kind's (``metrics.shares``) when the report has
    them, else the primary and secondary verdicts."""
    metrics = report.get("metrics")
    all_kinds = metrics.get("shares") if isinstance(metrics, Mapping) else None
    if isinstance(all_kinds, Mapping) and all_kinds:
        return {str(k): num(v) for k, v in all_kinds.items()}
    shares: dict[str, float] = {}
    entries = [report.get("primary") or {}, *(report.get("secondary") or [])]
    for entry in entries:
        if isinstance(entry, Mapping) and entry.get("kind"):
            kind = str(entry["kind"])
            shares[kind] = max(shares.get(kind, 0.0), num(entry.get("share")))
    return shares


def job_limiter(reports: Sequence[Mapping[str, Any]]) -> JobLimiter:
    """The job's limiter and the run-level shares and removable time it was chosen from."""
    weights = [step_count(r) for r in reports]
    times = [step_time_us(r) for r in reports]
    shares = weighted_shares(reports, weights, times)
    removable = weighted_removable(reports, weights, times)
    kind, reason = choose_limiter(shares, removable) if shares else (None, "")
    return JobLimiter(kind, reason, shares, removable)


def weighted_shares(
    reports: Sequence[Mapping[str, Any]], weights: Sequence[int], times: Sequence[float]
) -> dict[str, float]:
    """Kind -> fraction of all profiled step time attributed to it, over every report."""
    owned: dict[str, float] = defaultdict(float)
    total = 0.0
    for report, w, t in zip(reports, weights, times, strict=True):
        # A report without a breakdown still votes, with unit weight per step.
        span = (t if t > 0 else 1.0) * w
        total += span
        for kind, share in kind_shares(report).items():
            owned[kind] += share * span
    return {k: v / total for k, v in owned.items()} if total else {}


def weighted_removable(
    reports: Sequence[Mapping[str, Any]], weights: Sequence[int], times: Sequence[float]
) -> dict[str, tuple[float, str]]:
    """Kind -> (run-level removable fraction, basis): each report's ``limiter``, time-weighted."""
    owned: dict[str, float] = defaultdict(float)
    estimated: set[str] = set()  # kinds some report's removable time is an estimate for
    total = 0.0
    for report, w, t in zip(reports, weights, times, strict=True):
        span = (t if t > 0 else 1.0) * w
        total += span
        for kind, frac in report_removable(report, kind_shares(report)).items():
            owned[kind] += frac * span
            if frac > 0 and report_basis(report, kind) == "estimate":
                estimated.add(kind)
    return {
        k: (owned[k] / total if total else 0.0, "estimate" if k in estimated else basis_of(k))
        for k in BOTTLENECK_KINDS
    }


def num(value: Any) -> float:
    """A numeric field as float; missing or non-numeric (e.g. a speedup given as text) counts as 0."""
    if isinstance(value, bool):
        return 0.0
    return float(value) if isinstance(value, int | float) else 0.0
