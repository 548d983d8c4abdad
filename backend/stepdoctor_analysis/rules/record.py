"""The rule record and what its query sees: ``Context`` in, ``Hit`` out, ``Rule`` the record.

A ``Rule`` is the whole of a rule as it runs: its query, its thresholds, and its scope (the
workloads, dominant collective types and allocator states it fits, and the rules that replace it
when they fire). ``Rule.evaluate`` and ``fire`` apply that scope in one place, so no table
elsewhere rewrites a record. This module imports no rule: the queries (``bottlenecks``,
``beyond_ddp``, ``memory_advice``) build on it, and ``catalog`` lists the records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..analyzers.comm import CommStats
from ..analyzers.floors import Floors, bounded
from ..analyzers.hta_metrics import LaunchStats
from ..analyzers.inputs import InputStats, LoaderSettings
from ..analyzers.memory import MemoryStats
from ..analyzers.ops import AntiPattern, OpStats
from ..analyzers.precision import DeviceCaps
from ..analyzers.recurrence import PassWaits
from ..analyzers.sync import SyncStats
from ..analyzers.timeline import Accounting
from ..analyzers.transfers import TransferStats
from ..analyzers.workload import Workload, fits
from ..model.trace import DeviceInfo


@dataclass(frozen=True)
class Context:
    """Everything a rule may look at for one rank."""

    has_gpu: bool
    device: DeviceInfo | None
    n_steps: int
    has_step_markers: bool
    step_ns: float  # mean step duration
    accounting: Accounting
    transfers: TransferStats
    sync: SyncStats
    memory: MemoryStats
    comm: CommStats
    inputs: InputStats
    ops: OpStats
    loader: LoaderSettings
    launch: LaunchStats | None = None  # HTA kernel-launch statistics (GPU traces)
    caps: DeviceCaps | None = None  # reduced-precision units of the GPU (None on CPU traces)
    iterations_found: bool = True  # False: no markers and nothing repeats, the trace is one span
    workload: Workload | None = None  # training or inference (``workload.detect_workload``)
    floors: Floors | None = None  # what still runs after a change (GPU traces; ``floors``)
    # One-pass GPU traces (``iterations_found`` False): each kind's spread over the pass, which
    # tells recurring waits from one-time ones (``recurrence``); empty otherwise.
    pass_waits: Mapping[str, PassWaits] = field(default_factory=dict)

    def ns(self, kind: str) -> float:
        return self.accounting.mean_ns(kind)

    def share(self, kind: str) -> float:
        return self.accounting.share(kind)

    def pattern(self, pid: str) -> AntiPattern | None:
        return next((p for p in self.ops.patterns if p.id == pid), None)

    @property
    def device_type(self) -> str:
        return "cuda" if self.has_gpu else "cpu"


@dataclass(frozen=True)
class Hit:
    metric: float  # compared with the rule's threshold
    removable_ns: float  # per step, upper bound
    evidence: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)  # for the templates
    confidence: float | None = None  # None: derived from how far the metric exceeds the threshold
    # Estimated gains (``Rule.basis == "estimate"``): low and high removable time per step; the
    # point estimate ``removable_ns`` lies between them. Measured waits leave it None.
    removable_range_ns: tuple[float, float] | None = None


Query = Callable[[Context, Mapping[str, float]], "Hit | None"]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One self-describing rule: what it detects, when it fires, what to change and why.

    ``threshold`` is compared with the metric the query returns; ``thresholds`` holds every other
    limit the query applies (gain fractions, confidence cut-offs, minimum shares), passed to it on
    each call, so the rule's numbers live in the rule and the docs table shows them all.
    """

    id: str
    kind: str
    title: str
    trigger: str  # the threshold in words, for docs and the report
    threshold: float
    query: Query
    change: str  # code change template ("" for a finding without a direct change)
    why: str  # evidence template
    caveats: tuple[str, ...] = ()  # templates, formatted like ``change`` and ``why``
    # "measured": the removable time is a wait the trace shows (input stall, sync bubble, exposed
    # copy or collective, launch gap); "estimate": a modelled speedup of work that still has to run.
    basis: str = "measured"
    # Scope: where the advice means something. ``workloads``: the workloads it fits (advice for both
    # also fits one the trace cannot tell, "unknown": ``workload.fits``); ``collectives``: the
    # dominant collective types it addresses (``comm.dominant``; None in the tuple: no typed
    # collective seen), None for any; ``allocator``: the allocator states it applies in
    # (``memory.allocator``), None for any; ``yields_to``: rules whose finding replaces this one's
    # when they fire (``fire``).
    workloads: tuple[str, ...] = ("training", "inference")
    collectives: tuple[str | None, ...] | None = None
    allocator: tuple[str | None, ...] | None = None
    yields_to: tuple[str, ...] = ()
    thresholds: Mapping[str, float] = field(default_factory=dict)  # the query's other limits, by name
    # The floors (``floors.Floors``: "host", "device", "kernels", "copies") the change leaves in
    # place: after it the step is no shorter than the highest, so no more than step − that floor is
    # removable, whatever the kind's time. Empty: the query bounds its own gain.
    keeps: tuple[str, ...] = ()
    # The facts the finding's text states, for ``consistency``: a fact "no X" denies "X", and a
    # report never shows two findings of which one denies what the other asserts.
    asserts: tuple[str, ...] = ()
    claims_speedup: bool = True  # False: the change averts a failure (OOM); its finding promises no gain

    def in_scope(self, ctx: Context) -> bool:
        """The trace is in this rule's scope (workload, dominant collective, allocator state).

        Unit tests evaluate queries with a partial context: a part the context lacks is not checked."""
        workload = getattr(ctx, "workload", None)
        if workload is not None and not fits(workload.kind, self.workloads):
            return False
        comm = getattr(ctx, "comm", None)
        if self.collectives is not None and comm is not None:
            dominant = comm.dominant
            if (dominant.type if dominant else None) not in self.collectives:
                return False
        memory = getattr(ctx, "memory", None)
        return self.allocator is None or memory is None or memory.allocator in self.allocator

    def evaluate(self, ctx: Context) -> Hit | None:
        """This rule's finding on ``ctx`` alone (``fire`` also applies ``yields_to``)."""
        if not self.in_scope(ctx):
            return None
        hit = self.query(ctx, self.thresholds)
        if hit is None or hit.metric < self.threshold:
            return None
        if hit.confidence is None:
            excess = (hit.metric - self.threshold) / self.threshold if self.threshold > 0 else 1.0
            hit = dataclasses.replace(hit, confidence=round(0.5 + 0.45 * min(1.0, excess), 2))
        floors = getattr(ctx, "floors", None)
        if self.keeps and floors is not None:
            hit = floored(hit, ctx.step_ns, floors.highest(self.keeps))
        return hit


def floored(hit: Hit, step_ns: float, floor_ns: float) -> Hit:
    """``hit`` with its removable time (and range) cut to what the step can lose above ``floor_ns``."""
    rng = hit.removable_range_ns
    return dataclasses.replace(
        hit,
        removable_ns=bounded(step_ns, hit.removable_ns, floor_ns),
        removable_range_ns=None
        if rng is None
        else (bounded(step_ns, rng[0], floor_ns), bounded(step_ns, rng[1], floor_ns)),
    )


def speedup(total_ns: float, removable_ns: float) -> float:
    """Upper-bound speedup if ``removable_ns`` of a ``total_ns`` step disappeared."""
    if total_ns <= 0:
        return 1.0
    return total_ns / max(total_ns - min(removable_ns, 0.95 * total_ns), 1e-9)


def fire(rules: Iterable[Rule], ctx: Context) -> list[tuple[Rule, Hit]]:
    """Each rule that fires on ``ctx``, with its hit, in the rules' order; a rule whose
    ``yields_to`` names a rule that fired gives way to it."""
    hits = [(rule, hit) for rule in rules if (hit := rule.evaluate(ctx)) is not None]
    fired = {rule.id for rule, _ in hits}
    return [(rule, hit) for rule, hit in hits if fired.isdisjoint(rule.yields_to)]
