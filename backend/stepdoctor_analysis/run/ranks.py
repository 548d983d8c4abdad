"""Ranks, windows and stragglers of one job, from per-trace reports: the one definition that
``stepdoctor analyze DIR`` and the server's run diagnosis both call.

- **Ranks vs windows.** A trace belongs to a rank by its ``distributedInfo`` rank (or the rank the
  run metadata gave at upload); without one, by the process that wrote it (``TraceEntry.worker``:
  the worker name in TensorBoard's file convention ``{host}_{pid}.{time}.pt.trace.json`` for the
  CLI, the agent's host and pid for the server). Several traces of one rank are capture *windows*
  of that rank, never several ranks; traces with no rank information at all are windows of one
  unknown rank, and a name the server gave a stored file never makes a rank.
- **Stragglers by the work done before the collective, not by step time.** With synchronised
  collectives every rank's step lasts as long as the slowest rank's, and the rank with the longest
  step is usually one that *waited* longest. So each rank's step is split into the time it waits in
  exposed communication and the rest, its *busy* time: the work it must finish before it can join
  the collective. A straggler is a rank whose busy time exceeds the median of the other ranks' by
  more than ``STRAGGLER`` (the 10% slack HTA and gpuprof use); comparing with the *others'* median
  lets two ranks suffice. Its cause is the bottleneck kind in which it spends the most time beyond
  the others' median (compute, input, memory, ...). Without communication, busy time is step time.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_left
from collections.abc import Sequence
from pathlib import PurePath
from typing import TypeVar

import msgspec

from .. import BOTTLENECK_KINDS, STRAGGLER_ID
from ..report.contract import Recommendation
from ..report.document import NAMED_RANKS, named_ranks
from ..rules import rule
from .job import job_limiter
from .trace_summary import TraceEntry, TraceSummary, rank_of, summary_of

__all__ = [
    "NAMED_RANKS",
    "TraceEntry",
    "named_ranks",
    "rank_of",
]  # where callers have always imported them from

STRAGGLER = rule(STRAGGLER_ID).threshold  # the straggler card's record (``rules.catalog.JOB_RULES``)
T = TypeVar("T")
_WORKER_RE = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(\.gz)?$")  # TensorBoard's run-file pattern


class RankSummary(msgspec.Struct, kw_only=True):
    """One rank (or worker): its windows' figures, step-weighted."""

    rank: int | None
    worker: str | None  # TensorBoard worker name when the rank is unknown
    traces: int  # capture windows of this rank
    steps: int
    step_time_us: float
    wait_us: float  # exposed communication per step: waiting for the other ranks, or the wire
    busy_us: float  # step time minus the wait: the work before the collectives
    arrival_us: float | None  # step start -> first collective
    kinds_us: dict[str, float]
    primary_kind: str | None
    primary_share: float

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else (self.worker or "unknown rank")


class Straggler(msgspec.Struct, kw_only=True):
    rank: int | None
    worker: str | None
    busy_us: float
    others_busy_us: float  # median busy time of the other ranks
    over_median: float  # busy / others' median
    step_time_us: float
    arrival_late_us: float | None  # how much later than the others' median it reaches the collective
    cause: str | None  # the kind with the largest excess over the others' median
    cause_excess_us: float
    why: str = ""  # ``sentence()``, filled on construction

    def __post_init__(self) -> None:
        if not self.why:
            self.why = self.sentence()

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else (self.worker or "a rank")

    def sentence(self) -> str:
        text = f"{self.label} works {100 * (self.over_median - 1):.0f}% longer before its collectives than the others"
        if self.arrival_late_us is not None and self.arrival_late_us > 0:
            text += f" (arrives {self.arrival_late_us:.0f} µs later)"
        if self.cause:
            text += f"; its extra time is {self.cause} (+{self.cause_excess_us:.0f} µs per step)"
        return text


class RankVerdict(msgspec.Struct, kw_only=True):
    ranks: list[RankSummary]
    windows: int  # traces in all
    basis: str  # "busy time before collectives" or "step time" (no communication anywhere)
    median_busy_us: float
    spread: float  # (max - min busy) / median busy, over ranks with a known identity
    stragglers: list[Straggler] = msgspec.field(default_factory=list)

    @property
    def count(self) -> int:
        """Distinct ranks (workers); one when nothing says the traces came from different ranks."""
        return len(self.ranks)

    def straggler_ranks(self) -> list[int | str]:
        return [s.rank if s.rank is not None else (s.worker or "?") for s in self.stragglers]

    def to_dict(self) -> dict[str, object]:
        """The ``ranks`` section of a directory's report."""
        return {
            "count": self.count,
            "windows": self.windows,
            "basis": self.basis,
            "median_busy_us": self.median_busy_us,
            "spread": self.spread,
            "stragglers": self.straggler_ranks(),
            "straggler_details": msgspec.to_builtins(self.stragglers),
            "per_rank": msgspec.to_builtins(self.ranks),
        }


def worst_first(stragglers: Sequence[Straggler]) -> list[Straggler]:
    """The stragglers by how much longer they work than the others (the ones a sentence names first)."""
    return sorted(stragglers, key=lambda st: (-st.over_median, st.rank if st.rank is not None else -1))


# What to change on a straggler, by the kind of work it has too much of.
_STRAGGLER_CHANGE = {
    "compute": "Give it the same work as the others: balance tokens per rank (length-grouped or token-count "
    "bucketed batches), balance pipeline stages / experts, and check its GPU is the same model and not "
    "throttled (nvidia-smi -q -d PERFORMANCE,CLOCK)",
    "input": "Feed it as fast as the others: more DataLoader workers on its host, its data on local storage, "
    "and no other jobs competing for that host's CPUs",
    "launch": "Free its host CPU: bind each rank to the cores of its GPU's socket (numactl / torchrun "
    "--local-ranks-filter), keep other processes off that host, or cut launch overhead with CUDA graphs",
    "sync": "Remove the host syncs only that rank does (logging, metrics, checkpointing on rank 0): do them "
    "every N steps or on a side thread",
    "memory": "Fix its allocator stalls (cudaMalloc/cudaFree in steady state): "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and no torch.cuda.empty_cache() in the loop",
    "transfer": "Make its copies as fast as the others': pinned memory, and the process bound to the NUMA node "
    "of its GPU",
}
_STRAGGLER_DEFAULT = (
    "Find what that rank does beyond the others (its per-kind times are in ranks.per_rank) and even it out"
)


def straggler_advice(verdict: RankVerdict) -> Recommendation | None:
    """The job-level card when one rank holds the others back.

    Removable: the straggler's extra busy time, which every other rank spends waiting in its
    collectives: a measured wait, like the other communication cards.
    """
    if not verdict.stragglers:
        return None
    worst = max(verdict.stragglers, key=lambda st: st.busy_us - st.others_busy_us)
    excess = max(0.0, worst.busy_us - worst.others_busy_us)
    step = worst.step_time_us
    return Recommendation(
        id=STRAGGLER_ID,
        title=f"Even out the ranks: {worst.label if worst.rank is not None or worst.worker else 'one rank'} "
        "holds the others back",
        kind="communication",
        change=_STRAGGLER_CHANGE.get(worst.cause or "", _STRAGGLER_DEFAULT),
        why=worst.sentence() + "; every other rank waits for it in each collective.",
        expected_speedup=round(step / max(step - excess, 0.05 * step), 3) if step > 0 else 1.0,
        removable_us_per_step=round(excess, 3),
        confidence=0.8,
        caveats=["DDP bucket sizes or compression do not help while the others are waiting, not sending."],
        evidence=msgspec.to_builtins(worst),
        basis="measured",
        expected_speedup_range=None,
    )


def with_straggler_advice(cards: list[T], card: T, primary_kind: str | None) -> list[T]:
    """``cards`` with the straggler card first when the job is communication-bound (the others'
    waits are the verdict), else second, so the first card still addresses the verdict."""
    at = 0 if primary_kind == "communication" or not cards else 1
    return [*cards[:at], card, *cards[at:]]


def worker_name(source: str) -> str | None:
    """TensorBoard's worker name of a trace file (``host_pid`` of ``host_pid.123.pt.trace.json``)."""
    m = _WORKER_RE.match(PurePath(source).name)
    return m.group(1) if m else None


def rank_verdict(entries: Sequence[TraceEntry]) -> RankVerdict:
    """Group traces into ranks and windows, then find stragglers (module docstring)."""
    return rank_verdict_of([summary_of(e, i) for i, e in enumerate(entries)])


def rank_verdict_of(summaries: Sequence[TraceSummary]) -> RankVerdict:
    """``rank_verdict`` over the traces' summaries, in their order."""
    groups: dict[tuple[int | None, str | None], list[TraceSummary]] = {}
    for s in summaries:
        groups.setdefault((s.rank, s.worker), []).append(s)
    ranks = [summarise_rank(rank, worker, group) for (rank, worker), group in sorted_groups(groups)]
    return judge_ranks(ranks, windows=len(summaries))


def sorted_groups(
    groups: dict[tuple[int | None, str | None], T],
) -> list[tuple[tuple[int | None, str | None], T]]:
    """Ranks by number, then workers by name, then the unknown rank."""
    return sorted(groups.items(), key=lambda kv: _order(kv[0]))


def judge_ranks(ranks: list[RankSummary], *, windows: int) -> RankVerdict:
    """The basis, busy-time spread and stragglers of ranks already summarised (in rank order).

    Each rank is compared with the median of the *others*: one sorted list of every rank's value
    gives that median without the rank in O(1) (``_MedianWithout``), so judging N ranks costs
    O(N log N), not N medians of N - 1 values."""
    known = [s for s in ranks if s.rank is not None or s.worker is not None]
    has_comm = any(s.wait_us > 0 or s.arrival_us is not None for s in ranks)
    basis = "busy time before collectives" if has_comm else "step time"
    busy = [s.busy_us for s in known]
    median = statistics.median(busy) if busy else 0.0
    spread = (max(busy) - min(busy)) / median if len(busy) > 1 and median > 0 else 0.0
    others = _Others(known)
    stragglers = [st for s in known if (st := _straggler(s, others))]
    return RankVerdict(
        ranks=ranks,
        windows=windows,
        basis=basis,
        median_busy_us=median,
        spread=spread,
        stragglers=stragglers,
    )


def _order(key: tuple[int | None, str | None]) -> tuple[int, int, str]:
    rank, worker = key
    return (0, rank, "") if rank is not None else (1, 0, worker or "~")


def summarise_rank(rank: int | None, worker: str | None, traces: Sequence[TraceSummary]) -> RankSummary:
    """One rank's windows as one row: step-weighted means, its limiter by the per-trace rule."""
    weights = [t.steps for t in traces]
    total = sum(weights)

    def mean(values: list[float]) -> float:
        return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0

    step = mean([t.step_time_us for t in traces])
    kinds: dict[str, float] = {}
    for k in (*BOTTLENECK_KINDS, "other"):
        kinds[k] = mean([t.kinds_us.get(k, 0.0) for t in traces])
    wait = kinds.get("communication", 0.0)
    arrivals = [(t.arrival_us, w) for t, w in zip(traces, weights, strict=True) if t.arrival_us is not None]
    arrival = sum(a * w for a, w in arrivals) / sum(w for _, w in arrivals) if arrivals else None
    shares = {k: v / step for k, v in kinds.items() if k in BOTTLENECK_KINDS} if step > 0 else {}
    # The rank's limiter by the same rule as the job's and each trace's (``diagnose.choose_limiter``).
    primary = job_limiter(traces).kind if shares and max(shares.values()) > 0 else None
    return RankSummary(
        rank=rank,
        worker=worker,
        traces=len(traces),
        steps=total,
        step_time_us=step,
        wait_us=wait,
        busy_us=max(0.0, step - wait),
        arrival_us=arrival,
        kinds_us=kinds,
        primary_kind=primary,
        primary_share=round(shares.get(primary, 0.0), 4) if primary else 0.0,
    )


class _MedianWithout:
    """``statistics.median`` of a list with one of its values left out, in O(1) after one sort."""

    def __init__(self, values: list[float]) -> None:
        self.sorted = sorted(values)

    def __call__(self, value: float) -> float:
        data, n = self.sorted, len(self.sorted) - 1
        p = bisect_left(data, value)

        def at(j: int) -> float:
            return data[j] if j < p else data[j + 1]

        if n % 2 == 1:
            return at(n // 2)
        i = n // 2
        return (at(i - 1) + at(i)) / 2


class _Others:
    """Medians of the other known ranks' figures (busy time, arrival, a kind's µs), each list sorted
    once and only when some rank is asked about it."""

    def __init__(self, known: list[RankSummary]) -> None:
        self.known = known
        self._cache: dict[str, _MedianWithout] = {}

    def __len__(self) -> int:
        return len(self.known) - 1

    def values(self, name: str) -> list[float]:
        if name == "busy":
            return [o.busy_us for o in self.known]
        if name == "arrival":
            return [o.arrival_us for o in self.known if o.arrival_us is not None]
        return [o.kinds_us.get(name, 0.0) for o in self.known]

    def median(self, name: str, value: float) -> float:
        """The median of the others' ``name`` figures, ``value`` being this rank's own."""
        if name not in self._cache:
            self._cache[name] = _MedianWithout(self.values(name))
        return self._cache[name](value)


def _straggler(s: RankSummary, others: _Others) -> Straggler | None:
    if len(others) < 1:
        return None
    ref = others.median("busy", s.busy_us)
    if ref <= 0 or s.busy_us <= ref * (1 + STRAGGLER):
        return None
    late = None
    if s.arrival_us is not None and len(others.values("arrival")) > 1:  # its own is one of them
        late = s.arrival_us - others.median("arrival", s.arrival_us)
    excess = {k: v - others.median(k, v) for k, v in s.kinds_us.items() if k != "communication"}
    cause = max(excess, key=lambda k: excess[k]) if excess else None
    if cause is not None and excess[cause] <= 0:
        cause = None
    return Straggler(
        rank=s.rank,
        worker=s.worker,
        busy_us=s.busy_us,
        others_busy_us=ref,
        over_median=s.busy_us / ref,
        step_time_us=s.step_time_us,
        arrival_late_us=late,
        cause=cause,
        cause_excess_us=excess[cause] if cause else 0.0,
    )
