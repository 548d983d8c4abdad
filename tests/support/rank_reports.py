"""Many ranks' reports made from real ones: each rank a copy of a real fixture's report with its
rank fields rewritten and its compute wobbled a little; the straggler's compute stretched (30% by
default) on top, its step longer by that much (``run_aggregate`` tests, ``bench/run_aggregate.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from stepdoctor_analysis.pipeline import analyze_path
from stepdoctor_analysis.report.contract import ReportDoc
from support.fixtures import HTA_TRACES

# A real rank of an 8-rank job with collectives (exposed communication, arrival at the first
# collective), its compute 75% of the work before them: 30% more compute is 22% more of that work,
# past the 10% a straggler must exceed (``ranks.STRAGGLER``). The others (compute 18-29% of it) serve
# as more bases.
BASES = (
    HTA_TRACES / "trace_diff" / "control" / "control.json.gz",
    HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz",
    HTA_TRACES / "nccl_parser_config" / "nccl_data.json.gz",
)


def base_reports(count: int = 1) -> list[ReportDoc]:
    """The first ``count`` bases' reports (one: every rank the same real trace)."""
    return [analyze_path(p).typed() for p in BASES[:count]]


def with_compute(doc: ReportDoc, factor: float, *, rank: int, world_size: int) -> ReportDoc:
    """``doc`` as rank ``rank``, its compute time × ``factor`` and its step longer by the difference."""
    kinds = dict(doc.metrics.kinds_us)
    extra = kinds.get("compute", 0.0) * (factor - 1.0)
    kinds["compute"] = kinds.get("compute", 0.0) + extra
    step = doc.step_time_us + extra
    metrics = msgspec.structs.replace(
        doc.metrics, kinds_us=kinds, shares={k: v / step for k, v in kinds.items()}
    )
    breakdown = msgspec.structs.replace(doc.breakdown, kernel=doc.breakdown.kernel + extra)
    return msgspec.structs.replace(
        doc, rank=rank, world_size=world_size, step_time_us=step, metrics=metrics, breakdown=breakdown
    )


def rank_reports(
    bases: Sequence[ReportDoc],
    ranks: int,
    *,
    straggler: int | None = None,
    stretch: float = 0.3,
    seed: int = 0,
) -> list[ReportDoc]:
    """One report per rank (rank r from ``bases[r % len(bases)]``), compute within ±2% of the base's
    (deterministic in ``seed``), the straggler's ``1 + stretch`` times that."""
    out = []
    for r in range(ranks):
        wobble = 1.0 + 0.02 * math.sin(1.7 * r + seed)
        factor = wobble * (1.0 + stretch if r == straggler else 1.0)
        out.append(with_compute(bases[r % len(bases)], factor, rank=r, world_size=ranks))
    return out
