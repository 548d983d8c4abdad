"""Operator and kernel tables (TensorBoard's Operator and Kernel views) and the device summary facts.

Pure: a ``RankTrace`` and its steps in, JSON-ready dicts out. Only events inside the profiled steps
count, so the tables describe the same time the verdict does. Rows are sorted by total time; the
dashboard sorts them again in the browser, so every column is a plain number.

- ``ops``: host ``cpu_op`` events by name: calls, total (inclusive) time, mean, and share of the
  summed step wall time. Ops nest, so these shares add up to more than 100%; each says "how much of
  the step happens inside this op", the question a user asks of an operator table.
- ``kernels``: GPU kernels by name: calls, total, mean and share of all kernel time (kernels do not
  nest, so these shares add up to 100%), and whether the name shows tensor-core use
  (``precision.matmul_precision``: a matmul-class kernel in TF32 or a lower precision).
- ``tensor_core_share``: fraction of kernel time in tensor-core kernels (None without kernels).
"""

from __future__ import annotations

from typing import Any

from ..model.trace import GpuKind, RankTrace, Step
from . import timeline as tl
from .ops import NamedTime, ranked
from .precision import matmul_precision

TOP_ROWS = 50
# Matmul precisions that run on tensor cores (matrix cores on AMD).
TENSOR_CORE_PRECISIONS = frozenset({"tf32", "fp16", "bf16", "fp8", "int8"})


def build_tables(trace: RankTrace, steps: list[Step], limit: int = TOP_ROWS) -> dict[str, Any]:
    """Top ``limit`` operators and kernels of the profiled steps, and the tensor-core share."""
    if not steps:
        return {"ops": [], "kernels": [], "tensor_core_share": None}
    starts, ends = tl.step_windows(steps)
    step_ns = int((ends - starts).sum())
    g = trace.gpu
    op_rows = _rows(ranked(trace, steps, "ops", limit), step_ns)
    if not len(g):
        return {"ops": op_rows, "kernels": [], "tensor_core_share": None}
    kernels = trace.gpu_kind(GpuKind.KERNEL) & tl.gpu_in_steps(trace, steps)
    kernel_ns = int(g.dur[kernels].sum())
    tensor = kernels & trace.gpu_named(_on_tensor_cores, "tables.tensor_core")
    kernel_rows = _rows(ranked(trace, steps, "kernels", limit), kernel_ns)
    for row in kernel_rows:
        row["tensor_core"] = _on_tensor_cores(row["name"])
    return {
        "ops": op_rows,
        "kernels": kernel_rows,
        "tensor_core_share": int(g.dur[tensor].sum()) / kernel_ns if kernel_ns else None,
    }


def _on_tensor_cores(name: str) -> bool:
    return matmul_precision(name) in TENSOR_CORE_PRECISIONS


def _rows(top: list[NamedTime], whole_ns: int) -> list[dict[str, Any]]:
    return [
        {
            "name": t.name,
            "calls": t.count,
            "total_us": round(t.total_ns / 1e3, 3),
            "mean_us": round(t.total_ns / t.count / 1e3, 3),
            "share": round(t.total_ns / whole_ns, 4) if whole_ns else 0.0,
        }
        for t in top
    ]
