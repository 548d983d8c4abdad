"""Small traces the dashboard tests draw, each with its answer known by construction (µs)."""

from __future__ import annotations

from pathlib import Path

from support.synthetic import TraceBuilder
from support.synthetic_dist import GEMM, NCCL

ALL_REDUCE_NELEMS = 64 * 2**20  # bf16: 128 MiB per all-reduce


def back_to_back_cpu_steps(path: Path, n: int = 8) -> Path:
    """Steps of host work only: ProfilerStep#k ends exactly where #k+1 begins."""
    b = TraceBuilder(gpu=False)
    t = 100.0
    for number in range(1, n + 1):
        b.step(number, t, 100)
        b.cpu_op("aten::mm", t + 10, 80)
        t += 100
    return b.write(path)


def ddp_recorded_trace(path: Path, rank: int, world_size: int = 2) -> Path:
    """4 steps of 2 ms compute, then a 1 ms all-reduce of 128 MiB that nothing overlaps, recorded
    as PyTorch does (``record_param_comms`` with its message size) so bytes and algbw are known."""
    b = TraceBuilder(rank=rank, world_size=world_size)
    op, rng, kernel = NCCL["all_reduce"]
    comms = {
        "Collective name": "allreduce",
        "dtype": "BFloat16",
        "In msg nelems": ALL_REDUCE_NELEMS,
        "Out msg nelems": ALL_REDUCE_NELEMS,
    }
    t = 100.0
    for n in range(4):
        start, g = t, t + 10
        for _ in range(10):
            b.cpu_op("aten::mm", t, 8)
            b.launch(GEMM, t + 1, 5, g, 200)
            t, g = t + 8, g + 200
        b.cpu_op(op, t, 30)
        b.cpu_op("record_param_comms", t + 2, 26, comms)
        b.annotation(rng, t + 4, 20)
        g = max(g, t + 12)
        b.launch(kernel, t + 8, 6, g, 1_000, stream=7)
        t, g = t + 32, g + 1_000
        b.runtime("cudaStreamSynchronize", t, g - t + 2)
        t = g + 4
        b.step(n + 1, start, t - start)
        t += 20
    return b.write(path)
