"""What precision the heavy kernels run in, and what the device supports (anchors §9).

Advice to "use mixed precision" is only worth giving for matmul-class work (GEMM, convolution,
attention) still in FP32, in a dtype the device has fast units for. Both facts are in the trace:
kernel names carry the precision (cuBLAS/CUTLASS/cuDNN and ROCm Tensile/hipBLASLt conventions), and
``deviceProperties`` the compute capability; when that is missing or ambiguous (AMD reports gfx
versions as 9.x, old traces have no properties at all) the device name and the launch API decide.

With ``record_shapes`` the op that launched a kernel also says it: ``aten::mm`` with ``Input type``
``["float", "float"]`` is FP32 work whatever its kernel is called (Triton, CUTLASS, a fused kernel
with no dtype token). That op dtype decides where the name says nothing, and wins where the two
disagree (both are kept in the evidence, ``MatmulPrecision.evidence``).
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model import intervals as iv
from ..model.arrays import distinct
from ..model.steps import launching_call
from ..model.trace import I8, NONE, DeviceInfo, GpuKind, HostKind, RankTrace
from ..parsing.schema import MATMUL_OPS

# Kernels doing matmul-class arithmetic, where precision decides speed (substrings of the
# lower-cased name: kernel names are long C++ templates, and substring tests are ~50× cheaper than
# a case-insensitive regex scan of them).
_MATMUL_TOKENS = (
    "gemm", "cijk_", "cudnn", "xmma", "cutlass", "wgrad", "dgrad", "fprop", "flash", "fmha", "attn",
    "attention", "sdpa", "winograd", "matmul", "bmm", "cublas", "hipblas", "rocblas",
)  # fmt: skip
# Kernels a matmul-class op (or cuDNN) also launches that move, normalise or combine data rather
# than multiply matrices: layout transforms around NHWC convolution kernels, batch norm, pointwise
# and reduction kernels. Their speed does not follow the matmul precision, so neither their name
# ("cudnn") nor the launching op's dtype makes them matmul work.
# cuDNN's (and MIOpen's) transposes between a channels-first tensor and a channels-last kernel.
_LAYOUT_TOKENS = ("nchwtonhwc", "nhwctonchw", "nchw2nhwc", "nhwc2nchw")
_AUXILIARY_TOKENS = (
    *_LAYOUT_TOKENS, "transpose", "bn_fw", "bn_bw", "batchnorm", "batch_norm",
    "elementwise_kernel", "reduce_kernel", "pooling", "softmax", "layer_norm", "fill_kernel",
)  # fmt: skip
# Ordered: the first match wins (a bf16 GEMM accumulating in f32 names both).
_PRECISION_TOKENS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp8", ("e4m3", "e5m2", "fp8", "f8f8", "_f8_")),
    ("int8", ("i8816", "imma", "int8", "i8i8", "s8s8")),
    ("bf16", ("bf16", "bfloat16")),
    ("fp16", ("h884", "h1688", "h16816", "hgemm", "hcudnn", "fp16", "f16f16", "_f16", "__half", "c10::half")),
    ("tf32", ("tf32", "xf32")),
    ("fp64", ("dgemm", "fp64", "f64f64", "double")),
    ("fp32", ("sgemm", "scudnn", "f32f32_f32f32", "<float", "_fp32")),
)
_HALF_RE = re.compile(r"\bhalf\b")
# ROCm Tensile names: Cijk_<A layout>_<B layout>_<dtype token>_..., first letter of the dtype token.
_TENSILE_DTYPE = {"H": "fp16", "B": "bf16", "S": "fp32", "D": "fp64", "I": "int8", "F": "fp8", "X": "tf32"}
# CUTLASS tensor-core GEMMs with FP32 accumulation and no input dtype in the name take TF32 inputs.
_TENSOR_CORE_FP32 = ("tensorop_s", "s1688gemm", "s16816gemm")

LOW_PRECISION = ("fp8", "int8", "fp16", "bf16")
# A matmul kernel shorter than this is bound by its launch-to-SM latency and operand loads, not by
# arithmetic: cuBLAS GEMMs of a few hundred rows and columns take 3-10 µs on V100-H100 whatever the
# dtype, so a faster precision barely shortens them (``MatmulPrecision.short_ns_by_precision``).
LATENCY_BOUND_NS = 10_000


@functools.lru_cache(maxsize=1 << 16)
def matmul_precision(name: str) -> str | None:
    """Precision of a matmul-class kernel ("fp32", "tf32", "bf16", ..., "unknown"); None if not matmul-class."""
    low = name.lower()
    if not any(t in low for t in _MATMUL_TOKENS) and "conv" not in low.replace("convert", ""):
        return None
    if is_auxiliary(name):
        return None
    if name.startswith("Cijk_"):
        tokens = name.split("_")
        if len(tokens) > 3 and tokens[3]:
            return _TENSILE_DTYPE.get(tokens[3][0], "unknown")
    for precision, needles in _PRECISION_TOKENS:
        if any(t in low for t in needles):
            return precision
        if precision == "fp16" and _HALF_RE.search(low):
            return precision
    if "fmha" in low and "f32" in low:
        return "fp32"
    if any(t in low for t in _TENSOR_CORE_FP32):
        return "tf32"
    return "unknown"


@functools.lru_cache(maxsize=1 << 16)
def is_auxiliary(name: str) -> bool:
    """A data-movement, normalisation or pointwise kernel (``_AUXILIARY_TOKENS``): never matmul work."""
    low = name.lower()
    return any(t in low for t in _AUXILIARY_TOKENS)


@functools.lru_cache(maxsize=1 << 16)
def is_layout_transform(name: str) -> bool:
    """An NCHW<->NHWC transform around a convolution kernel that wants the other layout."""
    low = name.lower()
    return any(t in low for t in _LAYOUT_TOKENS)


# Codes for per-kernel precision arrays (-1: not matmul-class / not known).
PRECISIONS = ("fp8", "int8", "bf16", "fp16", "tf32", "fp64", "fp32", "unknown")
_CODE = {p: i for i, p in enumerate(PRECISIONS)}


_TF32, _FP32, _UNKNOWN = _CODE["tf32"], _CODE["fp32"], _CODE["unknown"]

# Host ops doing matmul-class work, whose input dtype is the precision of the kernels they launch
# (the parser reads ``Input type`` on these ops only).
_MATMUL_OP_RE = re.compile(MATMUL_OPS)


def op_dtype_precision(dtype: str) -> str | None:
    """Precision of an op's floating ``Input type`` ("float", "c10::BFloat16", "float8_e4m3fn")."""
    low = dtype.lower().removeprefix("c10::")
    if "float8" in low:
        return "fp8"
    if "bfloat16" in low:
        return "bf16"
    if "half" in low:
        return "fp16"
    if low in ("float", "float32"):
        return "fp32"
    if low in ("double", "float64"):
        return "fp64"
    return None


def kernel_op_precision(trace: RankTrace) -> I8:
    """Per GPU event, the precision code of the matmul-class op that launched it (-1 when none).

    The launch call carries the External id of the innermost op around it (``aten::addmm`` inside
    ``aten::linear``), whose first floating input is the dtype the kernel computes in.
    """

    def evaluate() -> I8:
        h, g = trace.host, trace.gpu
        out = np.full(len(g), -1, np.int8)
        typed = h.input_dtype != NONE
        if not typed.any() or not len(g):
            return out
        ops = np.flatnonzero(
            typed & trace.host_named(_MATMUL_OP_RE.match, "precision.matmul_ops", HostKind.CPU_OP)
        )
        ops = ops[h.external_id[ops] != NONE]
        if ops.size == 0:
            return out
        # Precision code per dtype string id, looked up for every op at once.
        by_dtype = np.full(len(trace.strings), -1, np.int8)
        for d in distinct(h.input_dtype[ops]).tolist():
            by_dtype[d] = _CODE.get(op_dtype_precision(trace.strings[d]) or "", -1)
        codes = by_dtype[h.input_dtype[ops]]
        order = h.external_id[ops].argsort(kind="stable")
        ext, codes = h.external_id[ops][order], codes[order]
        call = launching_call(trace)
        launched = np.flatnonzero(call >= 0)
        want = h.external_id[call[launched]]
        j = np.minimum(ext.searchsorted(want), ext.size - 1)
        hit = ext[j] == want
        out[launched[hit]] = codes[j[hit]]
        # Older Kineto: a launch's id names no op; find the matmul op around it. A launch whose id
        # names another op (``aten::copy_`` inside an autocast ``aten::linear``) is that op's work.
        rest = launched[~hit]
        if rest.size:
            op_ids = h.external_id[trace.host_kind(HostKind.CPU_OP) & (h.external_id != NONE)]
            rest = rest[~iv.member(h.external_id[call[rest]], op_ids)]
        if rest.size:
            out[rest] = _code_of_op_around(trace, ops, by_dtype, call[rest])
        return out

    return trace.memo("precision.kernel_op", evaluate)


def _code_of_op_around(trace: RankTrace, ops: np.ndarray, by_dtype: I8, calls: np.ndarray) -> I8:
    """Precision code of the innermost of ``ops`` around each launch call on its thread (-1: none)."""
    h = trace.host
    out = np.full(calls.size, -1, np.int8)
    for thread in distinct(h.tid[ops]).tolist():
        mine = ops[h.tid[ops] == thread]
        mine = mine[h.ts[mine].argsort(kind="stable")]
        sel = np.flatnonzero(h.tid[calls] == thread)
        at = h.ts[calls[sel]]
        j = h.ts[mine].searchsorted(at, side="right") - 1
        ok = j >= 0
        ok[ok] = h.end[mine[j[ok]]] >= at[ok]  # the latest op starting before the launch still runs
        out[sel[ok]] = by_dtype[h.input_dtype[mine[j[ok]]]]
    return out


def _kernel_precisions(trace: RankTrace, kernels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of the selected kernels: precision by name, by launching op, and the one used (codes, -1 none).

    The op's dtype decides where the name is silent (not matmul-like, or no dtype token) and where
    they disagree; a TF32 kernel for an FP32 op agrees (that is how FP32 matmuls run on tensor cores).
    """
    g = trace.gpu
    names = g.name[kernels]
    by_name = np.full(len(trace.strings), -1, np.int8)
    used_names = np.bincount(names, minlength=len(trace.strings)).nonzero()[0].tolist()
    strings = trace.strings
    by_name[used_names] = [_CODE.get(matmul_precision(strings[i]) or "", -1) for i in used_names]
    name_code = by_name[names]
    op_code = kernel_op_precision(trace)[kernels]
    # A matmul op's layout/pointwise kernels are not its matmul.
    op_code = np.where(trace.gpu_named(is_auxiliary, "precision.auxiliary")[kernels], -1, op_code)
    agree = (name_code == op_code) | ((name_code == _TF32) & (op_code == _FP32))
    silent = (name_code < 0) | (name_code == _UNKNOWN)
    used = np.where((op_code < 0) | agree | ((op_code == _UNKNOWN) & ~silent), name_code, op_code)
    return name_code, op_code, used


def _ns_by_code(codes: np.ndarray, durs: np.ndarray) -> dict[str, float]:
    sums = np.bincount(
        codes[codes >= 0], weights=durs[codes >= 0].astype(np.float64), minlength=len(PRECISIONS)
    )
    return {PRECISIONS[i]: float(sums[i]) for i in sums.nonzero()[0].tolist()}


@dataclass(frozen=True)
class MatmulPrecision:
    """The selected kernels' matmul precision, decided once for every reader (``_kernel_precisions``)."""

    ns_by_precision: dict[str, float]  # total kernel ns per matmul precision (non-matmul left out)
    short_ns_by_precision: dict[str, float]  # the part of it in kernels under LATENCY_BOUND_NS
    # Where it came from, µs per step: kernel names, launching ops' input dtypes, and the kernels
    # where they disagree (the op dtype was used). Empty without op dtypes.
    evidence: dict[str, Any]
    fp32_by_name: np.ndarray  # the selected kernels (indices) whose name says FP32


def matmul_precisions(trace: RankTrace, kernels: np.ndarray, n_steps: int) -> MatmulPrecision:
    """Precision of the selected kernels' matmul-class work, by name and by launching op."""
    if not kernels.any():
        return MatmulPrecision({}, {}, {}, np.zeros(0, np.int64))
    name_code, op_code, used = _kernel_precisions(trace, kernels)
    idx = kernels.nonzero()[0]
    durs = trace.gpu.dur[idx]
    return MatmulPrecision(
        _ns_by_code(used, durs),
        _ns_by_code(np.where(durs < LATENCY_BOUND_NS, used, -1), durs),
        _evidence(trace, idx, durs, name_code, op_code, used, n_steps),
        idx[name_code == _FP32],
    )


def _evidence(
    trace: RankTrace,
    idx: np.ndarray,
    durs: np.ndarray,
    name_code: np.ndarray,
    op_code: np.ndarray,
    used: np.ndarray,
    n_steps: int,
) -> dict[str, Any]:
    if not (op_code >= 0).any():
        return {}
    per_step = max(1, n_steps) * 1e3

    def us(by: dict[str, float]) -> dict[str, float]:
        return {k: round(v / per_step, 1) for k, v in by.items()}

    differ = (op_code >= 0) & (name_code >= 0) & (name_code != _UNKNOWN) & (used != name_code)
    names = trace.gpu.name[idx]
    disagreements = [
        {
            "kernel": trace.strings[int(i)],
            "kernel_name_says": PRECISIONS[int(name_code[differ & (names == i)][0])],
            "op_dtype_says": PRECISIONS[int(op_code[differ & (names == i)][0])],
        }
        for i in distinct(names[differ])[:5].tolist()
    ]
    return {
        "by_kernel_name_us_per_step": us(_ns_by_code(name_code, durs)),
        "by_op_dtype_us_per_step": us(_ns_by_code(op_code, durs)),
        "decided_by_op_dtype_us_per_step": us(_ns_by_code(np.where(used != name_code, used, -1), durs)),
        "disagreements": disagreements,
    }


@dataclass(frozen=True)
class DeviceCaps:
    """The reduced-precision units a GPU has; what precision advice may recommend."""

    vendor: str  # "nvidia" | "amd" | "unknown"
    arch: str  # e.g. "sm_80", "cdna3", "unknown"
    fp16: bool
    bf16: bool
    tf32: bool
    fp8: bool
    source: str  # "deviceProperties" | "name" | "unknown"

    @property
    def autocast_dtype(self) -> str | None:
        """The dtype to autocast FP32 matmuls to: bf16 where supported, fp16 (with a GradScaler) on Volta/Turing."""
        if self.bf16:
            return "bfloat16"
        if self.fp16:
            return "float16"
        return None


_NVIDIA_NAMES: tuple[tuple[str, tuple[int, int]], ...] = (
    (r"B200|B100|GB200|B300", (10, 0)),
    (r"H100|H200|H800|GH200|H20\b", (9, 0)),
    (r"L40|L4\b|RTX 40\d\d|RTX 6000 Ada|\bAda\b", (8, 9)),
    (r"A100|A800|A30\b|A10\b|A10G|A40|A16|A2\b|RTX 30\d\d|RTX A\d000", (8, 0)),
    (r"T4\b|RTX 20\d\d|Quadro RTX|TITAN RTX|GTX 16\d\d", (7, 5)),
    (r"V100|TITAN V", (7, 0)),
    (r"P100|P40|P4\b|GTX 10\d\d|K80|M60|M40", (6, 0)),
)
_AMD_NAMES: tuple[tuple[str, str], ...] = (
    (r"MI3[0-2]\d|MI35\d", "cdna3"),
    (r"MI2\d\d", "cdna2"),
    (r"MI100", "cdna1"),
)
_AMD_RE = re.compile(r"AMD|Instinct|Radeon|\bMI\d{3}", re.I)


def device_caps(device: DeviceInfo | None, *, amd: bool = False) -> DeviceCaps:
    """Precision support of a GPU from its properties, else its name; ``amd`` when the trace launched via HIP."""
    name = device.name if device else ""
    if amd or _AMD_RE.search(name):
        arch = next((a for pat, a in _AMD_NAMES if re.search(pat, name)), "")
        if not arch and device and device.compute_major >= 9:
            # gfx9xx: 9.4 is MI300 (gfx94x), 9.0 with a 90a-class part is MI200; both have bf16.
            arch = "cdna3" if device.compute_minor >= 4 else "cdna2"
        arch = arch or "unknown"
        modern = arch in ("cdna2", "cdna3")
        src = "name" if name else ("deviceProperties" if device else "unknown")
        return DeviceCaps("amd", arch, True, modern, False, arch == "cdna3", src)
    cc: tuple[int, int] | None = None
    source = "unknown"
    if device and device.compute_major > 0:
        cc, source = (device.compute_major, device.compute_minor), "deviceProperties"
    elif name:
        cc = next((v for pat, v in _NVIDIA_NAMES if re.search(pat, name, re.I)), None)
        source = "name" if cc else "unknown"
    if cc is None:
        return DeviceCaps(
            "unknown" if not name else "nvidia", "unknown", False, False, False, False, "unknown"
        )
    return nvidia_caps(*cc, source=source)


def nvidia_caps(major: int, minor: int, *, source: str, floor: bool = False) -> DeviceCaps:
    """An NVIDIA GPU of compute capability ``major.minor`` (``floor``: at least that, e.g. ``sm_70+``)."""
    return DeviceCaps(
        "nvidia",
        f"sm_{major}{minor}" + ("+" if floor else ""),
        fp16=major >= 7,
        bf16=major >= 8,
        tf32=major >= 8,
        fp8=(major, minor) >= (8, 9),
        source=source,
    )


def trace_caps(trace: RankTrace) -> DeviceCaps | None:
    """The trace's first GPU's capabilities (cached); None on CPU-only traces."""

    def evaluate() -> DeviceCaps | None:
        if not trace.has_gpu or not len(trace.gpu):
            return None
        device = trace.devices[0] if trace.devices else None
        amd = _launched_via_hip(trace)
        caps = device_caps(device, amd=amd)
        if caps.arch == "unknown" and not amd:
            floor = _kernel_arch_floor(trace)
            if floor is not None:
                # Kernels built for sm_XY run on sm_XY or newer: a lower bound, so advice that
                # fits it (fp16 on sm_70, bf16 on sm_80) fits the device too.
                caps = nvidia_caps(*floor, source="kernel names", floor=True)
        return caps

    return trace.memo("precision.caps", evaluate)


# cuBLAS/cuDNN/CUTLASS kernels name the architecture they were built for.
_ARCH_PREFIXES = {
    "maxwell_": (5, 0),
    "pascal_": (6, 0),
    "volta_": (7, 0),
    "turing_": (7, 5),
    "ampere_": (8, 0),
}
# A name's arch is its leftmost ``(?:^|[^a-z0-9])(?:sm|cutlass_)(\d)(\d)_`` match; it is found as the
# literal part with the boundary checked per hit, over all names joined (``_kernel_arch_floor``).
# Two patterns, not one alternation: each starts with a literal, which ``re`` scans for ~6× faster,
# and no hit of one can overlap a hit of the other, so their hits merged by position are the same.
_ARCH_RES = (re.compile(r"sm(\d)(\d)_"), re.compile(r"cutlass_(\d)(\d)_"))
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


# Architecture each kernel name says (None: none), kept across traces: a model's traces share their
# library kernels, so only names not seen before are scanned (bounded like ``model``'s name answers).
_ARCH_SAID: dict[str, tuple[int, int] | None] = {}
_MAX_ARCH_SAID = 1 << 16


def _kernel_arch_floor(trace: RankTrace) -> tuple[int, int] | None:
    """The newest architecture the trace's library kernels were built for (None when none say)."""
    kernels = trace.gpu_kind(GpuKind.KERNEL)
    if not kernels.any():
        return None
    names = [trace.strings[i] for i in distinct(trace.gpu.name[kernels]).tolist()]
    if len(_ARCH_SAID) > _MAX_ARCH_SAID:
        _ARCH_SAID.clear()
    new = [s for s in names if s not in _ARCH_SAID]
    if new:
        _ARCH_SAID.update(zip(new, _archs_said([s.lower() for s in new]), strict=True))
    found = [a for s in names if (a := _ARCH_SAID[s]) is not None]
    return max(found) if found else None


def _archs_said(lows: list[str]) -> list[tuple[int, int] | None]:
    """The newest architecture each lower-cased name says (None: none).

    One scan over the names joined by newlines, not one per name: a name says an architecture by
    starting with a prefix or having it after a space, and by its leftmost ``_ARCH_RES`` hit at its
    start or after a character other than [a-z0-9].
    """
    text = "\n".join(lows)
    first: list[int] = []  # where each name starts in ``text``
    at = 0
    for low in lows:
        first.append(at)
        at += len(low) + 1
    starts = set(first)
    said: list[tuple[int, int] | None] = [None] * len(lows)

    def say(at: int, arch: tuple[int, int]) -> None:
        owner = bisect.bisect_right(first, at) - 1
        known = said[owner]
        if known is None or arch > known:
            said[owner] = arch

    for prefix, arch in _ARCH_PREFIXES.items():
        at = text.find(prefix)
        while at >= 0:
            if at in starts or text[at - 1] == " ":
                say(at, arch)
            at = text.find(prefix, at + 1)
    named: set[int] = set()
    hits = sorted((m for rx in _ARCH_RES for m in rx.finditer(text)), key=lambda m: m.start())
    for m in hits:  # no match can start inside another ("sm", "cutlass_" shapes)
        at = m.start()
        if at in starts or text[at - 1] not in _ALNUM:
            owner = bisect.bisect_right(first, at) - 1
            if owner not in named:  # a name's leftmost hit is the one it says
                named.add(owner)
                say(at, (int(m.group(1)), int(m.group(2))))
    return said


def _is_tensile_name(name: str) -> bool:
    return name.startswith("Cijk_")


def _launched_via_hip(trace: RankTrace) -> bool:
    kernels = trace.gpu_kind(GpuKind.KERNEL)
    tensile = trace.gpu_named(_is_tensile_name, "precision.tensile")
    if tensile.any() and tensile[np.flatnonzero(kernels)[:5000]].any():  # among the first 5000 kernels
        return True
    return any(s.startswith("hip") for s in trace.strings[:20000])


# Dense peak throughput per precision (TFLOPS, no structured sparsity), from the vendors' datasheets:
# NVIDIA V100 SXM2, T4, A100 SXM4, A10, L4, H100 SXM5 and B200 product briefs; AMD Instinct MI100,
# MI250X and MI300X data sheets. NVIDIA "fp32" is the CUDA-core rate that SIMT sgemm kernels run at;
# AMD "fp32" is the FP32 matrix-core rate rocBLAS/hipBLASLt sgemm use. A precision the device has
# no fast units for is absent. One part stands for its architecture: ratios between precisions,
# which is all the estimate uses, hold across the parts of one architecture.
_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "sm_70": {"fp32": 15.7, "fp16": 125.0},  # V100: no bf16, no tf32
    "sm_75": {"fp32": 8.1, "fp16": 65.0},  # T4
    "sm_80": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},  # A100
    "sm_86": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},  # A10
    "sm_89": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},  # L4
    "sm_90": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # H100 SXM
    "sm_100": {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0},  # B200
    "cdna1": {"fp32": 46.1, "bf16": 92.3, "fp16": 184.6},  # MI100
    "cdna2": {"fp32": 95.7, "bf16": 383.0, "fp16": 383.0},  # MI250X
    "cdna3": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},  # MI300X
}
# Pinned host↔device copy rate over the x16 PCIe link each architecture's parts ship with, about 80%
# of the link's raw rate per direction (PCIe 3.0: 15.75, 4.0: 31.5, 5.0: 63 GB/s, PCI-SIG).
_HOST_LINK_GBPS: dict[str, float] = {
    "sm_70": 12.0, "sm_75": 12.0, "sm_80": 24.0, "sm_86": 24.0, "sm_89": 24.0, "sm_90": 48.0,
    "sm_100": 48.0, "cdna1": 12.0, "cdna2": 24.0, "cdna3": 48.0,
}  # fmt: skip
_DTYPE_KEY = {"bfloat16": "bf16", "float16": "fp16"}


def _arch_key(caps: DeviceCaps | None, table: dict[str, Any]) -> str | None:
    """The table row for the device: its arch, else the newest row of its major version at or
    below it (``sm_87`` reads ``sm_86``; an ``sm_80+`` floor reads ``sm_80``)."""
    if caps is None:
        return None
    arch = caps.arch.rstrip("+")
    if arch in table:
        return arch
    m = re.fullmatch(r"sm_(\d+?)(\d)", arch)
    if not m:
        return None
    major, minor = m.group(1), int(m.group(2))
    rows = [k for k in table if k.startswith(f"sm_{major}") and len(k) == len(arch) and int(k[-1]) <= minor]
    return max(rows, default=None)


def peak_ratio(caps: DeviceCaps | None, source: str, target: str) -> float | None:
    """How many times the device's dense peak in ``target`` ("bf16", "fp16", "tf32", or an autocast
    dtype) exceeds its peak in ``source`` ("fp32", "tf32"); None when either is unknown."""
    key = _arch_key(caps, _PEAK_TFLOPS)
    if key is None:
        return None
    row = _PEAK_TFLOPS[key]
    src, dst = row.get(source), row.get(_DTYPE_KEY.get(target, target))
    return dst / src if src and dst else None


def host_link_gbps(caps: DeviceCaps | None) -> float | None:
    """A reference pinned copy rate for the device's host link (GB/s); None when unknown."""
    key = _arch_key(caps, _HOST_LINK_GBPS)
    return _HOST_LINK_GBPS[key] if key else None
