"""The run aggregate folded one trace at a time equals the verdict computed from scratch: in any
insertion order, with re-analysed traces replaced, late ranks and removed traces; and at 1,000 ranks
made from real fixture reports it finds the rank whose compute was stretched 30%."""

from __future__ import annotations

import random
from functools import cache

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepdoctor_analysis.report.contract import ReportDoc
from stepdoctor_analysis.run.aggregate import RunAggregate
from stepdoctor_analysis.run.trace_summary import TraceEntry, TraceSummary, decode, encode, summary_of
from stepdoctor_analysis.run.verdict import run_verdict, verdict_of
from support.rank_reports import base_reports, rank_reports, with_compute

RANKS, WINDOWS, WORKERS, VARIANTS = 6, 2, 2, 3  # slots: ranks × windows, then traces without a rank
SLOTS = RANKS * WINDOWS + WORKERS


@cache
def bases() -> tuple[ReportDoc, ...]:
    return tuple(base_reports(3))


@cache
def entry(slot: int, variant: int) -> TraceEntry:
    """Slot ``slot``'s trace as analysed the ``variant``-th time (a re-analysis changes its figures)."""
    doc = with_compute(bases()[slot % 3], 1.0 + 0.15 * variant + 0.01 * slot, rank=0, world_size=RANKS)
    if slot < RANKS * WINDOWS:
        return TraceEntry(doc, rank=slot // WINDOWS, window=slot % WINDOWS, trace_id=100 + slot)
    doc = msgspec.structs.replace(doc, rank=None)  # a trace without rank information: its process names it
    return TraceEntry(doc, window=0, worker=f"host_{slot}", trace_id=100 + slot)


@cache
def summary(slot: int, variant: int) -> TraceSummary:
    return summary_of(entry(slot, variant))


def scratch(held: dict[int, int], failed: int = 0) -> bytes:
    return msgspec.json.encode(verdict_of([summary(s, held[s]) for s in sorted(held)], failed=failed))


OPS = st.lists(
    st.tuples(st.integers(0, SLOTS - 1), st.integers(0, VARIANTS - 1), st.integers(0, 9)), max_size=30
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, failed=st.integers(0, 2))
def test_incremental_aggregate_equals_from_scratch(ops: list[tuple[int, int, int]], failed: int) -> None:
    agg, held = RunAggregate(), dict[int, int]()
    for slot, variant, roll in ops:
        if roll == 0 and held:  # a trace taken out (deleted, or its report unreadable)
            gone = sorted(held)[slot % len(held)]
            agg.remove(100 + gone)
            del held[gone]
        else:  # a new trace, a late rank, or a re-analysis of one already held
            agg.add(summary(slot, variant))
            held[slot] = variant
        assert msgspec.json.encode(agg.verdict(failed=failed)) == scratch(held, failed)
    # ... and equal to the verdict over the reports themselves, in the run's order
    entries = [entry(s, held[s]) for s in sorted(held)]
    assert msgspec.json.encode(agg.verdict()) == msgspec.json.encode(run_verdict(entries))


def test_summary_survives_storage_to_the_bit() -> None:
    s = summary(3, 1)
    assert decode(encode(s)) == s
    assert decode(b'{"summary_version": 0}') is None  # another layout: rebuilt from the report


def test_straggler_found_among_1000_ranks_in_any_order() -> None:
    docs = rank_reports(bases()[:1], 1000, straggler=613)  # every rank the same real trace
    entries = [TraceEntry(d, window=0, trace_id=5000 + r) for r, d in enumerate(docs)]
    summaries = [summary_of(e) for e in entries]
    agg = RunAggregate()
    for s in random.Random(7).sample(summaries, len(summaries)):
        agg.add(s)
    verdict = agg.verdict()
    assert [s.rank for s in verdict.stragglers] == [613]
    assert verdict.stragglers[0].cause == "compute"
    assert verdict.rank_basis == "busy time before collectives"
    assert msgspec.json.encode(verdict) == msgspec.json.encode(run_verdict(entries))
    # rank 613 re-analysed after a fix: no straggler, the same as from scratch
    fixed = TraceEntry(with_compute(bases()[0], 1.0, rank=613, world_size=1000), trace_id=5613, window=0)
    agg.replace(summary_of(fixed))
    again = agg.verdict()
    assert again.stragglers == []
    entries[613] = fixed
    assert msgspec.json.encode(again) == msgspec.json.encode(run_verdict(entries))
