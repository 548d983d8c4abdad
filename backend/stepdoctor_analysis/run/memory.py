"""A run's memory leak: step-end memory that keeps rising from one capture window to the next.

One window shows a few steps; a leak of a few MiB per step hides in its noise, or shows in one
window and not the next. Over a run, the windows of one process (``trace_summary.rank_of``: same rank, or
same worker) are read together, per device: each window's lowest step-end reading (the level memory
returns to) at its step number. When those floors rise at every window, at least
``LEAK_MIN_MIB_PER_STEP`` per step (``memory_use.steady_growth``, the per-trace rule's test), the run
leaks, and ``run_leak`` says by how much per step and, when a window's report names what survives
its steps (``memory_use`` survivors), the cause.

Growth per step, by device:
- CUDA: the floors' slope (allocated memory is the allocator's absolute total, steps between
  windows included);
- the host (``cpu``): torch counts CPU memory only for blocks allocated while a profiler records,
  so the steps between windows leak unseen and the floors' slope understates the rate; the
  windows' own step-to-step growth (their median) is used when it is the larger.

The agent's step series (``run_timeline.Memory``, a sample about once a second over the whole run)
is the stronger evidence when there is one: a leak it finds (``memory.leak`` set by
``run_timeline``) is reported with its growth, and the windows still name the cause.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np

from ..analyzers.memory_use import LEAK_MIN_MIB_PER_STEP, steady_growth
from ..report.contract import MemoryLeak, Recommendation, ReportDoc
from ..rules import rule
from ..rules.memory_advice import MIB, gib_text, leak_change, survivor_words
from .timeline import Memory as SeriesMemory

MIN_WINDOWS = 3  # floors to call growth steady (``steady_growth`` needs three readings)
RULE_ID = "memory.leak"  # the per-trace card's rule: this card shares its title and caveats
F = TypeVar("F", bound=Recommendation)


class WindowEnds(msgspec.Struct, frozen=True):
    """One window's step ends on one device: step numbers, allocated bytes, its own growth per step
    (``memory_use.LeakStats``) and what survives its steps. Small, so a run's per-trace summary
    (``trace_summary.TraceSummary``) can carry it."""

    device: str
    steps: list[int]
    bytes: list[int]
    growth_per_step: float
    survivors: list[dict[str, Any]] = msgspec.field(default_factory=list)

    @property
    def floor(self) -> tuple[int, int]:
        """(step, bytes) of the window's lowest step end."""
        i = int(np.argmin(self.bytes))
        return self.steps[i], self.bytes[i]


@dataclass(frozen=True)
class RunLeak:
    """Memory rising across one process's windows (or over its step series) on one device."""

    process: str  # "rank 0", "worker host_123", or "" when the run has one unnamed process
    device: str
    growth_per_step: float  # bytes
    basis: str
    windows: list[WindowEnds]
    survivors: list[dict[str, Any]]  # the cause, from the window that names the most per step
    traces: int  # windows read
    from_series: bool = False  # the growth is the step series' (the whole run), not the windows'

    def finding(self) -> Recommendation:
        """``memory.leak`` for the run: the per-trace card's title, change and caveats, with the
        run's growth per step and the readings it rests on."""
        top = self.survivors[0] if self.survivors else None
        who = f" of {self.process}" if self.process else ""
        if self.from_series or len(self.windows) < MIN_WINDOWS:
            rise = (
                f"Memory on {self.device} rises {gib_text(self.growth_per_step)} per step over the run{who}"
            )
        else:
            first, last = self.windows[0].floor, self.windows[-1].floor
            rise = (
                f"Allocated memory on {self.device} keeps rising across {len(self.windows)} capture windows{who}: "
                f"the lowest step end goes from {gib_text(first[1])} at step {first[0]} to {gib_text(last[1])} "
                f"at step {last[0]}, {gib_text(self.growth_per_step)} per step"
            )
        why = (
            f"{rise} ({self.basis}); {survivor_words(top)}. "
            "At this rate the run runs out of memory however large the device."
        )
        evidence: dict[str, Any] = {
            "device": self.device,
            "growth_mib_per_step": round(self.growth_per_step / MIB, 2),
            "basis": self.basis,
            "windows": [
                {"steps": w.steps, "allocated_mib_at_step_ends": [round(b / MIB, 1) for b in w.bytes]}
                for w in self.windows
            ],
            "surviving_allocations": self.survivors,
        }
        if self.process:
            evidence["process"] = self.process
        return Recommendation(
            id=RULE_ID,
            title=rule(RULE_ID).title,
            kind="memory",
            change=leak_change(top),
            why=why,
            expected_speedup=1.0,
            removable_us_per_step=0.0,
            confidence=0.85 if top is not None else 0.6,
            caveats=list(rule(RULE_ID).caveats),
            evidence=evidence,
        )


def window_ends(doc: ReportDoc) -> list[WindowEnds]:
    """Each device's step ends in one report, with the step numbers they belong to (devices whose
    readings do not match the report's steps one to one are left out)."""
    numbers = [s.number for s in doc.steps]
    leaks: Sequence[MemoryLeak] = doc.metrics.memory.leak if doc.metrics.memory is not None else []
    return [
        WindowEnds(
            leak.device, numbers, list(leak.step_end_bytes), leak.growth_per_step, list(leak.survivors)
        )
        for leak in leaks
        if leak.step_end_bytes and len(leak.step_end_bytes) == len(numbers)
    ]


#: One trace of a run as ``run_leak`` reads it: (rank, worker) of its process (``trace_summary.rank_of``)
#: and its step ends (``window_ends``, kept in ``TraceSummary.memory_ends``).
Window = tuple[int | None, str | None, Sequence[WindowEnds]]


def run_leak(windows: Iterable[Window], *, series: SeriesMemory | None = None) -> RunLeak | None:
    """The run's worst leak over its processes and devices (module docstring), or None.

    ``series``: the run's step-series memory (``run_timeline.RunTimeline.memory``), when known."""
    processes: dict[tuple[int | None, str | None], dict[str, list[WindowEnds]]] = {}
    traces = 0
    for rank, worker, ends in windows:
        traces += 1
        per_device = processes.setdefault((rank, worker), {})
        for e in ends:
            per_device.setdefault(e.device, []).append(e)
    found: list[RunLeak] = []
    for (rank, worker), per_device in processes.items():
        process = f"rank {rank}" if rank is not None else (f"worker {worker}" if worker else "")
        if len(processes) == 1 and rank is None:
            process = ""
        for device, mine in per_device.items():
            leak = _across_windows(process, device, sorted(mine, key=lambda w: w.steps[0]))
            if leak is not None:
                found.append(leak)
    if series is not None and series.leak and series.growth_per_step:
        every = [w for per_device in processes.values() for ws in per_device.values() for w in ws]
        found.append(_from_series(series, every, found, traces))
    return max(found, key=lambda x: x.growth_per_step, default=None)


def _across_windows(process: str, device: str, windows: list[WindowEnds]) -> RunLeak | None:
    if len(windows) < MIN_WINDOWS:
        return None
    floors = [w.floor for w in windows]
    steps = np.array([s for s, _ in floors], np.int64)
    growth, steady = steady_growth(steps, np.array([b for _, b in floors], np.int64))
    if not steady:
        return None
    basis = f"the lowest step end of each window, steps {int(steps[0])} to {int(steps[-1])}"
    own = statistics.median(w.growth_per_step for w in windows)
    if device == "cpu" and own > growth:
        growth = own
        basis = (
            "the median of the windows' own step-to-step growth: torch counts host memory only while "
            "the profiler records, so the steps between windows leak unseen"
        )
    if growth < LEAK_MIN_MIB_PER_STEP * MIB:
        return None
    return RunLeak(process, device, growth, basis, windows, _cause(windows), len(windows))


def _cause(windows: Sequence[WindowEnds]) -> list[dict[str, Any]]:
    """The survivors of the window that names the most bytes per step ([] when none names any)."""
    named = [w.survivors for w in windows if w.survivors]
    return max(named, key=lambda s: float(s[0].get("bytes_per_step") or 0), default=[])


def _from_series(series: SeriesMemory, every: list[WindowEnds], found: list[RunLeak], traces: int) -> RunLeak:
    """The step series' leak (the whole run), with the cause and readings the windows give."""
    windows = (
        max(found, key=lambda x: x.growth_per_step).windows
        if found
        else sorted(every, key=lambda w: w.steps[0])
    )
    device = "cpu" if series.kind == "rss" else (found[0].device if found else "cuda")
    basis = (
        f"the agent's step series ({series.samples} samples of "
        f"{'host RSS' if series.kind == 'rss' else 'allocated memory'} over the run)"
    )
    growth = float(series.growth_per_step or 0.0)
    return RunLeak("", device, growth, basis, windows, _cause(windows), traces, from_series=True)


def with_run_leak(findings: list[F], found: F) -> list[F]:
    """The run's leak in place of the windows' merged ``memory.leak`` (added when no window had one)."""
    if any(f.id == found.id for f in findings):
        return [found if f.id == found.id else f for f in findings]
    return [*findings, found]
