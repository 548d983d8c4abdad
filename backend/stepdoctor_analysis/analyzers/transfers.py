"""Host↔device copies: volume, bandwidth, pageable vs pinned, synchronous copies, exposed time.

Exposed copy time is the part of the copies' device time that no compute kernel overlaps: that is
what a step pays for moving data. Pageable host memory matters because CUDA must stage it through
a pinned bounce buffer, which makes the host wait and halves the achievable bandwidth (Nsight
Systems flags every pageable async copy; TensorBoard's plugin had no such rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..model import intervals as iv
from ..model.arrays import median_of
from ..model.trace import CopyKind, GpuKind, HostKind, HostMem, RankTrace, Step
from . import timeline as tl
from .breakdown import computation_kernel_union

# Non-async memcpy APIs block the calling host thread until the copy is done.
_SYNC_COPY_RE = re.compile(
    r"^(cuda|hip)Memcpy(2D|3D|ToSymbol|FromSymbol|Peer)?$|^cuMemcpy(HtoD|DtoH|DtoD)?(_v2)?$"
)

RATE_MIN_BYTES = 1 << 20
# Copies smaller than this are bound by per-copy latency (launch, staging, a sync each), not by the
# link's bandwidth: a bandwidth estimate (pageable vs pinned GB/s) applies only to larger ones.
# Tiny copies in a loop are a different problem with a different fix (batch them, keep the loop on
# the device). Nsight's "ignore small copies" threshold.
BANDWIDTH_MIN_BYTES = 1 << 16

DIRECTIONS = {
    CopyKind.HTOD: "HtoD",
    CopyKind.DTOH: "DtoH",
    CopyKind.DTOD: "DtoD",
    CopyKind.HTOH: "HtoH",
    CopyKind.PTOP: "PtoP",
}


@dataclass(frozen=True)
class DirectionStats:
    direction: str
    count_per_step: float
    bytes_per_step: float
    device_ns_per_step: float
    bandwidth_gbps: float  # bytes / device time over all copies of this direction
    pageable_count_per_step: float
    pinned_count_per_step: float
    median_bytes: float


@dataclass(frozen=True)
class TransferStats:
    directions: list[DirectionStats] = field(default_factory=list)
    copy_ns_per_step: float = 0.0  # union of memcpy device time
    exposed_ns_per_step: float = 0.0  # ... not overlapped by compute kernels
    exposed_per_step: list[int] = field(default_factory=list)
    pageable_ns_per_step: float = 0.0  # device time of pageable copies
    pageable_bytes_per_step: float = 0.0
    pageable_count_per_step: float = 0.0
    # The pageable copies of at least ``BANDWIDTH_MIN_BYTES``: the ones a pinned link rate speeds up.
    bulk_pageable_ns_per_step: float = 0.0
    bulk_pageable_bytes_per_step: float = 0.0
    bulk_pageable_count_per_step: float = 0.0
    sync_copy_calls_per_step: float = 0.0  # cudaMemcpy & co.
    sync_copy_host_ns_per_step: float = 0.0
    small_htod_per_step: float = 0.0  # HtoD copies <= 64 KiB (Nsight's threshold for "ignore")
    # Bytes / device time of the pinned host<->device copies of at least ``RATE_MIN_BYTES`` (smaller
    # ones measure latency, not the link); 0 when the steps hold none.
    pinned_gbps: float = 0.0

    def direction(self, name: str) -> DirectionStats | None:
        return next((d for d in self.directions if d.direction == name), None)


def sync_copy_call_mask(trace: RankTrace) -> np.ndarray:
    return tl.host_name_mask(trace, _SYNC_COPY_RE, "sync_copy", HostKind.RUNTIME, HostKind.DRIVER)


def small_htod_copies(trace: RankTrace, steps: list[Step]) -> np.ndarray:
    """HtoD memcpys of at most 64 KiB inside the steps (Nsight's threshold for "ignore")."""

    def evaluate() -> np.ndarray:
        g = trace.gpu
        htod = trace.gpu_kind(GpuKind.MEMCPY) & (g.copy_kind == int(CopyKind.HTOD))
        return htod & (g.bytes >= 0) & (g.bytes <= 65536) & tl.gpu_in_steps(trace, steps)

    return trace.memo(("small_htod", tuple(steps)), evaluate)


def analyze_transfers(trace: RankTrace, steps: list[Step]) -> TransferStats:
    g = trace.gpu
    if not len(g) or not steps:
        return TransferStats()
    starts, ends = tl.step_windows(steps)
    n = len(steps)
    memcpy = trace.gpu_kind(GpuKind.MEMCPY) & tl.gpu_in_steps(trace, steps)
    copies = tl.gpu_union(trace, memcpy)
    copy_per_step = tl.per_step(copies, starts, ends)
    # The part no compute kernel hides.
    exposed = copy_per_step - tl.per_step(iv.intersect(copies, computation_kernel_union(trace)), starts, ends)
    pageable = memcpy & tl.pageable_copy_mask(trace)
    bulk = pageable & (g.bytes >= BANDWIDTH_MIN_BYTES)

    directions = []
    for kind, label in DIRECTIONS.items() if memcpy.any() else ():
        m = memcpy & (g.copy_kind == int(kind))
        if not m.any():
            continue
        b = np.maximum(g.bytes[m], 0)
        dur = int(g.dur[m].sum())
        directions.append(
            DirectionStats(
                direction=label,
                count_per_step=int(np.count_nonzero(m)) / n,
                bytes_per_step=float(b.sum()) / n,
                device_ns_per_step=dur / n,
                bandwidth_gbps=float(b.sum()) / dur if dur > 0 else 0.0,  # bytes/ns == GB/s
                pageable_count_per_step=int(np.count_nonzero(m & pageable)) / n,
                pinned_count_per_step=int(np.count_nonzero(m & (g.host_mem == int(HostMem.PINNED)))) / n,
                median_bytes=median_of(b) if b.size else 0.0,
            )
        )

    host_dev = (g.copy_kind == int(CopyKind.HTOD)) | (g.copy_kind == int(CopyKind.DTOH))
    pinned = memcpy & host_dev & (g.host_mem == int(HostMem.PINNED)) & (g.bytes >= RATE_MIN_BYTES)
    pinned_dur = int(g.dur[pinned].sum())
    h = trace.host
    sync_calls = sync_copy_call_mask(trace) & tl.host_in_steps(trace, steps)
    return TransferStats(
        directions=directions,
        copy_ns_per_step=tl.mean_or_zero(copy_per_step),
        exposed_ns_per_step=tl.mean_or_zero(exposed),
        exposed_per_step=[int(x) for x in exposed],
        pageable_ns_per_step=int(g.dur[pageable].sum()) / n,
        pageable_bytes_per_step=float(np.maximum(g.bytes[pageable], 0).sum()) / n,
        pageable_count_per_step=int(np.count_nonzero(pageable)) / n,
        bulk_pageable_ns_per_step=int(g.dur[bulk].sum()) / n,
        bulk_pageable_bytes_per_step=float(g.bytes[bulk].sum()) / n,
        bulk_pageable_count_per_step=int(np.count_nonzero(bulk)) / n,
        sync_copy_calls_per_step=int(np.count_nonzero(sync_calls)) / n,
        sync_copy_host_ns_per_step=int(h.dur[sync_calls].sum()) / n,
        small_htod_per_step=int(np.count_nonzero(small_htod_copies(trace, steps))) / n,
        pinned_gbps=float(g.bytes[pinned].sum()) / pinned_dur if pinned_dur > 0 else 0.0,
    )
