"""Synthetic Kineto traces for the verdict cases of issue #9, built with ``synthetic.TraceBuilder``.

Each builder lays out the steps so the expected verdict holds by construction (times in µs):
an input-bound ResNet50-like step on a V100 (the classic ``num_workers=0`` trace) and its fixed
twin; loops without ``ProfilerStep#`` markers whose first iteration is 10× the others, found
from ``DataLoader.__next__``, ``Optimizer.step`` or a repeated top-level module; a single call with
nothing repeating; compute-bound steps with GEMM kernels of a chosen precision on a chosen
device; and optimizer steps that update parameters one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

from support.synthetic import TraceBuilder

LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
GEMM = {
    "fp32": {
        "sm70": "volta_sgemm_128x64_nn",
        "sm80": "ampere_sgemm_128x64_nn",
        "sm90": "sm90_sgemm_128x64_nn",
    },
    "fp16": {
        "sm70": "volta_h884gemm_64x64_ldg8_nn",
        "sm80": "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_nn",
        "sm90": "sm90_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize128x128x64",
    },
    "bf16": {
        "sm80": "sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32",
        "sm90": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
    },
    "fp8": {"sm90": "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128"},
}
DEVICES = {
    "sm60": ("Tesla P100-PCIE-16GB", 6),
    "sm70": ("Tesla V100-SXM2-16GB", 7),
    "sm80": ("NVIDIA A100-SXM4-80GB", 8),
    "sm90": ("NVIDIA H100 80GB HBM3", 9),
}


def _device(arch: str) -> TraceBuilder:
    name, major = DEVICES[arch]
    return TraceBuilder(device_name=name, compute_major=major)


def _kernels(b: TraceBuilder, t: float, name: str, count: int, dur: float, gap: float = 0.0) -> float:
    """``count`` kernels of ``dur`` launched just ahead of the GPU; returns when the last one ends."""
    g = t + 10
    for _ in range(count):
        b.cpu_op("aten::mm", t, 8)
        b.launch(name, t + 1, 5, g, dur)
        t += 8
        g += dur + gap
    return max(g, t)


def resnet_input_bound(path: Path, *, workers: int = 0, steps: int = 6) -> Path:
    """ResNet50-like on a V100, FP32 cuDNN/GEMM kernels. With ``workers=0`` each 30 ms step spends
    10 ms in ``DataLoader.__next__`` (33%) with the GPU idle, then 17 ms of kernels (GPU busy 56%)
    and 3 ms of launch gaps; with workers the loader returns in 0.2 ms."""
    b = _device("sm70")
    loader = 10_000.0 if workers == 0 else 200.0
    t = 100.0
    for n in range(steps):
        start = t
        b.annotation(LOADER, t, loader)
        t += loader
        b.memcpy("HtoD", t, 30, t + 5, 100, 4 << 20, pinned=True)
        t += 110
        for i in range(34):  # 34 × 500 µs of kernels, each followed by a ~90 µs launch gap
            name = "volta_scudnn_128x64_relu_interior_nn_v1" if i % 2 else "volta_sgemm_128x64_nn"
            b.cpu_op("aten::conv2d", t, 80)
            b.launch(name, t + 80, 8, t + 90, 500)
            t += 590
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def no_markers_warmup(path: Path, *, anchor: str = "dataloader", iterations: int = 6) -> Path:
    """A loop without step markers: each iteration loads a batch, runs 2 ms of bf16 GEMMs and an
    optimizer step; iteration 0 also autotunes (20 ms of extra kernels and a blocking sync), 10×
    the others. ``anchor`` picks what marks iterations: ``dataloader`` (DataLoader + optimizer),
    ``optimizer`` (only ``Optimizer.step``), ``module`` (only a repeated ``nn.Module`` forward)."""
    b = _device("sm80")
    gemm = GEMM["bf16"]["sm80"]
    t = 100.0
    for n in range(iterations):
        start = t
        if anchor == "dataloader":
            b.annotation(LOADER, t, 50)
            t += 60
        fwd_start = t
        if n == 0:  # cudnn.benchmark-style autotuning: many candidate kernels and a sync
            t = _kernels(b, t, "sm80_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", 100, 200)
            b.runtime("cudaDeviceSynchronize", t, 50)
            t += 60
        t = _kernels(b, t, gemm, 20, 100)
        if anchor == "module":
            b.cpu_op("nn.Module: Model_0", fwd_start, t - fwd_start)
        if anchor in ("dataloader", "optimizer"):
            b.annotation("Optimizer.step#AdamW.step", t, 100)
            b.cpu_op("aten::_foreach_add_", t + 5, 80)
            t += 110
        t += 20 if n < iterations - 1 else 0
        del start
    return b.write(path)


def single_call(path: Path) -> Path:
    """One forward call, 2.1 ms, mostly launch gaps around tiny kernels: nothing repeats."""
    b = _device("sm80")
    t = 100.0
    names = [f"void kernel_{i}(float*)" for i in range(30)]
    for name in names:
        b.cpu_op("aten::add", t, 60)
        b.launch(name, t + 50, 8, t + 62, 5)
        t += 70
    return b.write(path)


def compute_bound(path: Path, *, precision: str, arch: str, steps: int = 5) -> Path:
    """95% of each step in back-to-back GEMMs of ``precision`` on an ``arch`` GPU."""
    b = _device(arch)
    name = GEMM[precision].get(arch) or next(iter(GEMM[precision].values()))
    t = 100.0
    for n in range(steps):
        start = t
        b.annotation(LOADER.replace("Single", "MultiProcessing"), t, 20)
        t += 20
        t = _kernels(b, t, name, 40, 250)
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def optimizer_step(path: Path, *, optimizer: str, steps: int = 5) -> Path:
    """Compute-light steps whose ``Optimizer.step#<optimizer>.step`` updates 40 tensors one by one."""
    b = _device("sm80")
    t = 100.0
    for n in range(steps):
        start = t
        b.annotation(LOADER.replace("Single", "MultiProcessing"), t, 20)
        t += 20
        t = _kernels(b, t, GEMM["bf16"]["sm80"], 10, 100)
        opt_start = t
        for _ in range(40):
            for op in ("aten::mul_", "aten::add_"):
                b.cpu_op(op, t, 12)
                b.launch("void at::native::vectorized_elementwise_kernel<4>(add)", t + 2, 6, t + 10, 2)
                t += 14
        b.annotation(f"Optimizer.step#{optimizer}.step", opt_start, t - opt_start)
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def without_device_properties(path: Path) -> Path:
    """A GPU trace as Kineto wrote them in 2021: kernels, but no ``deviceProperties``."""
    b = TraceBuilder(gpu=False)
    t = 100.0
    for n in range(3):
        start = t
        t = _kernels(b, t, "volta_sgemm_128x64_nn", 20, 200)
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def communication_only(path: Path, *, steps: int = 5) -> Path:
    """Each step is a 3 ms all-reduce and 0.1 ms of other work: nothing to hide the collective behind."""
    b = TraceBuilder(device_name="NVIDIA A100-SXM4-80GB", rank=0, world_size=2)
    t = 100.0
    for n in range(steps):
        start = t
        b.cpu_op("nccl:all_reduce", t, 15)
        b.launch(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            t + 3,
            8,
            t + 15,
            3_000,
        )
        b.runtime("cudaStreamSynchronize", t + 20, 3_000)
        t += 3_030
        b.cpu_op("aten::add", t, 8)
        b.launch("void at::native::vectorized_elementwise_kernel<4>(add)", t + 1, 5, t + 10, 100)
        t += 120
        b.step(n + 1, start, t - start)
        t += 20
    return b.write(path)


# One-pass traces, blocking copies vs syncs (#22) ---------------------------------------------------

LAYER_KERNELS = (
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3",
    "void at::native::vectorized_elementwise_kernel<4>(add)",
    "void at::native::(anonymous namespace)::layer_norm_kernel<float>",
    "void at::native::vectorized_elementwise_kernel<4>(gelu)",
)


def one_pass_forward(path: Path, *, kernels: int = 600, first_call_us: float = 0.0) -> Path:
    """A bare ``profile()`` around one eager forward at batch 1: ``kernels`` kernels of ~8 µs, each
    launched ~20 µs after the previous (the GPU waits for the host between them), cycling through a
    layer's kernels and ending with a head kernel that runs once, so no iteration repeats.
    ``first_call_us``: a first call's one-time wait before the first kernel (lazy initialisation)."""
    b = _device("sm80")
    t = 100.0
    if first_call_us:
        b.cpu_op("aten::linear", t, first_call_us)  # cuBLAS handle, module loading: the GPU idles
        b.launch(LAYER_KERNELS[0], t + first_call_us - 10, 5, t + first_call_us - 4, 8)
        t += first_call_us
    for i in range(kernels):
        b.cpu_op("aten::linear" if i % 4 == 0 else "aten::add", t, 18)
        b.launch(LAYER_KERNELS[i % len(LAYER_KERNELS)], t + 10, 6, t + 18, 8)
        t += 20
    b.cpu_op("aten::linear", t, 18)
    b.launch("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_head", t + 10, 6, t + 18, 30)
    return b.write(path)


def first_call(path: Path) -> Path:
    """One call whose cost is a single 2 ms wait (lazy initialisation before its first kernel), then
    200 kernels queued ahead of the GPU, back to back: nothing else waits."""
    b = _device("sm80")
    b.cpu_op("aten::conv2d", 100, 2_000)  # cuDNN handle creation, module loading: the GPU idles
    t, g = 2_100.0, 2_110.0
    for i in range(200):
        b.cpu_op("aten::add", t, 3)
        b.launch(f"void kernel_{i}<float>(float*)", t + 1, 1, g, 8)
        t += 4
        g += 8
    return b.write(path)


def pageable_htod_loop(path: Path, *, steps: int = 5, copies: int = 4) -> Path:
    """Each step copies ``copies`` 8 MB batches with ``x.to(device)`` from pageable memory: the
    staged ``cudaMemcpyAsync`` blocks the host, then PyTorch's ``cudaStreamSynchronize`` waits for
    the copy (``memcpy_and_sync``), and the GPU idles until the host launches the next kernels."""
    b = _device("sm80")
    t = 100.0
    for n in range(steps):
        start = t
        for _ in range(copies):
            b.cpu_op("aten::to", t, 1_650)
            b.cpu_op("aten::_to_copy", t + 1, 1_648)
            b.cpu_op("aten::copy_", t + 2, 1_646)
            b.memcpy("HtoD", t + 3, 1_000, t + 900, 700, 8 << 20)  # staged at ~8 GB/s: blocks the host
            b.runtime("cudaStreamSynchronize", t + 1_005, 600)
            t += 1_650 + 150  # Python between the copy and the model's launches: the GPU idles
            t = _kernels(b, t, GEMM["bf16"]["sm80"], 4, 100)
        b.step(n + 1, start, t + 10 - start)
        t += 20
    return b.write(path)


def cpu_per_element(path: Path, *, elements: int = 2_000) -> Path:
    """A Python loop summing a CUDA tensor's elements, ``total += x[i].cpu()``, after one kernel
    made ``x``. Each ``.cpu()`` is a 4-byte DtoH copy into pageable memory followed by a
    ``cudaStreamSynchronize``: the GPU drains and idles while the host runs the loop's Python. No
    model, no step markers, no kernel sequence to repeat: one pass."""
    b = _device("sm80")
    b.cpu_op("aten::randn", 100, 20)
    b.launch(
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel", 105, 6, 112, 40
    )
    t = 160.0
    for i in range(elements):
        b.cpu_op("aten::select", t, 4)
        b.cpu_op("aten::to", t + 14, 30)
        b.cpu_op("aten::_to_copy", t + 15, 28)
        b.cpu_op("aten::copy_", t + 16, 26)
        b.memcpy("DtoH", t + 17, 8, t + 20, 2, 4)
        b.runtime("cudaStreamSynchronize", t + 26, 14)
        t += 44 + 16 + (i % 3)  # the loop's Python: sum on the host, next index
    b.cpu_op("aten::sum", t, 5)  # ends the loop once (a last distinct op)
    return b.write(path)
