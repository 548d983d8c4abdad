"""The limiter of a whole job (all ranks, all capture windows) from its per-trace reports.

One definition for ``stepdoctor analyze DIR`` and the server's run diagnosis (both through
``run_verdict.run_verdict``), so both name the same limiter for the same traces. The per-report
figures (step time, steps, span, removable shares) are read from typed reports
(``contract.ReportDoc``) once, into each trace's ``trace_summary.TraceSummary``; the weighting reads
those summaries.

- A report's step time is its ``step_time_us``, else the sum of its breakdown (the parts partition
  each step); its weight is its step count (a report without ``steps`` counts once).
- Kind shares and removable fractions are weighted by each report's steps × step time, so the
  verdict is about where the job's wall time goes, not about how many traces said what: the run's
  time per kind over its steady-state steps, divided by its step time.
- The limiter is ``diagnose.choose_limiter`` applied to those run-level figures: the per-trace rule.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .. import BOTTLENECK_KINDS
from ..report.contract import ReportDoc
from ..rules.diagnose import WAIT_KINDS, basis_of, choose_limiter


@dataclass(frozen=True)
class JobLimiter:
    kind: str | None
    reason: str
    shares: dict[str, float]  # kind -> fraction of all profiled step time
    removable: dict[str, tuple[float, str]]  # kind -> (run-level removable fraction, basis)


def step_time_us(report: ReportDoc) -> float:
    """Average step wall time of one report, in µs: its own figure, else the breakdown's sum."""
    if report.step_time_us > 0:
        return report.step_time_us
    b = report.breakdown
    return b.kernel + b.memcpy + b.memset + b.communication + b.runtime + b.dataloader + b.cpu_exec + b.other


def step_count(report: ReportDoc) -> int:
    return len(report.steps) or 1


def span_us(report: ReportDoc) -> float:
    """The report's weight in a run: its profiled steady-state time (steps × step time; a report
    without a step time still votes, with unit weight per step)."""
    t = step_time_us(report)
    return (t if t > 0 else 1.0) * step_count(report)


def kind_shares(report: ReportDoc) -> dict[str, float]:
    """Bottleneck kind (and "other") -> share of the report's step time."""
    return dict(report.metrics.shares)


def removable_shares(report: ReportDoc) -> dict[str, tuple[float, str]]:
    """Kind -> (removable fraction of the step, basis) from the report's ``limiter`` section.

    Reports from before that section: the waits' shares count as measured removable time, and
    compute has no estimate.
    """
    out: dict[str, tuple[float, str]] = {}
    shares = kind_shares(report)
    for kind in BOTTLENECK_KINDS:
        entry = report.limiter.get(kind) if report.limiter is not None else None
        if entry is not None:
            out[kind] = (entry.removable_share, entry.basis)
        else:
            out[kind] = (shares.get(kind, 0.0) if kind in WAIT_KINDS else 0.0, basis_of(kind))
    return out


class Weighed(Protocol):
    """What the run-level weighting reads of one trace (``trace_summary.TraceSummary``)."""

    @property
    def span_us(self) -> float: ...
    @property
    def shares(self) -> Mapping[str, float]: ...
    @property
    def removable(self) -> Mapping[str, tuple[float, str]]: ...


def job_limiter(reports: Sequence[Weighed]) -> JobLimiter:
    """The job's limiter and the run-level shares and removable time it was chosen from."""
    shares = weighted_shares(reports)
    removable = weighted_removable(reports)
    kind, reason = choose_limiter(shares, removable) if shares else (None, "")
    return JobLimiter(kind, reason, shares, removable)


def weighted_shares(reports: Sequence[Weighed]) -> dict[str, float]:
    """Kind -> fraction of all profiled step time attributed to it, over every report."""
    owned: dict[str, float] = defaultdict(float)
    total = 0.0
    for report in reports:
        span = report.span_us
        total += span
        for kind, share in report.shares.items():
            owned[kind] += share * span
    return {k: v / total for k, v in owned.items()} if total else {}


def weighted_removable(reports: Sequence[Weighed]) -> dict[str, tuple[float, str]]:
    """Kind -> (run-level removable fraction, basis): each report's ``limiter``, time-weighted."""
    owned: dict[str, float] = defaultdict(float)
    estimated: set[str] = set()  # kinds some report's removable time is an estimate for
    total = 0.0
    for report in reports:
        span = report.span_us
        total += span
        for kind, (frac, basis) in report.removable.items():
            owned[kind] += frac * span
            if frac > 0 and basis == "estimate":
                estimated.add(kind)
    return {
        k: (owned[k] / total if total else 0.0, "estimate" if k in estimated else basis_of(k))
        for k in BOTTLENECK_KINDS
    }
