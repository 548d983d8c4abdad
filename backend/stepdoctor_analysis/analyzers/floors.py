"""What still has to run after a change: the floors a step cannot go below.

A recommendation's gain is what ITS change removes, not the time of its kind. Removing a host
sync only lets the host and the GPU overlap, so the step gets no shorter than the host's own work
or the GPU's busy time; overlapping copies hides them only behind work that exists, and the copy
engine still needs its time. Each rule names the floors its change leaves in place
(``rules.Rule.keeps``) and its removable time is cut to ``step − max(those floors)``.

Per step (means over the steps):
  host     the host's own work: its share of the step (the ``ProfilerStep#N`` range when markers
           exist, since the host may run far ahead of the device windows; else from the previous
           step's last launch call to this step's last) less the time it sat blocked in
           synchronizing calls (explicit syncs, synchronous copies, pageable copies);
  device   the union of everything the GPU runs (kernels, copies, memsets);
  kernels  the union of kernels (compute and collectives);
  copies   the union of copies and memsets (the copy engines' time).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..model import intervals as iv
from ..model.steps import device_op_mask, launched_ops, marker_ranges
from ..model.trace import GpuKind, RankTrace, Step
from . import timeline as tl
from .sync import blocking_call_mask

I64 = iv.I64


@dataclass(frozen=True)
class Floors:
    """Mean ns per step of each floor (module docstring)."""

    host: float
    device: float
    kernels: float
    copies: float
    blocked: float  # host time blocked in synchronizing calls, within the host's ranges

    def highest(self, names: Iterable[str]) -> float:
        """The floor a change that leaves ``names`` in place cannot go below (0 for none)."""
        return max((float(getattr(self, n)) for n in names), default=0.0)


def bounded(step_ns: float, removable_ns: float, floor_ns: float) -> float:
    """``removable_ns`` cut to what the step can lose above ``floor_ns`` (never below 0)."""
    return max(0.0, min(removable_ns, step_ns - floor_ns))


def analyze_floors(trace: RankTrace, steps: list[Step]) -> Floors | None:
    """The floors of a GPU trace's steps (None without device work in them)."""
    if not steps or not len(trace.gpu):
        return None
    starts, ends = tl.step_windows(steps)
    dev = device_op_mask(trace) & tl.gpu_in_steps(trace, steps)
    if not dev.any():
        return None
    g = trace.gpu

    def mean(ivs: iv.Intervals, s: I64 = starts, e: I64 = ends) -> float:
        return tl.mean_or_zero(tl.per_step(ivs, s, e))

    hs, he = host_ranges(trace, steps)
    h = trace.host
    blocking = blocking_call_mask(trace) if len(h) else np.zeros(0, np.bool_)
    blocked = mean(iv.union(h.ts[blocking], h.end[blocking]), hs, he) if blocking.any() else 0.0
    return Floors(
        host=max(0.0, tl.mean_or_zero(he - hs) - blocked),
        device=mean(tl.gpu_union(trace, device_op_mask(trace))),
        kernels=mean(tl.gpu_union(trace, trace.gpu_kind(GpuKind.KERNEL))),
        copies=mean(iv.union(g.ts[tl.copy_mask(trace)], g.end[tl.copy_mask(trace)])),
        blocked=blocked,
    )


def host_ranges(trace: RankTrace, steps: list[Step]) -> tuple[I64, I64]:
    """Each step's host range, disjoint and in order: its ``ProfilerStep#N`` marker, else the span
    from the previous step's last launch call to its own last (the step window when it launched
    nothing)."""
    starts, ends = tl.step_windows(steps)
    h = trace.host
    numbers, m_starts, m_ends = marker_ranges(trace)
    if numbers:
        by_number = {number: i for i, number in enumerate(numbers)}
        idx = [by_number.get(s.number) for s in steps]
        if all(i is not None for i in idx):
            at = np.array(idx, dtype=np.int64)
            return m_starts[at].astype(np.int64), m_ends[at].astype(np.int64)
    ops, calls = launched_ops(trace)
    hs, he = starts.copy(), ends.copy()
    if ops.size == 0:
        return hs, he
    # The step each launched op's device time falls in, and the last launch call of each step.
    k = starts.searchsorted(trace.gpu.ts[ops], side="right") - 1
    ok = (k >= 0) & (trace.gpu.ts[ops] < ends[np.maximum(k, 0)])
    last = np.full(starts.size, np.iinfo(np.int64).min, np.int64)
    first = np.full(starts.size, np.iinfo(np.int64).max, np.int64)
    np.maximum.at(last, k[ok], h.end[calls[ok]])
    np.minimum.at(first, k[ok], h.ts[calls[ok]])
    launched = last > np.iinfo(np.int64).min
    he[launched] = last[launched]
    hs[launched] = first[launched]
    # Contiguous: a step's host share starts where the previous one's last launch ended.
    prev = np.concatenate([[np.iinfo(np.int64).min], he[:-1]])
    follow = launched & (np.concatenate([[False], launched[:-1]])) & (prev < he)
    hs[follow] = prev[follow]
    return hs, he
