"""Step-time breakdown in torch-tb-profiler's priority order (anchors §2).

Each category claims the part of its time ranges that no higher-priority category claimed; what is
left of the step is ``other``. So the parts of a step sum exactly to its wall time, which is what
makes the numbers comparable with TensorBoard's "Step Time Breakdown".

Category sources (tb-profiler 0.4.3 conventions, with the deliberate differences noted):
- kernel: GPU kernels that are not communication.
- memcpy / memset: GPU copies and fills.
- communication: NCCL kernels plus host collective ops. tb-profiler matches kernels to the five
  ``nccl:``/``gloo:`` collectives it knows by external id; we also take every collective kernel family
  (NCCL/RCCL, MSCCL, NVSHMEM, DeepEP, custom all-reduce: ``collectives``), any kernel launched under a
  collective host op (``c10d::``, ``record_param_comms``), and any ``nccl:``/``gloo:`` op (all_to_all,
  send/recv, ... which 0.4.3 counted as ordinary kernels/CPU ops).
- runtime: CUDA/HIP runtime and driver calls (0.4.3 only recognised the legacy ``Runtime`` category).
- dataloader: ``enumerate(DataLoader)#…__next__`` and ``enumerate(DataPipe)#…`` ranges, whether
  recorded as ``cpu_op`` or as ``user_annotation`` (0.4.3 dropped the latter, so it reported 0).
- cpu_exec: every other CPU op (``cpu_op``/``Operator``); annotations and Python frames don't count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import BREAKDOWN_CATEGORIES
from ..model import intervals as iv
from ..model.collectives import is_collective_kernel_name
from ..model.collectives import is_collective_op_name as is_collective_call_name
from ..model.steps import STEP_PREFIX, launching_call
from ..model.trace import GpuKind, HostKind, Mask, RankTrace, Step

CATEGORIES = BREAKDOWN_CATEGORIES


@dataclass(frozen=True)
class Breakdown:
    """Per-step nanoseconds by category; each step's parts sum to its wall time."""

    steps: list[Step]
    per_step: list[dict[str, int]]

    def step_ns(self) -> list[int]:
        return [s.end - s.start for s in self.steps]

    def total_ns(self) -> dict[str, int]:
        return {c: sum(p[c] for p in self.per_step) for c in CATEGORIES}

    def average_us(self) -> dict[str, float]:
        """Mean µs per step by category (TensorBoard's averaged view)."""
        n = len(self.per_step)
        if n == 0:
            return dict.fromkeys(CATEGORIES, 0.0)
        return {c: v / n / 1000.0 for c, v in self.total_ns().items()}

    def shares(self) -> dict[str, float]:
        """Fraction of all step time by category."""
        tot = sum(self.step_ns())
        return {c: (v / tot if tot else 0.0) for c, v in self.total_ns().items()}


def is_dataloader_name(s: str) -> bool:
    return (s.startswith("enumerate(DataLoader)#") and s.endswith(".__next__")) or s.startswith(
        "enumerate(DataPipe)#"
    )


def is_collective_op_name(s: str) -> bool:
    return s.startswith(("nccl:", "gloo:"))


def is_comm_kernel_name(s: str) -> bool:
    """NCCL/RCCL/MSCCL/NVSHMEM, expert-parallel and custom all-reduce kernels (``collectives``)."""
    return is_collective_kernel_name(s)


def communication_kernel_mask(trace: RankTrace) -> Mask:
    """GPU kernels that are collectives: by NCCL name, or launched under a collective op's external id."""
    return trace.memo("comm_kernels", lambda: _communication_kernel_mask(trace))


def _communication_kernel_mask(trace: RankTrace) -> Mask:
    gpu, host = trace.gpu, trace.host
    kernels = trace.gpu_kind(GpuKind.KERNEL)
    mask = kernels & trace.gpu_named(is_comm_kernel_name, "comm.kernel")
    comm_ops = collective_call_mask(trace)
    if comm_ops.any():
        ext = host.external_id[comm_ops]
        ext = ext[ext >= 0]
        call = launching_call(trace)
        has = call >= 0
        linked = np.zeros(len(gpu), np.bool_)
        linked[has] = iv.member(host.external_id[call[has]], ext)
        mask |= kernels & linked
    return mask


def computation_kernel_union(trace: RankTrace) -> iv.Intervals:
    """When a kernel that is not a collective runs (the ``kernel`` category, before claiming)."""

    def evaluate() -> iv.Intervals:
        gpu = trace.gpu
        mask = trace.gpu_kind(GpuKind.KERNEL) & ~communication_kernel_mask(trace)
        return iv.union(gpu.ts[mask], gpu.end[mask])

    return trace.memo("compute_union", evaluate)


def collective_call_mask(trace: RankTrace) -> Mask:
    """Every host op that issues a collective (``c10d::``, ``record_param_comms``, backend ranges).

    Broader than ``collective_op_mask``, which keeps TensorBoard's ``nccl:``/``gloo:`` ranges for the
    breakdown; kernels launched under any of these are communication whatever their name.
    """

    def evaluate() -> Mask:
        return trace.host_named(
            is_collective_call_name, "comm.call", HostKind.CPU_OP, HostKind.USER_ANNOTATION
        )

    return trace.memo("collective_calls", evaluate)


def collective_op_mask(trace: RankTrace) -> Mask:
    def evaluate() -> Mask:
        return trace.host_named(is_collective_op_name, "comm.op", HostKind.CPU_OP, HostKind.USER_ANNOTATION)

    return trace.memo("collective_ops", evaluate)


def dataloader_mask(trace: RankTrace) -> Mask:
    def evaluate() -> Mask:
        return trace.host_named(is_dataloader_name, "dataloader", HostKind.CPU_OP, HostKind.USER_ANNOTATION)

    return trace.memo("dataloader_calls", evaluate)


def category_intervals(trace: RankTrace) -> dict[str, iv.Intervals]:
    """Normalised busy intervals of each category over the whole trace (before claiming)."""
    host, gpu = trace.host, trace.gpu
    comm_k = communication_kernel_mask(trace)
    comm_op = collective_op_mask(trace)
    dl = dataloader_mask(trace)
    steps = trace.host_named(lambda s: s.startswith(STEP_PREFIX), "steps.prefix", HostKind.CPU_OP)
    cpu = trace.host_kind(HostKind.CPU_OP) & ~dl & ~comm_op & ~steps

    def g(mask: Mask) -> iv.Intervals:
        return iv.union(gpu.ts[mask], gpu.end[mask])

    def h(mask: Mask) -> iv.Intervals:
        return iv.union(host.ts[mask], host.end[mask])

    comm = iv.union(
        np.concatenate([gpu.ts[comm_k], host.ts[comm_op]]),
        np.concatenate([gpu.end[comm_k], host.end[comm_op]]),
    )
    return {
        "kernel": computation_kernel_union(trace),
        "memcpy": g(trace.gpu_kind(GpuKind.MEMCPY)),
        "memset": g(trace.gpu_kind(GpuKind.MEMSET)),
        "communication": comm,
        "runtime": h(trace.host_kind(HostKind.RUNTIME, HostKind.DRIVER)),
        "dataloader": h(dl),
        "cpu_exec": h(cpu),
    }


def compute_breakdown(trace: RankTrace, steps: list[Step]) -> Breakdown:
    """Claim each step's time category by category, in priority order."""
    if not steps:
        return Breakdown([], [])
    w_start = np.array([s.start for s in steps], np.int64)
    w_end = np.array([s.end for s in steps], np.int64)
    busy = category_intervals(trace)
    claimed = iv.claim_in_order(w_start, w_end, list(busy.values()))
    cols = {name: per.tolist() for name, per in zip(busy, claimed.per_layer, strict=True)}
    cols["other"] = claimed.unclaimed.tolist()
    per_step = [{c: cols[c][i] for c in CATEGORIES} for i in range(len(steps))]
    return Breakdown(list(steps), per_step)
