"""Synthetic traces beyond single-node DDP training, each with its answer known by construction.

Written with ``synthetic.TraceBuilder`` (real Kineto JSON, parsed like any upload): collectives as
PyTorch records them (``c10d::`` op → ``record_param_comms`` → ``nccl:*`` range → NCCL kernel),
expert-parallel and custom all-reduce kernels, a straggler rank, the caching allocator switched off
on an AMD GPU, and a tensor-parallel inference server. All times in µs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from support.synthetic import TraceBuilder

GEMM = "sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32"
NCCL = {
    "all_reduce": (
        "c10d::allreduce_",
        "nccl:all_reduce",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)",
    ),
    "all_to_all": ("c10d::alltoall_base_", "nccl:all_to_all", "ncclDevKernel_SendRecv(ncclDevComm*)"),
    "all_gather": (
        "c10d::_allgather_base_",
        "nccl:_all_gather_base",
        "ncclDevKernel_AllGather_RING_LL(ncclDevComm*)",
    ),
    "reduce_scatter": (
        "c10d::_reduce_scatter_base_",
        "nccl:_reduce_scatter_base",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*)",
    ),
    "send": ("c10d::send", "nccl:send", "ncclDevKernel_SendRecv(ncclDevComm*)"),
    "recv": ("c10d::recv_", "nccl:recv", "ncclDevKernel_SendRecv(ncclDevComm*)"),
}


class Clock:
    """Host time ``t`` and device time ``g`` of one stream, advanced as work is queued."""

    def __init__(self, b: TraceBuilder, t: float = 100.0) -> None:
        self.b, self.t, self.g = b, t, t

    def compute(self, us: float, kernels: int = 10) -> None:
        """``kernels`` GEMMs totalling ``us`` of device time, launched back to back."""
        self.g = max(self.g, self.t + 10)
        for _ in range(kernels):
            self.b.cpu_op("aten::mm", self.t, 8)
            self.b.launch(GEMM, self.t + 1, 5, self.g, us / kernels)
            self.t += 8
            self.g += us / kernels

    def collective(self, kind: str, us: float, *, stream: int = 7) -> None:
        """One process-group collective whose kernel runs ``us`` after the queued work (exposed)."""
        op, rng, kernel = NCCL[kind]
        self.b.cpu_op(op, self.t, 30)
        self.b.cpu_op("record_param_comms", self.t + 2, 26)
        self.b.annotation(rng, self.t + 4, 20)
        start = max(self.g, self.t + 12)
        self.b.launch(kernel, self.t + 8, 6, start, us, stream=stream)
        self.t += 32
        self.g = start + us

    def sync(self) -> None:
        self.b.runtime("cudaStreamSynchronize", self.t, max(1.0, self.g - self.t) + 2)
        self.t = max(self.t, self.g) + 4


def _steps(b: TraceBuilder, path: Path, steps: int, body: Callable[[Clock], None]) -> Path:
    c = Clock(b)
    for n in range(steps):
        start = c.t
        body(c)
        c.sync()
        b.step(n + 1, start, c.t - start)
        c.t += 20
        c.g = c.t
    return b.write(path)


def all_to_all_trace(path: Path, rank: int = 0, world_size: int = 8, steps: int = 4) -> Path:
    """Recommendation model: 3 ms dense compute, an 8 ms exposed all-to-all and a 1.8 ms all-reduce."""

    def body(c: Clock) -> None:
        c.collective("all_to_all", 4_000)  # sparse features out
        c.compute(3_000)
        c.collective("all_to_all", 4_000)  # embeddings back
        c.collective("all_reduce", 1_800)  # dense gradients

    return _steps(TraceBuilder(rank=rank, world_size=world_size), path, steps, body)


def fsdp_trace(path: Path, rank: int = 0, world_size: int = 8, steps: int = 4, layers: int = 4) -> Path:
    """FSDP without prefetch: each layer's all-gather runs before its compute, nothing overlaps."""

    def body(c: Clock) -> None:
        for _ in range(layers):  # forward
            c.collective("all_gather", 1_500)
            c.compute(1_000, kernels=4)
        for _ in range(layers):  # backward: gather again, compute, reduce-scatter the gradients
            c.collective("all_gather", 1_500)
            c.compute(2_000, kernels=4)
            c.collective("reduce_scatter", 1_200)

    return _steps(TraceBuilder(rank=rank, world_size=world_size), path, steps, body)


def pipeline_trace(path: Path, rank: int = 1, world_size: int = 4, steps: int = 4, micro: int = 2) -> Path:
    """A middle pipeline stage with two micro-batches: it waits on its neighbours in recv/send."""

    def body(c: Clock) -> None:
        for _ in range(micro):
            c.collective("recv", 3_000)
            c.compute(1_500)
            c.collective("send", 500)
        for _ in range(micro):
            c.collective("recv", 2_500)
            c.compute(3_000)
            c.collective("send", 500)

    return _steps(TraceBuilder(rank=rank, world_size=world_size), path, steps, body)


def straggler_job(directory: Path, *, ranks: int = 2, slow_rank: int = 1, extra: float = 0.5) -> Path:
    """DDP ranks with 4 ms of compute before a 1 ms all-reduce; ``slow_rank`` computes ``extra`` more.

    Collectives are synchronised: every rank's all-reduce ends when the slowest rank's does, so the
    fast ranks wait inside the all-reduce kernel and all step times come out equal.
    """
    directory.mkdir(parents=True, exist_ok=True)
    base, wire = 4_000.0, 1_000.0
    for r in range(ranks):
        mine = base * (1 + extra) if r == slow_rank else base
        wait = base * (1 + extra) - mine  # the fast ranks sit in the collective until the slow one arrives

        def body(c: Clock, mine: float = mine, wait: float = wait) -> None:
            c.compute(mine)
            c.collective("all_reduce", wire + wait)

        _steps(TraceBuilder(rank=r, world_size=ranks), directory / f"rank{r}.json", 4, body)
    return directory


def deepep_trace(path: Path, rank: int = 0, world_size: int = 8, steps: int = 3) -> Path:
    """MoE with DeepEP: 98.6 ms of dispatch/combine per step on a side stream, 96 ms of it under compute."""
    b = TraceBuilder(rank=rank, world_size=world_size)

    def body(c: Clock) -> None:
        g0 = max(c.g, c.t + 10)
        c.compute(100_000, kernels=20)
        # Dispatch/combine kernels on stream 9, overlapping the compute, the last 2.6 ms exposed.
        at = g0 + 4_000
        for i, (name, dur) in enumerate(
            [("dispatch", 24_000), ("combine", 24_000), ("dispatch", 24_000), ("combine", 26_600)]
        ):
            corr_ts = c.t + i
            kernel = f"void dpsk::ep::intranode::{name}<8, 768, 4>(int4*, float*, int*, int const*, int)"
            b.launch(kernel, corr_ts, 3, at, dur, stream=9)
            at += dur
        c.g = max(c.g, at)

    return _steps(b, path, steps, body)


def hipfree_ddp_trace(path: Path, rank: int = 0, world_size: int = 2) -> Path:
    """DDP on an MI250 with PYTORCH_NO_HIP_MEMORY_CACHING=1: one step, 3.35 s of 3.39 s in hipFree.

    Every tensor's free synchronises the device and returns memory to the driver; the GPU idles.
    """
    b = TraceBuilder(
        device_name="AMD Instinct MI250X", total_memory=68_702_699_520, rank=rank, world_size=world_size
    )
    b.distributed = {"backend": "nccl", "rank": rank, "world_size": world_size}
    c = Clock(b)
    start = c.t
    total = 0
    for i in range(1_000):
        c.b.cpu_op("aten::empty", c.t, 3)
        c.b.runtime("hipMalloc", c.t + 0.5, 2)
        total += 1 << 20
        b.memory(c.t + 1, 1 << 20, total, total, addr=0x7F0000000000 + i * (1 << 20))
        c.t += 4
        c.compute(30, kernels=1)
        c.b.runtime("hipFree", c.t, 3_350)
        total -= 1 << 20
        b.memory(c.t + 3_349, -(1 << 20), total, total, addr=0x7F0000000000 + i * (1 << 20))
        c.t += 3_352
    c.collective("all_reduce", 2_000)
    c.sync()
    b.step(1, start, c.t - start)
    return b.write(path)


def tp_inference_trace(path: Path, rank: int = 0, world_size: int = 2, steps: int = 4) -> Path:
    """A vLLM decode step with tensor parallelism: tiny GEMMs and an exposed custom all-reduce per layer."""
    b = TraceBuilder(rank=rank, world_size=world_size, training=False)

    def body(c: Clock) -> None:
        b.events.append(
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/worker/gpu_model_runner.py(1200): execute_model",
                "pid": 4242,
                "tid": 4242,
                "ts": c.t,
                "dur": 5,
                "args": {},
            }
        )
        for _ in range(8):  # layers
            c.compute(400, kernels=4)
            g = max(c.g, c.t + 5)
            b.launch("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(...)", c.t, 4, g, 500)
            c.t += 6
            c.g = g + 500

    return _steps(b, path, steps, body)


def decode_loop_trace(path: Path, steps: int = 6, kernels: int = 300) -> Path:
    """A batch-1 decode loop in eager mode: per token, ``kernels`` tiny kernels launched one by one
    (4 µs of GPU work each, 20 µs of host dispatch), no phase named anywhere: the shape says decode."""
    b = TraceBuilder(training=False)
    t = 100.0
    for n in range(steps):
        start = t
        for _ in range(kernels):
            b.cpu_op("aten::linear", t, 18)
            b.launch(
                "void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4>(...)", t + 8, 6, t + 16, 4
            )
            t += 20
        b.step(n + 1, start, t + 5 - start)
        t += 10
    return b.write(path)
