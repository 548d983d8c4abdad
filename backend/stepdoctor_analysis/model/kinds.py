"""The codes the columnar trace stores: event categories, copy directions, and the missing value.

Apart from ``trace`` so that the parser, which writes them, needs neither numpy's typing nor the
trace's dataclasses: the forked second parser (``parsing.forked``) imports only what it parses with.
"""

from __future__ import annotations

from enum import IntEnum

NONE = -1  # missing integer field (correlation, external id, bytes, stream, ...)


class HostKind(IntEnum):
    """Category of a host-side duration event (Chrome ``ph: X`` on a CPU thread)."""

    CPU_OP = 0  # cpu_op / Operator
    USER_ANNOTATION = 1  # user_annotation (ProfilerStep#N, record_function ranges)
    PYTHON_FUNCTION = 2
    RUNTIME = 3  # cuda_runtime / Runtime / hip runtime
    DRIVER = 4  # cuda_driver (cuLaunchKernel, ...)
    OVERHEAD = 5  # profiler overhead
    OTHER = 6


class GpuKind(IntEnum):
    """Category of a device-side duration event."""

    KERNEL = 0
    MEMCPY = 1
    MEMSET = 2
    SYNC = 3  # cuda_sync events drawn on the GPU timeline
    ANNOTATION = 4  # gpu_user_annotation


class CopyKind(IntEnum):
    """Direction of a memcpy, from its name (``Memcpy HtoD (Pageable -> Device)``)."""

    NONE = -1  # not a memcpy
    HTOD = 0
    DTOH = 1
    DTOD = 2
    HTOH = 3
    PTOP = 4
    UNKNOWN = 5


class HostMem(IntEnum):
    """Host side of a memcpy: pageable copies are staged and synchronous for the host."""

    NONE = -1
    PAGEABLE = 0
    PINNED = 1
    UNKNOWN = 2
