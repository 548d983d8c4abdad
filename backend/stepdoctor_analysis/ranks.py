"""Ranks, windows and stragglers of one job, from per-trace reports: the one definition that
``stepdoctor analyze DIR`` and the server's run diagnosis both call.

- **Ranks vs windows.** A trace belongs to a rank by its ``distributedInfo`` rank (or the rank the
  run metadata gave at upload); without one, by its worker name in TensorBoard's file convention
  (``{host}_{pid}.{time}.pt.trace.json``). Several traces of one rank are capture *windows* of that
  rank, never several ranks; traces with no rank information at all are windows of one unknown rank.
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import PurePath
from typing import Any

from . import BOTTLENECK_KINDS, STRAGGLER_ID
from .job import job_limiter, num, step_count, step_time_us

STRAGGLER = 0.10
_WORKER_RE = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(\.gz)?$")  # TensorBoard's run-file pattern

RankKey = int | str | None  # a rank number, a worker name, or unknown


@dataclass(frozen=True)
class TraceEntry:
    """One analysed trace: its report (JSON form) and the rank the caller knows, if any."""

    report: Mapping[str, Any]
    rank: int | None = None  # from upload metadata; else the report's own ``rank``
    window: int | None = None


@dataclass(frozen=True)
class RankSummary:
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


@dataclass(frozen=True)
class Straggler:
    rank: int | None
    worker: str | None
    busy_us: float
    others_busy_us: float  # median busy time of the other ranks
    over_median: float  # busy / others' median
    step_time_us: float
    arrival_late_us: float | None  # how much later than the others' median it reaches the collective
    cause: str | None  # the kind with the largest excess over the others' median
    cause_excess_us: float

    def sentence(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else (self.worker or "a rank")
        text = (
            f"{who} works {100 * (self.over_median - 1):.0f}% longer before its collectives than the others"
        )
        if self.arrival_late_us is not None and self.arrival_late_us > 0:
            text += f" (arrives {self.arrival_late_us:.0f} µs later)"
        if self.cause:
            text += f"; its extra time is {self.cause} (+{self.cause_excess_us:.0f} µs per step)"
        return text


@dataclass(frozen=True)
class RankVerdict:
    ranks: list[RankSummary]
    windows: int  # traces in all
    basis: str  # "busy time before collectives" or "step time" (no communication anywhere)
    median_busy_us: float
    spread: float  # (max - min busy) / median busy, over ranks with a known identity
    stragglers: list[Straggler] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Distinct ranks (workers); one when nothing says the traces came from different ranks."""
        return len(self.ranks)

    def straggler_ranks(self) -> list[int | str]:
        return [s.rank if s.rank is not None else (s.worker or "?") for s in self.stragglers]

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "windows": self.windows,
            "basis": self.basis,
            "median_busy_us": self.median_busy_us,
            "spread": self.spread,
            "stragglers": self.straggler_ranks(),
            "straggler_details": [asdict(s) | {"why": s.sentence()} for s in self.stragglers],
            "per_rank": [asdict(r) for r in self.ranks],
        }


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


def straggler_advice(verdict: RankVerdict) -> dict[str, Any] | None:
    """The job-level card when one rank holds the others back (JSON form of a recommendation).

    Removable: the straggler's extra busy time, which every other rank spends waiting in its
    collectives: a measured wait, like the other communication cards.
    """
    if not verdict.stragglers:
        return None
    worst = max(verdict.stragglers, key=lambda st: st.busy_us - st.others_busy_us)
    excess = max(0.0, worst.busy_us - worst.others_busy_us)
    step = worst.step_time_us
    who = f"rank {worst.rank}" if worst.rank is not None else (worst.worker or "one rank")
    return {
        "id": STRAGGLER_ID,
        "title": f"Even out the ranks: {who} holds the others back",
        "kind": "communication",
        "change": _STRAGGLER_CHANGE.get(worst.cause or "", _STRAGGLER_DEFAULT),
        "why": worst.sentence() + "; every other rank waits for it in each collective.",
        "expected_speedup": round(step / max(step - excess, 0.05 * step), 3) if step > 0 else 1.0,
        "removable_us_per_step": round(excess, 3),
        "confidence": 0.8,
        "caveats": ["DDP bucket sizes or compression do not help while the others are waiting, not sending."],
        "evidence": asdict(worst),
        "basis": "measured",
        "expected_speedup_range": None,
    }


def with_straggler_advice(cards: list[Any], card: Any, primary_kind: str | None) -> list[Any]:
    """``cards`` with the straggler card first when the job is communication-bound (the others'
    waits are the verdict), else second, so the first card still addresses the verdict."""
    at = 0 if primary_kind == "communication" or not cards else 1
    return [*cards[:at], card, *cards[at:]]


def worker_name(source: str) -> str | None:
    """TensorBoard's worker name of a trace file (``host_pid`` of ``host_pid.123.pt.trace.json``)."""
    m = _WORKER_RE.match(PurePath(source).name)
    return m.group(1) if m else None


def rank_of(entry: TraceEntry) -> tuple[int | None, str | None]:
    """(rank, worker) of one trace: the caller's rank, else the report's, else the worker name."""
    if entry.rank is not None:
        return entry.rank, None
    r = entry.report.get("rank")
    if isinstance(r, int) and not isinstance(r, bool):
        return r, None
    return None, worker_name(str(entry.report.get("source") or ""))


def rank_verdict(entries: Sequence[TraceEntry]) -> RankVerdict:
    """Group traces into ranks and windows, then find stragglers (module docstring)."""
    groups: dict[tuple[int | None, str | None], list[Mapping[str, Any]]] = {}
    for e in entries:
        groups.setdefault(rank_of(e), []).append(e.report)
    summaries = [
        _summarise(rank, worker, reps)
        for (rank, worker), reps in sorted(groups.items(), key=lambda kv: _order(kv[0]))
    ]
    known = [s for s in summaries if s.rank is not None or s.worker is not None]
    has_comm = any(s.wait_us > 0 or s.arrival_us is not None for s in summaries)
    basis = "busy time before collectives" if has_comm else "step time"
    busy = [s.busy_us for s in known]
    median = statistics.median(busy) if busy else 0.0
    spread = (max(busy) - min(busy)) / median if len(busy) > 1 and median > 0 else 0.0
    stragglers = [st for s in known if (st := _straggler(s, [o for o in known if o is not s]))]
    return RankVerdict(summaries, len(entries), basis, median, spread, stragglers)


def _order(key: tuple[int | None, str | None]) -> tuple[int, int, str]:
    rank, worker = key
    return (0, rank, "") if rank is not None else (1, 0, worker or "~")


def _summarise(rank: int | None, worker: str | None, reports: list[Mapping[str, Any]]) -> RankSummary:
    weights = [step_count(r) for r in reports]
    total = sum(weights)

    def mean(values: list[float]) -> float:
        return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0

    step = mean([step_time_us(r) for r in reports])
    kinds: dict[str, float] = {}
    for k in (*BOTTLENECK_KINDS, "other"):
        kinds[k] = mean([num(_kinds(r).get(k)) for r in reports])
    wait = kinds.get("communication", 0.0)
    arrivals = [(a, w) for r, w in zip(reports, weights, strict=True) if (a := _arrival(r)) is not None]
    arrival = sum(a * w for a, w in arrivals) / sum(w for _, w in arrivals) if arrivals else None
    shares = {k: v / step for k, v in kinds.items() if k in BOTTLENECK_KINDS} if step > 0 else {}
    # The rank's limiter by the same rule as the job's and each trace's (``diagnose.choose_limiter``).
    primary = job_limiter(reports).kind if shares and max(shares.values()) > 0 else None
    return RankSummary(
        rank=rank,
        worker=worker,
        traces=len(reports),
        steps=total,
        step_time_us=step,
        wait_us=wait,
        busy_us=max(0.0, step - wait),
        arrival_us=arrival,
        kinds_us=kinds,
        primary_kind=primary,
        primary_share=round(shares.get(primary, 0.0), 4) if primary else 0.0,
    )


def _straggler(s: RankSummary, others: list[RankSummary]) -> Straggler | None:
    if not others:
        return None
    ref = statistics.median(o.busy_us for o in others)
    if ref <= 0 or s.busy_us <= ref * (1 + STRAGGLER):
        return None
    arrivals = [o.arrival_us for o in others if o.arrival_us is not None]
    late = s.arrival_us - statistics.median(arrivals) if arrivals and s.arrival_us is not None else None
    excess = {
        k: v - statistics.median(o.kinds_us.get(k, 0.0) for o in others)
        for k, v in s.kinds_us.items()
        if k != "communication"
    }
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


def _metrics(report: Mapping[str, Any]) -> Mapping[str, Any]:
    m = report.get("metrics")
    return m if isinstance(m, Mapping) else {}


def _kinds(report: Mapping[str, Any]) -> Mapping[str, Any]:
    """µs per step by kind: ``metrics.kinds_us``, else shares × step time."""
    k = _metrics(report).get("kinds_us")
    if isinstance(k, Mapping) and k:
        return k
    shares = _metrics(report).get("shares")
    if isinstance(shares, Mapping):
        step = step_time_us(report)
        return {kind: num(v) * step for kind, v in shares.items()}
    return {}


def _arrival(report: Mapping[str, Any]) -> float | None:
    comm = _metrics(report).get("communication")
    if isinstance(comm, Mapping) and isinstance(comm.get("arrival_ns_per_step"), int | float):
        return float(comm["arrival_ns_per_step"]) / 1e3
    return None
