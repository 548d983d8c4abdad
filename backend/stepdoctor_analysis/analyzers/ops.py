"""Top operators and kernels, and the anti-patterns of PyTorch's pattern matcher
(anchors §5) that an exported trace still shows.

TorchTidy needs a live profiler object; here each pattern is re-derived from names and time
containment: single-tensor optimizer updates (→ ``foreach=True``), ``zero_grad`` running
``aten::zero_`` (→ ``set_to_none=True``), FP32 SIMT GEMMs on sm_80+ (→ TF32/bf16), ``aten::select``
in a loop (→ vectorize), many small host→device copies (→ batch or create on device).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.arrays import median_of
from ..model.steps import launching_call
from ..model.trace import GpuKind, HostKind, RankTrace, Step
from . import timeline as tl
from .precision import MatmulPrecision, is_layout_transform, matmul_precisions, trace_caps
from .transfers import small_htod_copies

# Host ops that do arithmetic heavy enough to be worth running (the "compute" of a CPU trace).
COMPUTE_OP_RE = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|mv|addmv|dot|einsum|_?convolution|conv\w*|"
    r"mkldnn_\w+|cudnn_\w+|_scaled_dot_product\w*|scaled_dot_product\w*|lstm|gru|rnn_\w+|_fused\w*|"
    r"_flash_attention\w*|_efficient_attention\w*|native_batch_norm|native_layer_norm|_fft\w*|cdist)$"
)
# Host ops whose work is only allocating, filling or moving memory (no arithmetic).
MEMORY_OP_RE = re.compile(
    r"^aten::(empty|empty_like|empty_strided|new_empty\w*|zeros|zeros_like|new_zeros|ones|ones_like|"
    r"new_ones|full|full_like|new_full|fill_|zero_|clone|copy_|contiguous|_to_copy|to|cat|stack|"
    r"resize_|repeat|index_select|pad|constant_pad_nd|_reshape_copy|tile)$"
)
_FOREACH_RE = re.compile(r"^aten::_foreach_|^aten::_fused_(adam|adamw|sgd|adagrad)")
_SINGLE_UPDATE_RE = re.compile(
    r"^aten::(add_|mul_|addcdiv_|addcmul_|lerp_|sqrt|div_|sub_|maximum|add|mul|div)$"
)
# Compiled at import, not on the first analysis (the timed path).
_OPT_STEP_RE = re.compile("^" + re.escape("Optimizer.step#"))
_OPT_ZERO_RE = re.compile("^" + re.escape("Optimizer.zero_grad#"))
_ZERO_RE = re.compile(r"^aten::zero_$")
_SELECT_RE = re.compile(r"^aten::(select|index|slice)$")


@dataclass(frozen=True)
class NamedTime:
    name: str
    count: int
    total_ns: int


@dataclass(frozen=True)
class AntiPattern:
    id: str  # rules.py keys on this
    removable_ns_per_step: float
    evidence: dict[str, object]

    @property
    def metric(self) -> float:
        """What the rule compares with its threshold: a count from the evidence, or 1.0 (present).

        Detectors measure any occurrence; the rule in ``rules.RULES`` holds how many are too many.
        """
        key = _METRIC_KEYS.get(self.id)
        return float(self.evidence[key]) if key else 1.0  # type: ignore[arg-type]


# Anti-pattern id -> the evidence entry its rule's threshold applies to.
_METRIC_KEYS = {
    "single_tensor_optimizer": "elementwise_ops_per_step",
    "select_loop": "select_calls_per_step",
    "small_htod_copies": "small_htod_per_step",
}


@dataclass(frozen=True)
class OpStats:
    top_kernels: list[NamedTime] = field(default_factory=list)
    top_ops: list[NamedTime] = field(default_factory=list)  # host cpu_ops by inclusive time
    ops_per_step: float = 0.0
    median_op_ns: float = 0.0
    kernels_per_step: float = 0.0
    median_kernel_ns: float = 0.0
    patterns: list[AntiPattern] = field(default_factory=list)
    # Matmul-class (GEMM/conv/attention) kernel time per step by precision, read from kernel names.
    matmul_ns_by_precision: dict[str, float] = field(default_factory=dict)
    # The part of it in kernels too short for precision to matter (``precision.LATENCY_BOUND_NS``).
    matmul_short_ns_by_precision: dict[str, float] = field(default_factory=dict)
    # With record_shapes: that time by kernel name and by the launching op's input dtype, and where
    # they disagree (the op dtype is used); empty without op dtypes (``precision``).
    matmul_precision_evidence: dict[str, Any] = field(default_factory=dict)
    kernel_ns_per_step: float = 0.0  # all kernels, summed (not a union)
    layout_transform_ns_per_step: float = 0.0  # NCHW<->NHWC transform kernels, summed


def analyze_ops(trace: RankTrace, steps: list[Step], minimums: Mapping[str, float]) -> OpStats:
    """Op and kernel statistics, and the anti-patterns whose metric reaches ``minimums[pattern id]``.

    The minimums are the thresholds of the rules that read the patterns (``rules.pattern_minimums``):
    a pattern is listed in the report exactly when its rule can fire.
    """
    if not steps:
        return OpStats()
    n = len(steps)
    h, g = trace.host, trace.gpu
    in_steps = tl.host_in_steps(trace, steps)
    ops = trace.host_kind(HostKind.CPU_OP) & in_steps
    kernels = (
        trace.gpu_kind(GpuKind.KERNEL) & tl.gpu_in_steps(trace, steps) if len(g) else np.zeros(0, np.bool_)
    )
    precision = matmul_precisions(trace, kernels, n)
    layout = trace.gpu_named(is_layout_transform, "ops.layout_transform")
    stats = {
        "top_kernels": ranked(trace, steps, "kernels", 10),
        "top_ops": ranked(trace, steps, "ops", 10),
        "ops_per_step": int(np.count_nonzero(ops)) / n,
        "median_op_ns": median_of(h.dur[ops]) if ops.any() else 0.0,
        "kernels_per_step": int(np.count_nonzero(kernels)) / n,
        "median_kernel_ns": median_of(g.dur[kernels]) if kernels.any() else 0.0,
        "matmul_ns_by_precision": {k: v / n for k, v in precision.ns_by_precision.items()},
        "matmul_short_ns_by_precision": {k: v / n for k, v in precision.short_ns_by_precision.items()},
        "kernel_ns_per_step": float(g.dur[kernels].sum()) / n if len(g) else 0.0,
        "layout_transform_ns_per_step": float(g.dur[kernels & layout].sum()) / n,
        "matmul_precision_evidence": precision.evidence,
    }
    patterns = [
        p
        for p in (
            _single_tensor_optimizer(trace, in_steps, n),
            _zero_grad_fill(trace, in_steps, n),
            _fp32_gemm(trace, kernels, precision, n),
            _select_loop(trace, ops, n),
            _small_htod(trace, steps),
        )
        if p is not None and p.metric >= minimums.get(p.id, 0.0)
    ]
    return OpStats(**stats, patterns=patterns)  # type: ignore[arg-type]


def median_dur_by_name(trace: RankTrace, mask: np.ndarray) -> np.ndarray:
    """Median duration of the selected host events per interned name (0 for absent names).

    Classifying ops by their name's typical duration, not each instance's, keeps an op that the
    OS preempted once from turning overhead into "compute" on a loaded machine.
    """
    h = trace.host
    out = np.zeros(len(trace.strings), dtype=np.int64)
    idx = mask.nonzero()[0]
    if idx.size == 0:
        return out
    order = idx[np.lexsort((h.dur[idx], h.name[idx]))]
    names = h.name[order]
    bounds = np.diff(names).nonzero()[0] + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [order.size]])
    mids = h.dur[order][(starts + ends - 1) // 2]
    out[names[starts]] = mids
    return out


def ranked(trace: RankTrace, steps: list[Step], which: str, k: int) -> list[NamedTime]:
    """The ``k`` names with the most total time among the steps' CPU ops (``which="ops"``) or
    kernels (``"kernels"``). Ranked once per trace: the op statistics read the first 10, the
    dashboard's tables (``tables``) the first 50."""

    def evaluate() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if which == "ops":
            mask = trace.host_kind(HostKind.CPU_OP) & tl.host_in_steps(trace, steps)
            return tl.rank_by_time(trace.host.name[mask], trace.host.dur[mask])
        if not len(trace.gpu):
            return tl.rank_by_time(np.zeros(0, np.int32), np.zeros(0, np.int64))
        mask = trace.gpu_kind(GpuKind.KERNEL) & tl.gpu_in_steps(trace, steps)
        return tl.rank_by_time(trace.gpu.name[mask], trace.gpu.dur[mask])

    ids, counts, sums = trace.memo(("ops.ranked", which, tuple(steps)), evaluate)
    return _named_times(trace, ids[:k], counts[:k], sums[:k])


def _named_times(trace: RankTrace, ids: np.ndarray, counts: np.ndarray, sums: np.ndarray) -> list[NamedTime]:
    return [
        NamedTime(trace.strings[i], c, int(t))
        for i, c, t in zip(ids.tolist(), counts.tolist(), sums.tolist(), strict=True)
    ]


def _top(trace: RankTrace, names: np.ndarray, durs: np.ndarray, k: int = 10) -> list[NamedTime]:
    ids, counts, sums = tl.rank_by_time(names, durs)
    return _named_times(trace, ids[:k], counts[:k], sums[:k])


def _inside(trace: RankTrace, outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """Which ``inner`` host events lie inside some ``outer`` host event (by time)."""
    o = tl.host_union(trace, outer)
    idx = inner.nonzero()[0]
    out = np.zeros(inner.shape[0], dtype=np.bool_)
    out[idx] = tl.in_windows(trace.host.ts[idx], o[0], o[1])
    return out


def _span_mask(trace: RankTrace, prefix: re.Pattern[str], key: str) -> np.ndarray:
    return tl.host_name_mask(trace, prefix, key) & ~trace.host_kind(HostKind.RUNTIME)


def _single_tensor_optimizer(trace: RankTrace, in_steps: np.ndarray, n: int) -> AntiPattern | None:
    h = trace.host
    steps_mask = _span_mask(trace, _OPT_STEP_RE, "opt_step") & in_steps
    if not steps_mask.any():
        return None
    single = _inside(
        trace, steps_mask, tl.host_name_mask(trace, _SINGLE_UPDATE_RE, "single_upd", HostKind.CPU_OP)
    )
    foreach = _inside(trace, steps_mask, tl.host_name_mask(trace, _FOREACH_RE, "foreach", HostKind.CPU_OP))
    calls = int(np.count_nonzero(steps_mask))
    per_call = int(np.count_nonzero(single)) / calls
    if foreach.any() or per_call <= 0:
        return None
    # Fused optimizers (apex/DeepSpeed FusedAdam, multi_tensor_apply kernels) already update all
    # tensors at once; their remaining per-tensor ops are bookkeeping, not the update.
    span_name = trace.strings[int(h.name[steps_mask.nonzero()[0][0]])]
    if "fused" in span_name.lower() or (
        len(trace.gpu) and trace.gpu_named(lambda s: "multi_tensor_apply" in s, "multi_tensor").any()
    ):
        return None
    opt_ns = int(h.dur[steps_mask].sum()) / n
    # Upper bound: the foreach path keeps roughly one launch per op kind instead of one per tensor.
    return AntiPattern(
        "single_tensor_optimizer",
        opt_ns * 0.8,
        {
            "optimizer": optimizer_class(trace.strings[int(h.name[steps_mask.nonzero()[0][0]])]),
            "optimizer_span": trace.strings[int(h.name[steps_mask.nonzero()[0][0]])],
            "elementwise_ops_per_step": per_call,
        },
    )


def optimizer_class(span: str) -> str:
    """``Optimizer.step#SGD.step`` -> ``SGD``: the class the user constructed, for the advice to name."""
    tail = span.split("#", 1)[-1]
    return tail.rsplit(".", 1)[0] if "." in tail else tail


def _zero_grad_fill(trace: RankTrace, in_steps: np.ndarray, n: int) -> AntiPattern | None:
    h = trace.host
    spans = _span_mask(trace, _OPT_ZERO_RE, "opt_zero") & in_steps
    if not spans.any():
        return None
    zero = _inside(
        trace,
        spans,
        tl.host_name_mask(trace, _ZERO_RE, "zero_", HostKind.CPU_OP),
    )
    if not zero.any():
        return None
    ns = int(h.dur[zero].sum()) / n
    return AntiPattern("zero_grad_fill", ns, {"zero_calls_per_step": int(np.count_nonzero(zero)) / n})


def _fp32_gemm(
    trace: RankTrace, kernels: np.ndarray, precision: MatmulPrecision, n: int
) -> AntiPattern | None:
    """FP32 matmul kernels (by name) on a GPU with TF32 tensor cores (NVIDIA sm_80+)."""
    caps = trace_caps(trace)
    if caps is None or not caps.tf32 or not kernels.any():
        return None
    g = trace.gpu
    m = precision.fp32_by_name
    if not m.size:
        return None
    ns = int(g.dur[m].sum())
    total = int(g.dur[kernels].sum())
    # TF32/bf16 tensor cores run these GEMMs several times faster; half their time is a safe upper bound.
    return AntiPattern(
        "fp32_matmul",
        0.5 * ns / n,
        {
            "fp32_gemm_share_of_kernels": ns / total if total else 0.0,
            "kernels": [t.name for t in _top(trace, g.name[m], g.dur[m], 3)],
            "device_arch": caps.arch,
        },
    )


def _select_loop(trace: RankTrace, ops: np.ndarray, n: int) -> AntiPattern | None:
    h = trace.host
    sel = ops & tl.host_name_mask(trace, _SELECT_RE, "select", HostKind.CPU_OP)
    per = int(np.count_nonzero(sel)) / n
    if per <= 0:
        return None
    return AntiPattern("select_loop", int(h.dur[sel].sum()) / n, {"select_calls_per_step": per})


def _small_htod(trace: RankTrace, steps: list[Step]) -> AntiPattern | None:
    if not len(trace.gpu):
        return None
    m = small_htod_copies(trace, steps)
    per = int(np.count_nonzero(m)) / len(steps)
    if per <= 0:
        return None
    launcher = launching_call(trace)
    li = launcher[m & (launcher >= 0)]
    host_ns = int(trace.host.dur[li].sum()) / len(steps)
    return AntiPattern("small_htod_copies", host_ns, {"small_htod_per_step": per})
