"""One-pass traces: which waits recur within the pass, and which may be one-time costs.

A trace with no repeated iteration (a bare ``profile()`` around one forward pass, one server step,
a script without a loop) has no second step to show that a wait comes back. Its waits can still be
told apart by their distribution over the pass:

- one-time costs are few and long: autotuning, lazy initialisation, the first ``cudaMalloc``,
  compilation. A handful of stretches carries the kind's time;
- recurring costs are many and alike: the launch gap in front of each of hundreds of small kernels
  of an eager forward, the refill bubble after each of thousands of ``.cpu()`` reads in a Python
  loop. The time is spread over many stretches of similar length.

A kind's stretches longer than ``LONG_WAIT_RATIO`` times their median are the one-time candidates;
the others recur when there are at least ``MIN_RECURRING_WAITS`` of them. Only the recurring part is
claimed, per pass (``diagnose``); the long ones keep the caution that they may not come back.
Only the device timeline has stretches to count (a CPU-only trace's op time has no gaps to read), so
CPU-only one-pass traces keep the caution for every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model import intervals as iv
from ..model.arrays import median_of
from ..model.trace import Step
from .timeline import Accounting

MIN_RECURRING_WAITS = 50  # fewer alike stretches than this could be one call's per-kernel first costs
LONG_WAIT_RATIO = 10.0  # a stretch this many times the median is a one-time candidate
TOP_FEW = 5  # the evidence states the share the few longest stretches carry


@dataclass(frozen=True)
class PassWaits:
    """How one kind's time in a one-pass trace is spread over its stretches."""

    kind: str
    count: int  # stretches of the kind in the pass
    total_ns: int
    median_ns: float
    top_share: float  # share of the total the ``TOP_FEW`` longest stretches carry
    recurring_count: int  # stretches no longer than ``LONG_WAIT_RATIO`` × the median
    recurring_ns: int

    @property
    def recurs(self) -> bool:
        """Many alike stretches: a cost each pass pays again, not a one-time one."""
        return self.recurring_count >= MIN_RECURRING_WAITS and self.recurring_ns > 0

    @property
    def recurring_fraction(self) -> float:
        """The share of the kind's time that recurs (what a per-pass gain may claim)."""
        return self.recurring_ns / self.total_ns if self.total_ns > 0 else 0.0

    def evidence(self) -> dict[str, Any]:
        return {
            "waits": self.count,
            "median_wait_us": round(self.median_ns / 1e3, 2),
            f"top_{TOP_FEW}_share": round(self.top_share, 3),
            "recurring_waits": self.recurring_count,
            "recurring_us": round(self.recurring_ns / 1e3, 1),
            "one_time_candidates_us": round((self.total_ns - self.recurring_ns) / 1e3, 1),
        }


def pass_waits(acc: Accounting, steps: list[Step], found: bool) -> dict[str, PassWaits]:
    """Per kind, the spread of its stretches over a one-pass GPU trace (empty when iterations
    were found, or on a CPU-only trace): the stretches are the same partition the accounting made
    (each layer's claim and the charged idle stretches), so they sum to the kind's time."""
    if found or not acc.on_gpu or len(steps) != 1:
        return {}
    lo, hi = steps[0].start, steps[0].end
    s, e, layer = acc.claimed.within(lo, hi)
    parts: dict[str, list[iv.Intervals]] = {}
    for k, kind in enumerate(acc.layer_kinds):
        parts.setdefault(kind, []).append((s[layer == k], e[layer == k]))
    for kind, stretches in acc.idle.items():
        parts.setdefault(kind, []).append(iv.clip(stretches, lo, hi))
    out = {}
    for kind, ivs in parts.items():
        merged = iv.union(np.concatenate([a for a, _ in ivs]), np.concatenate([b for _, b in ivs]))
        lengths = merged[1] - merged[0]
        if lengths.size:
            out[kind] = _spread(kind, lengths)
    return out


def _spread(kind: str, lengths: np.ndarray) -> PassWaits:
    total = int(lengths.sum())
    median = median_of(lengths)
    top = np.sort(lengths)[-TOP_FEW:]
    alike = lengths <= LONG_WAIT_RATIO * median
    return PassWaits(
        kind=kind,
        count=int(lengths.size),
        total_ns=total,
        median_ns=median,
        top_share=float(top.sum()) / total if total > 0 else 0.0,
        recurring_count=int(np.count_nonzero(alike)),
        recurring_ns=int(lengths[alike].sum()),
    )
