"""Synthetic Kineto traces: real Chrome-trace JSON, written to disk so the parser is exercised too.

The builder emits what torch.profiler writes on a CUDA machine (``cpu_op``, ``user_annotation``,
``cuda_runtime`` with ``correlation``, ``kernel``/``gpu_memcpy`` with the same correlation,
``ac2g`` flow pairs, ``[memory]`` instants, ``deviceProperties``, ``distributedInfo``). The
scenario functions build traces whose bottleneck is known by construction, for labelled tests of
the GPU-side rules that a CPU-only test machine cannot record.
All times given to the builder are microseconds from the trace origin.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

PID = 4242
TID = 4242
A100_MEM = 85_899_345_920


class TraceBuilder:
    """Accumulates events; ``write`` produces a ``.json`` or ``.json.gz`` Kineto trace."""

    def __init__(
        self,
        *,
        device_name: str = "NVIDIA A100-SXM4-80GB",
        total_memory: int = A100_MEM,
        compute_major: int = 8,
        gpu: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        training: bool = True,
    ) -> None:
        self.events: list[dict[str, Any]] = []
        self.training = training  # each step then ends with a (1 µs) backward op, as training steps do
        self._corr = 1000
        self._ext = 1
        self.devices: list[dict[str, Any]] = []
        if gpu:
            self.devices.append(
                {
                    "id": 0,
                    "name": device_name,
                    "totalGlobalMem": total_memory,
                    "computeMajor": compute_major,
                    "computeMinor": 0,
                    "maxThreadsPerBlock": 1024,
                    "numSms": 108,
                }
            )
        self.distributed: dict[str, Any] | None = None
        if rank is not None:
            self.distributed = {"backend": "nccl", "rank": rank, "world_size": world_size or 1}

    # host side ---------------------------------------------------------------------------------
    def _host(self, cat: str, name: str, ts: float, dur: float, args: dict[str, Any]) -> None:
        self.events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": TID, "ts": ts, "dur": dur, "args": args}
        )

    def cpu_op(self, name: str, ts: float, dur: float, args: dict[str, Any] | None = None) -> None:
        """``args``: what the profiler records beside the id (``Input type``, ``Collective name``)."""
        self._ext += 1
        self._host("cpu_op", name, ts, dur, {"External id": self._ext, **(args or {})})

    def annotation(self, name: str, ts: float, dur: float) -> None:
        self._ext += 1
        self._host("user_annotation", name, ts, dur, {"External id": self._ext})

    def step(self, number: int, ts: float, dur: float) -> None:
        self.annotation(f"ProfilerStep#{number}", ts, dur)
        if self.training:  # what tells a training step from an inference one (``workload``)
            self.cpu_op("autograd::engine::evaluate_function: MmBackward0", ts + dur - 2, 1)

    def runtime(self, name: str, ts: float, dur: float) -> int:
        """A CUDA runtime call; returns its correlation id (for a GPU op it launches)."""
        self._corr += 1
        self._host("cuda_runtime", name, ts, dur, {"correlation": self._corr, "External id": self._ext})
        return self._corr

    # device side -------------------------------------------------------------------------------
    def _gpu(
        self, cat: str, name: str, ts: float, dur: float, corr: int, stream: int, args: dict[str, Any]
    ) -> None:
        base = {"device": 0, "stream": stream, "correlation": corr, "External id": self._ext}
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 0,
                "tid": stream,
                "ts": ts,
                "dur": dur,
                "args": base | args,
            }
        )
        launch_ts = next(e["ts"] for e in reversed(self.events) if e["args"].get("correlation") == corr)
        self.events.append(
            {"ph": "s", "id": corr, "pid": PID, "tid": TID, "ts": launch_ts, "cat": "ac2g", "name": "ac2g"}
        )
        self.events.append(
            {
                "ph": "f",
                "id": corr,
                "pid": 0,
                "tid": stream,
                "ts": ts,
                "cat": "ac2g",
                "name": "ac2g",
                "bp": "e",
            }
        )

    def launch(
        self,
        kernel: str,
        cpu_ts: float,
        cpu_dur: float,
        gpu_ts: float,
        gpu_dur: float,
        *,
        stream: int = 7,
        api: str = "cudaLaunchKernel",
    ) -> None:
        corr = self.runtime(api, cpu_ts, cpu_dur)
        args = {
            "blocks per SM": 2.0,
            "warps per SM": 16.0,
            "est. achieved occupancy %": 50,
            "grid": [216, 1, 1],
        }
        self._gpu("kernel", kernel, gpu_ts, gpu_dur, corr, stream, args)

    def memcpy(
        self,
        direction: str,
        cpu_ts: float,
        cpu_dur: float,
        gpu_ts: float,
        gpu_dur: float,
        nbytes: int,
        *,
        pinned: bool = False,
        api: str = "cudaMemcpyAsync",
        stream: int = 7,
    ) -> None:
        host = "Pinned" if pinned else "Pageable"
        name = {
            "HtoD": f"Memcpy HtoD ({host} -> Device)",
            "DtoH": f"Memcpy DtoH (Device -> {host})",
            "DtoD": "Memcpy DtoD (Device -> Device)",
        }[direction]
        corr = self.runtime(api, cpu_ts, cpu_dur)
        gbps = nbytes / (gpu_dur * 1e3) if gpu_dur else 0.0
        self._gpu(
            "gpu_memcpy",
            name,
            gpu_ts,
            gpu_dur,
            corr,
            stream,
            {"bytes": nbytes, "memory bandwidth (GB/s)": gbps},
        )

    def memory(self, ts: float, nbytes: int, total_allocated: int, total_reserved: int, addr: int) -> None:
        self.events.append(
            {
                "ph": "i",
                "cat": "cpu_instant_event",
                "s": "t",
                "name": "[memory]",
                "pid": PID,
                "tid": TID,
                "ts": ts,
                "args": {
                    "Device Type": 1 if self.devices else 0,
                    "Device Id": 0 if self.devices else -1,
                    "Addr": addr,
                    "Bytes": nbytes,
                    "Total Allocated": total_allocated,
                    "Total Reserved": total_reserved,
                },
            }
        )

    # output ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schemaVersion": 1,
            "deviceProperties": self.devices,
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1_700_000_000_000_000_000,
            "traceEvents": self.events,
        }
        if self.distributed:
            doc["distributedInfo"] = self.distributed
        return doc

    def write(self, path: Path) -> Path:
        data = json.dumps(self.to_dict()).encode()
        if path.name.endswith(".gz"):
            data = gzip.compress(data)
        path.write_bytes(data)
        return path


# Scenarios: each step's layout is chosen so one cause dominates the step by construction. ----------


def _loader(b: TraceBuilder, t: float, dur: float = 40.0) -> float:
    b.annotation("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", t, dur)
    return t + dur


def pageable_transfer_trace(path: Path, steps: int = 5) -> Path:
    """Each step copies 64 MB from pageable host memory (~12 ms at 5.3 GB/s), then 3 ms of kernels."""
    b = TraceBuilder()
    t = 100.0
    for n in range(steps):
        start = t
        t = _loader(b, t)
        b.cpu_op("aten::to", t, 12_100)
        b.cpu_op("aten::copy_", t + 5, 12_090)
        b.memcpy("HtoD", t + 10, 12_080, t + 30, 12_000, 64 << 20)
        t += 12_120
        for _ in range(30):
            b.cpu_op("aten::mm", t, 12)
            b.launch("ampere_bf16_s16816gemm_bf16_128x128_nn", t + 2, 8, t + 12, 100)
            t += 100
        b.step(n + 1, start, t + 20 - start)
        t += 40
    return b.write(path)


def launch_bound_trace(path: Path, steps: int = 5) -> Path:
    """400 tiny kernels (4 µs) per step, launched every 25 µs: the GPU waits on the host."""
    b = TraceBuilder()
    t = 100.0
    for n in range(steps):
        start = t
        t = _loader(b, t, 20)
        for _ in range(400):
            b.cpu_op("aten::add", t, 22)
            b.launch("void at::native::vectorized_elementwise_kernel<4>(add)", t + 10, 8, t + 20, 4)
            t += 25
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def sync_bound_trace(path: Path, steps: int = 5) -> Path:
    """20 × per step: a 200 µs kernel, then ``.item()`` blocks, then 300 µs of host work on an idle GPU.

    Without the sync the next kernel would run under the host work: the step would shrink to the
    host's own work (its time less the blocked time), about 1.6× shorter.
    """
    b = TraceBuilder()
    t = 100.0
    for n in range(steps):
        start = t
        t = _loader(b, t, 20)
        for _ in range(20):
            b.cpu_op("aten::mul", t, 10)
            b.launch("void at::native::elementwise_kernel<128, 2>(mul)", t + 2, 6, t + 8, 200)
            # aten::item -> _local_scalar_dense -> DtoH copy + stream sync until the kernel finished.
            b.cpu_op("aten::item", t + 10, 212)
            b.cpu_op("aten::_local_scalar_dense", t + 11, 210)
            b.memcpy("DtoH", t + 12, 5, t + 209, 2, 4)
            b.runtime("cudaStreamSynchronize", t + 18, 200)
            t += 222
            b.cpu_op("aten::lt", t + 20, 20)  # host-side Python work follows
            t += 300
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def exposed_nccl_trace(
    path: Path, steps: int = 5, rank: int = 0, world_size: int = 2, slow: float = 1.0
) -> Path:
    """4 ms of compute then a 6 ms all-reduce that nothing overlaps (scaled by ``slow``)."""
    b = TraceBuilder(rank=rank, world_size=world_size)
    t = 100.0
    for n in range(steps):
        start = t
        t = _loader(b, t, 20)
        g = t + 10  # the GPU runs the queued kernels back to back
        for _ in range(20):
            b.cpu_op("aten::mm", t, 10)
            b.launch("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32", t + 2, 6, g, 200 * slow)
            t += 10
            g += 200 * slow
        b.cpu_op("nccl:all_reduce", t, 15)
        b.launch(
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            t + 3,
            8,
            g + 5,
            6_000,
        )
        b.runtime("cudaStreamSynchronize", t + 20, g + 6_010 - (t + 20))
        t = g + 6_020
        b.step(n + 1, start, t - start)
        t += 20
    return b.write(path)


def allocator_churn_trace(path: Path, steps: int = 5) -> Path:
    """Every step frees and re-mallocs a 4 GiB block (4 ms of host time on an idle GPU) near capacity:
    the allocator's own retry, inside the ``aten::empty`` that found no fitting cached block."""
    b = TraceBuilder()
    block = 4 << 30
    base = int(A100_MEM * 0.9)
    t = 100.0
    for n in range(steps):
        start = t
        t = _loader(b, t, 20)
        b.cpu_op("aten::empty", t - 1, 4_002)
        b.runtime("cudaFree", t, 1_000)
        b.memory(t + 1, -block, base - block, base - block, addr=0x7F0000000000)
        b.runtime("cudaMalloc", t + 1_000, 3_000)
        b.memory(t + 3_999, block, base, base + (1 << 30), addr=0x7F0000000000)
        t += 4_000
        for _ in range(10):
            b.cpu_op("aten::mm", t, 10)
            b.launch("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32", t + 2, 6, t + 10, 100)
            t += 100
        b.step(n + 1, start, t + 20 - start)
        t += 40
    return b.write(path)


GIB = 1 << 30


class _Allocator:
    """Tracks what a synthetic CUDA allocator has allocated, so each ``[memory]`` event carries the
    totals torch's would: ``Total Allocated`` after the event, ``Total Reserved`` at least as much."""

    def __init__(self, b: TraceBuilder, live_before: int, reserve_extra: int) -> None:
        self.b, self.allocated, self.extra = b, live_before, reserve_extra
        self.reserved = live_before + reserve_extra
        self._addr = 0x7F0000000000

    def alloc(self, t: float, nbytes: int) -> int:
        self._addr += 1 << 32
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated + self.extra)
        self.b.memory(t, nbytes, self.allocated, self.reserved, addr=self._addr)
        return self._addr

    def free(self, t: float, addr: int, nbytes: int) -> None:
        self.allocated -= nbytes
        self.b.memory(t, -nbytes, self.allocated, self.reserved, addr=addr)


def memory_trace(
    path: Path,
    *,
    params: int,
    grads: int,
    state: int,
    activations: int,
    inputs: int = 0,
    temporaries: int = 0,
    optimizer: str = "AdamW",
    training: bool = True,
    reserve_extra: int = 0,
    oom_request: int = 0,
    steps: int = 4,
    total_memory: int = A100_MEM,
) -> Path:
    """Training (or inference) steps whose memory is made of known parts, on a CUDA device.

    Parameters and optimizer state were allocated before the capture and stay; with ``training``,
    each step frees the last step's gradients in ``zero_grad`` (``set_to_none=True``: the first
    step frees gradients made before the capture), allocates the batch (``inputs``) in the DataLoader
    range, saves ``activations`` in four forward ops (plus ``temporaries`` freed at once), frees them
    in backward while allocating ``grads``, and runs the optimizer (a short-lived temporary). Peak
    allocated is ``params + state + activations + inputs + temporaries`` (the gradients are freed
    before the forward); ``reserve_extra`` keeps that much more reserved than allocated (a
    fragmented cache); ``oom_request`` adds an ``[OutOfMemory]`` event for a request of that size in
    the last step's forward, after the activations.
    """
    b = TraceBuilder(training=False, total_memory=total_memory)  # backward ops are written here
    live = params + state + (grads if training else 0)
    mem = _Allocator(b, live, reserve_extra)
    grad_blocks: list[tuple[int, int]] = (
        [(0x10_0000_0000 + k, grads // 4) for k in range(4)] if training else []
    )
    t = 100.0
    for n in range(steps):
        start = t
        if training:
            b.annotation(f"Optimizer.zero_grad#{optimizer}.zero_grad", t, 20)
            for k, (addr, size) in enumerate(grad_blocks):
                mem.free(t + 2 + k, addr, size)
            t += 25
        b.annotation("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t, 30)
        batch = mem.alloc(t + 10, inputs) if inputs else 0
        t += 35
        saved = []
        for _ in range(4):
            b.cpu_op("aten::linear", t, 90)
            saved.append(mem.alloc(t + 10, activations // 4))
            if temporaries:
                tmp = mem.alloc(t + 20, temporaries)
                mem.free(t + 60, tmp, temporaries)
            b.launch("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32", t + 30, 5, t + 40, 40)
            t += 100
        if oom_request and n == steps - 1:
            b.events.append(
                {
                    "ph": "i",
                    "cat": "cpu_instant_event",
                    "s": "t",
                    "name": "[OutOfMemory]",
                    "pid": PID,
                    "tid": TID,
                    "ts": t - 5,
                    "args": {
                        "Device Type": 1,
                        "Device Id": 0,
                        "Addr": 0,
                        "Bytes": oom_request,
                        "Total Allocated": mem.allocated,
                        "Total Reserved": mem.reserved,
                    },
                }
            )
        if training:
            grad_blocks = []
            for addr in reversed(saved):
                b.cpu_op("autograd::engine::evaluate_function: AddmmBackward0", t, 90)
                grad_blocks.append((mem.alloc(t + 10, grads // 4), grads // 4))
                mem.free(t + 80, addr, activations // 4)
                b.launch("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32", t + 30, 5, t + 40, 40)
                t += 100
            b.annotation(f"Optimizer.step#{optimizer}.step", t, 60)
            b.cpu_op("aten::_foreach_add", t + 5, 50)
            tmp = mem.alloc(t + 10, 1 << 20)
            mem.free(t + 50, tmp, 1 << 20)
            t += 65
        else:
            for k, addr in enumerate(saved):
                mem.free(t + k, addr, activations // 4)
            t += 10
        if inputs:
            mem.free(t, batch, inputs)
        b.step(n + 1, start, t + 5 - start)
        t += 20
    return b.write(path)
