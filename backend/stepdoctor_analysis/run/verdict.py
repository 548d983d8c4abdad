"""This run's verdict: one typed answer over a run's analysed traces, grouped into ranks and windows.

The one function ``stepdoctor analyze DIR`` (``pipeline``), the server's run diagnosis, the API and
every dashboard page call, so they show the same kind, share, step time, gain and first card.

Conventions (every figure comes from one time-weighted aggregate over the run's steady-state steps):
- A report's step time is its ``step_time_us`` (else its breakdown's sum); its weight is its steps ×
  step time (``job.span_us``). The run's step time is the step-weighted mean, so the run's time per
  kind (``kinds_us``) is its ``shares`` × ``step_time_us``, the breakdown sums to the same step.
- The limiter is ``job.job_limiter`` (the per-trace rule, ``diagnose.choose_limiter``, applied to
  the run-level shares and removable time).
- Gains add up: a removable fraction ``f`` of the step ``S`` is ``M = f × S`` µs less per step and
  ``N = 1 / (1 - f) = S / (S - M)`` × faster (``f`` at most ``MAX_REMOVABLE``), for the verdict and
  for every card.
- Recommendations merge by id, their removable time averaged over the run (a trace without one
  contributes nothing), so one window's optimistic figure does not stand for the run; cards at or
  below ``MIN_CARD_SPEEDUP`` are dropped, measured waits rank before estimates, and the limiter's
  best card leads (the straggler card first when the run is communication-bound).
- Ranks, windows and stragglers: ``ranks.rank_verdict``. Windows are never ranks: the traces of one
  process (same rank, or same worker, or no identity at all) are its windows, and have no straggler.
- The verdict reads each trace's ``trace_summary.TraceSummary`` only, never its report, so the server
  folds one more trace into a run (``run_aggregate.RunAggregate``) without re-reading the others.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import msgspec

from .. import BREAKDOWN_CATEGORIES
from ..report.consistency import consistent
from ..report.contract import Recommendation
from ..rules import declared
from ..rules.diagnose import MIN_CARD_SPEEDUP, sure_share
from .job import job_limiter
from .memory import run_leak, with_run_leak
from .ranks import (
    NAMED_RANKS,
    RankSummary,
    RankVerdict,
    Straggler,
    named_ranks,
    rank_verdict_of,
    straggler_advice,
    with_straggler_advice,
    worst_first,
)
from .timeline import Memory as SeriesMemory
from .trace_summary import TraceEntry, TraceSummary, summary_of

DIAGNOSIS_VERSION = 2  # the layout of ``RunVerdict``: a stored one of another version is stale
MAX_REMOVABLE = 0.95  # no change removes more than this fraction of a step (gains cap at 20×)


class RunPrimary(msgspec.Struct, kw_only=True):
    """The run's limiter: its share of the step, and what removing its removable part gains."""

    kind: str
    share: float  # of the run's step time (``RunVerdict.shares[kind]``)
    us_per_step: float  # share × step time
    removable_share: float  # what its best change surely removes, fraction of the step
    removable_us_per_step: float  # removable_share × step time
    gain: float  # step / (step - removable µs) = 1 / (1 - removable_share)
    basis: str  # "measured" wait or "estimate"
    reason: str  # why it was chosen (``diagnose.choose_limiter``)
    note: str = ""  # why the first card is not about this kind ("" when it is)


class RunCard(msgspec.Struct, kw_only=True):
    """A recommendation merged over the run's traces, its gain recomputed over the whole run."""

    id: str
    title: str
    kind: str
    change: str
    why: str
    expected_speedup: float  # 1 / (1 - removable_share)
    removable_us_per_step: float  # removable_share × the run's step time
    removable_share: float  # of the run's step time
    confidence: float
    caveats: list[str]
    evidence: dict[str, Any]
    basis: str = "measured"
    expected_speedup_range: tuple[float, float] | None = None
    traces: int = 0  # traces that proposed it
    first_in: int = 0  # traces whose first card it was
    ranks: list[int] = msgspec.field(default_factory=list)


class RunFinding(Recommendation, kw_only=True):
    """A trace's finding with the number of traces that raised it (the card's fields are the trace's)."""

    traces: int = 0


C = TypeVar("C", "RunCard", "RunFinding")


class RemovableShare(msgspec.Struct):
    share: float
    basis: str


class RankSpread(msgspec.Struct, kw_only=True):
    """Min/median/max of per-rank step time, and the busy-time spread stragglers are judged on."""

    min_us: float
    median_us: float
    max_us: float
    max_over_min: float
    basis: str
    median_busy_us: float
    busy_spread: float


class RunVerdict(msgspec.Struct, kw_only=True):
    """The run's diagnosis (module docstring); the server stores it as ``runs.diagnosis``."""

    diagnosis_version: int = DIAGNOSIS_VERSION
    engine_version: str | list[str] | None = None
    schema_version: int | list[int] | None = None
    traces: int = 0  # analysed traces read
    failed: int = 0
    pending: int = 0
    outdated: int = 0  # analysed traces whose report another engine wrote (left out)
    windows: int = 0  # capture windows per rank, at most
    steps: int = 0
    step_time_us: float = 0.0
    breakdown: dict[str, float] = msgspec.field(default_factory=dict)
    primary: RunPrimary | None = None
    shares: dict[str, float] = msgspec.field(default_factory=dict)
    kinds_us: dict[str, float] = msgspec.field(default_factory=dict)  # shares × step time
    removable: dict[str, RemovableShare] = msgspec.field(default_factory=dict)
    gpu_utilization: float | None = None  # same weighting as the shares
    recommendations: list[RunCard] = msgspec.field(default_factory=list)
    findings: list[RunFinding] = msgspec.field(default_factory=list)
    ranks: list[RankSummary] = msgspec.field(default_factory=list)
    rank_spread: RankSpread | None = None
    rank_basis: str = "step time"  # what stragglers are judged by (``ranks.RankVerdict.basis``)
    median_busy_us: float = 0.0
    busy_spread: float = 0.0
    stragglers: list[Straggler] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)
    lead: int | None = None  # index of the trace whose report stands for the run's details
    lead_trace_id: int | None = None  # that trace's server id (``TraceEntry.trace_id``), when known
    computed_at: str | None = None  # set by the server when it stores the verdict

    def rank_section(self) -> RankVerdict:
        """Ranks, windows and stragglers as ``ranks.rank_verdict`` gave them."""
        return RankVerdict(
            ranks=self.ranks,
            windows=self.traces,
            basis=self.rank_basis,
            median_busy_us=self.median_busy_us,
            spread=self.busy_spread,
            stragglers=self.stragglers,
        )


def gain_of(removable_share: float) -> float:
    """The speedup of removing ``removable_share`` of a step: ``S / (S - M)``."""
    return round(1.0 / (1.0 - min(max(removable_share, 0.0), MAX_REMOVABLE)), 3)


def run_verdict(
    entries: Sequence[TraceEntry],
    *,
    failed: int = 0,
    pending: int = 0,
    outdated: int = 0,
    series: SeriesMemory | None = None,
) -> RunVerdict:
    """Combine every analysed trace of a run into one verdict (module docstring); ``series``: the
    run's step-series memory, when known (a leak over the whole run, ``memory_run.run_leak``)."""
    summaries = [summary_of(e, i) for i, e in enumerate(entries)]
    return verdict_of(summaries, failed=failed, pending=pending, outdated=outdated, series=series)


def verdict_of(
    summaries: Sequence[TraceSummary],
    *,
    ranks: RankVerdict | None = None,
    failed: int = 0,
    pending: int = 0,
    outdated: int = 0,
    series: SeriesMemory | None = None,
) -> RunVerdict:
    """The run's verdict from its traces' summaries, in run order (``TraceSummary.key``).

    ``ranks``: the rank section when the caller keeps it up to date (``run_aggregate``), else it is
    computed here (``ranks.rank_verdict_of``)."""
    docs = summaries
    if not docs:
        return RunVerdict(failed=failed, pending=pending, outdated=outdated)
    weights = [d.steps for d in docs]
    step = _weighted_mean([d.step_time_us for d in docs], weights)
    limiter = job_limiter(docs)
    shares = limiter.shares
    if ranks is None:
        ranks = rank_verdict_of(docs)
    cards = merge_recommendations(docs, step, limiter.kind)
    findings = merge_findings(docs)
    if (leak := run_leak(((d.rank, d.worker, d.memory_ends) for d in docs), series=series)) is not None:
        found = RunFinding(**(msgspec.structs.asdict(leak.finding()) | {"traces": leak.traces}))
        findings = with_run_leak(findings, found)
    if (straggler := straggler_advice(ranks)) is not None:  # the others wait: fix the straggler first
        card = _run_card(straggler, straggler.removable_us_per_step / step if step > 0 else 0.0, step)
        cards = with_straggler_advice(cards, card, limiter.kind)
        finding = RunFinding(**(msgspec.structs.asdict(straggler) | {"traces": len(docs)}))
        findings = with_straggler_advice(findings, finding, limiter.kind)
    # The run's cards join after each trace's consistency stage: held to the same rules.
    cards, findings = _consistent(cards), _consistent(findings)
    primary = None
    if limiter.kind is not None:
        removable, basis = limiter.removable[limiter.kind]
        removable = min(removable, MAX_REMOVABLE)
        share = round(shares.get(limiter.kind, 0.0), 6)
        primary = RunPrimary(
            kind=limiter.kind,
            share=share,
            us_per_step=round(share * step, 3),
            removable_share=round(removable, 6),
            removable_us_per_step=round(removable * step, 3),
            gain=gain_of(removable),
            basis=basis,
            reason=limiter.reason,
            note=_note(limiter.kind, cards, docs),
        )
    return RunVerdict(
        engine_version=_common(d.engine_version for d in docs),
        schema_version=_common(d.schema_version for d in docs),
        traces=len(docs),
        failed=failed,
        pending=pending,
        outdated=outdated,
        windows=max((r.traces for r in ranks.ranks), default=0),
        steps=sum(weights),
        step_time_us=step,
        breakdown=_weighted_breakdown(docs, weights),
        primary=primary,
        shares={k: round(v, 6) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        kinds_us={k: round(v * step, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        removable={k: RemovableShare(round(v[0], 6), v[1]) for k, v in limiter.removable.items()},
        gpu_utilization=_weighted_utilization(docs),
        recommendations=cards,
        findings=findings,
        ranks=ranks.ranks,
        rank_spread=_spread(ranks),
        rank_basis=ranks.basis,
        median_busy_us=ranks.median_busy_us,
        busy_spread=ranks.spread,
        stragglers=ranks.stragglers,
        warnings=_warnings(ranks),
        lead=(lead := _lead(docs, ranks, limiter.kind)),
        lead_trace_id=docs[lead].trace_id,
    )


def merge_recommendations(
    traces: Sequence[TraceSummary | TraceEntry], step_us: float, primary_kind: str | None
) -> list[RunCard]:
    """One card per recommendation id, its removable time averaged over the run's profiled time."""
    summaries = [t if isinstance(t, TraceSummary) else summary_of(t, i) for i, t in enumerate(traces)]
    total = sum(s.span_us for s in summaries) or 1.0
    merged: dict[str, RunCard] = {}
    seen: dict[str, set[int]] = defaultdict(set)  # ranks already on each card
    removable: dict[str, float] = defaultdict(float)
    ranges: dict[str, list[float]] = {}
    for s in summaries:
        span, t = s.span_us, s.step_time_us
        rank = s.rank
        for pos, rec in enumerate(s.recommendations):
            if not rec.id:
                continue
            card = merged.get(rec.id)
            if card is None:  # the first trace that proposed it gives its text
                card = merged[rec.id] = _run_card(rec, 0.0, step_us)
            card.traces += 1
            card.first_in += pos == 0
            if rank is not None and rank not in seen[rec.id]:
                seen[rec.id].add(rank)
                card.ranks.append(rank)
            frac = _removable_fraction(rec, t)
            removable[rec.id] += frac * span
            if rec.expected_speedup_range is not None and frac > 0:
                acc = ranges.setdefault(rec.id, [0.0, 0.0])
                for i in (0, 1):
                    acc[i] += _fraction_of(rec.expected_speedup_range[i]) * span
    out = []
    for rid, card in merged.items():
        card.ranks.sort()
        frac = min(removable[rid] / total, MAX_REMOVABLE)
        card.removable_share = round(frac, 6)
        card.removable_us_per_step = round(frac * step_us, 3)
        card.expected_speedup = gain_of(frac)
        rng = ranges.get(rid)
        card.expected_speedup_range = (gain_of(rng[0] / total), gain_of(rng[1] / total)) if rng else None
        if card.change and card.expected_speedup > MIN_CARD_SPEEDUP:
            out.append(card)
    out.sort(
        key=lambda c: (
            -sure_share(
                c.removable_share,
                c.basis or "measured",
                c.kind or "",
                c.expected_speedup_range[0] if c.expected_speedup_range else None,
            ),
            -c.traces,
            c.id,
        )
    )
    own = next((c for c in out if c.kind == primary_kind), None)
    return out if own is None else [own, *(c for c in out if c is not own)]


def _run_card(rec: Recommendation, removable_share: float, step_us: float) -> RunCard:
    """A trace's card as a run card; given a run-level removable share (the straggler's), its gain
    and removable time over the run's step."""
    fields = msgspec.structs.asdict(rec)
    share = min(removable_share, MAX_REMOVABLE)
    if removable_share > 0:
        fields["expected_speedup"] = gain_of(share)
        fields["removable_us_per_step"] = round(share * step_us, 3)
    return RunCard(**fields, removable_share=round(share, 6))


def _consistent(items: list[C]) -> list[C]:
    """``consistency.consistent`` over run cards or findings: the same ones dropped, facts' ranges cleared."""
    kept = {r.id: r for r in consistent([_recommendation(i) for i in items], declared)}
    return [
        msgspec.structs.replace(i, expected_speedup_range=kept[i.id].expected_speedup_range)
        for i in items
        if i.id in kept
    ]


def _recommendation(item: RunCard | RunFinding) -> Recommendation:
    return Recommendation(**{f: getattr(item, f) for f in Recommendation.__struct_fields__})


def merge_findings(docs: Sequence[TraceSummary]) -> list[RunFinding]:
    """One entry per finding id (its rule id, else its title) with the number of traces that raised it."""
    merged: dict[str, RunFinding] = {}
    for doc in docs:
        for finding in doc.findings:
            fid = finding.id or finding.title
            if not fid:
                continue
            entry = merged.get(fid)
            if entry is None:
                entry = merged[fid] = RunFinding(**(msgspec.structs.asdict(finding) | {"id": fid}))
            entry.traces += 1
    return sorted(merged.values(), key=lambda f: (-f.traces, f.id))


def _fraction_of(speedup: float) -> float:
    """The removable fraction of the step behind a speedup ``1 / (1 - f)``."""
    return 1.0 - 1.0 / speedup if speedup > 1.0 else 0.0


def _removable_fraction(rec: Recommendation, step_us: float) -> float:
    """A recommendation's removable share of its trace's step (µs figure, else from the speedup)."""
    if rec.removable_us_per_step > 0 and step_us > 0:
        return min(rec.removable_us_per_step / step_us, MAX_REMOVABLE)
    return _fraction_of(rec.expected_speedup)


def _note(kind: str, cards: Sequence[RunCard], docs: Sequence[TraceSummary]) -> str:
    """Why the run's first recommendation is not about its primary kind ("" when it is)."""
    if cards and cards[0].kind == kind:
        return ""
    for doc in docs:
        if doc.primary_kind == kind and doc.primary_note:
            return doc.primary_note
    nxt = f" The next optimization targets {cards[0].kind} instead." if cards else ""
    return f"No recommendation in this run's traces changes its {kind} time." + nxt


def _warnings(ranks: RankVerdict) -> list[str]:
    out = []
    if ranks.count == 1 and ranks.windows > 1:
        out.append(
            f"{ranks.windows} traces of one rank: these are capture windows, averaged by step, not ranks"
        )
    # Each straggler's own sentence while they are few; at scale the worst few, then the rest counted.
    named = ranks.stragglers if len(ranks.stragglers) <= NAMED_RANKS else worst_first(ranks.stragglers)
    out += [f"straggler: {st.why}; the other ranks wait for it in collectives" for st in named[:NAMED_RANKS]]
    if len(named) > NAMED_RANKS:
        out.append(
            f"{len(named)} stragglers by {ranks.basis}: "
            f"{named_ranks([st.label for st in named])} (every rank in ranks.per_rank)"
        )
    return out


def _lead(docs: Sequence[TraceSummary], ranks: RankVerdict, kind: str | None) -> int:
    """The trace whose report stands for the run's details: one whose own verdict is the run's (a
    straggler's first), the slowest of those; the slowest trace when none is."""
    stragglers = {s.rank if s.rank is not None else s.worker for s in ranks.stragglers}

    def who(d: TraceSummary) -> int | str | None:
        return d.rank if d.rank is not None else d.worker

    agreeing = [i for i, d in enumerate(docs) if d.primary_kind == kind]
    pool = [i for i in agreeing if who(docs[i]) in stragglers] or agreeing or list(range(len(docs)))
    return max(pool, key=lambda i: docs[i].step_time_us)


def _weighted_utilization(docs: Sequence[TraceSummary]) -> float | None:
    """Run-level GPU utilization: each GPU report's ``metrics.gpu.utilization`` weighted by its time."""
    num = den = 0.0
    for doc in docs:
        if doc.gpu_utilization is not None:
            span = doc.span_us
            num += doc.gpu_utilization * span
            den += span
    return round(num / den, 6) if den else None


def _weighted_breakdown(docs: Sequence[TraceSummary], weights: Sequence[int]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for doc, w in zip(docs, weights, strict=True):
        for key, value in doc.breakdown.items():
            sums[key] += value * w
    total = sum(weights)
    keys = [k for k in BREAKDOWN_CATEGORIES if k in sums] + sorted(
        k for k in sums if k not in BREAKDOWN_CATEGORIES
    )
    return {k: sums[k] / total for k in keys}


def _spread(verdict: RankVerdict) -> RankSpread | None:
    known = [r for r in verdict.ranks if (r.rank is not None or r.worker) and r.step_time_us > 0]
    if len(known) < 2:
        return None
    times = [r.step_time_us for r in known]
    return RankSpread(
        min_us=min(times),
        median_us=statistics.median(times),
        max_us=max(times),
        max_over_min=max(times) / min(times),
        basis=verdict.basis,
        median_busy_us=verdict.median_busy_us,
        busy_spread=verdict.spread,
    )


def _weighted_mean(values: Sequence[float], weights: Sequence[int]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0


def _common(values: Iterable[Any]) -> Any:
    """The single value all reports share, or the sorted list when they differ."""
    distinct = sorted({v for v in values if v is not None}, key=str)
    return distinct[0] if len(distinct) == 1 else (distinct or None)
