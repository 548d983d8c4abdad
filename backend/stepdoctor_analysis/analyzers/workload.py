"""Is this trace training or inference, and for inference, decoding or prefilling?

The advice depends on it: ``zero_grad(set_to_none=True)``, a foreach optimizer or DDP bucket sizes
mean nothing to a model server, and CUDA graphs, a static KV cache, batching or
``torch.inference_mode()`` are what an inference loop needs.

Evidence, strongest first:
- run metadata ``workload`` ("training"/"inference"), e.g. ``stepdoctor.profile(..., tags={"workload":
  "inference"})``;
- training: autograd backward ops (``autograd::engine::evaluate_function``, ``*Backward0``),
  backward kernels, optimizer steps (``Optimizer.step#``, fused/foreach updates, and their kernels:
  ``FusedAdamMathFunctor``, a foreach ``p.add_(g, alpha=-lr)``), DDP's reducer;
- inference: none of those, where the host recorded the forward's ops; a grad-disabling context,
  serving frameworks (vLLM, SGLang, TGI, TensorRT-LLM) and their ``DECODE``/``prefill`` annotations.
- unknown: none of those, and the host recorded no ops for most of the work (the kernels are replayed
  from CUDA graphs, or the trace holds no ``cpu_op`` at all): no backward op is then no evidence, so
  neither training-only nor inference-only advice is given.
Grad mode is read, not guessed: autograd gives each op it records a sequence number, which Kineto
writes as ``"Sequence number"``; forward matmul-class ops without one ran under no_grad/inference_mode
(``grad_enabled`` False), with one ran with grad enabled (True). Without such ops, the Python frames
of ``no_grad``/``inference_mode`` (``torch/autograd/grad_mode.py``, recorded ``with_stack``) tell.
Decode vs prefill: annotations and attention kernels that name the phase (``DECODE bs=32``,
``BatchPrefill``, ``paged_attention``, ``splitkv``), else the shape of the work: a decode step runs
many tiny kernels per token (``DECODE_MIN_KERNELS`` kernels with a median under ``DECODE_MAX_MEDIAN_NS``).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..model.arrays import median_of
from ..model.trace import NONE, GpuKind, HostKind, RankTrace, Step
from ..parsing.schema import MATMUL_OPS

DECODE_MIN_KERNELS = 200  # kernels per step (per token) in a decode step of an LLM
DECODE_MAX_MEDIAN_NS = 10_000  # ... each shorter than this: weights streamed at batch 1-64
# Kernels replayed from CUDA graphs, as a share of all kernels, past which the host's ops do not
# describe the work: its lack of backward ops says nothing about the replayed step.
REPLAYED_BLIND_SHARE = 0.5
KINDS = ("training", "inference")  # what a workload can be; "unknown" is either

_TRAINING_RE = re.compile(
    r"autograd::engine::evaluate_function|Backward\d*\b|Backward\d*$|^Optimizer\.(?:step|zero_grad)#|"
    r"^optimizer\.(?:step|zero_grad)|_fused_(?:adam|adamw|sgd)|_foreach_(?:add|mul|addcmul|lerp)_|"
    r"DistributedDataParallel\.(?:forward|_pre_forward)|torch/autograd/__init__\.py\(\d+\): backward|"
    r"torch/_tensor\.py\(\d+\): backward|Reducer::|lightning.*training_step"
)
_BACKWARD_KERNEL_RE = re.compile(r"backward|_bwd_|bwd_kernel|dgrad|wgrad", re.IGNORECASE)
# Optimizer updates as kernels (all a CUDA-graph replay shows of them): fused optimizers (PyTorch's
# ``FusedAdamMathFunctor``/``FusedSgdMathFunctor``, apex's ``AdamFunctor``, ``multi_tensor_adam``), AMP's
# unscale, and the foreach updates only optimizers make: ``p.add_(g, alpha=-lr)`` (SGD), ``addcmul``/
# ``addcdiv`` and ``lerp`` (Adam). Not foreach copies, zeroing or scalar multiplies: servers use those.
_OPTIMIZER_KERNEL_RE = re.compile(
    r"(Fused(?:Adam|Sgd|SGD|Adagrad)\w*Functor|\b(?:Adam|SGD|LAMBStage\d?|Novograd)Functor|"
    r"multi_tensor_(?:adam|sgd|lamb|novograd|adagrad)|fused_(?:adam|adamw|sgd|adagrad)\w*|"
    r"non_finite_check_and_unscale|amp_update_scale)|"
    r"multi_tensor_apply_kernel<.*?(BinaryOpListAlphaFunctor|PointwiseOp\w*Functor|LerpFunctor)"
)
_GRAD_OFF_RE = re.compile(r"torch/autograd/grad_mode\.py\(\d+\): __enter__|inference_mode")
_SERVER_RE = re.compile(
    r"(?:^|/)(?:vllm|sglang|text_generation_server|tensorrt_llm|lmdeploy|llama_cpp)/|"
    r"cuda_graph_runner|model_runner|execute_model|forward_batch|generate\b|\.generate\(",
)
_DECODE_RE = re.compile(
    r"\bDECODE\b|decode_attention|BatchDecode|paged_attention|splitkv|_is_uniform_decode|"
    r"forward_decode|decode_step|fmha.*decode|flash_decoding",
)
_PREFILL_RE = re.compile(r"[Pp]refill|PREFILL|\bEXTEND\b|forward_extend|context_attention")
_GRAD_SYNC_RE = re.compile(r"^(?:nccl|gloo):all_reduce$|^c10d::allreduce_$")
_GRAPH_RE = re.compile(r"^(?:cuda|hip)GraphLaunch|^cuGraphLaunch")
_MATMUL_OP_RE = re.compile(MATMUL_OPS)  # the ops the parser reads "Sequence number" on
# torch.compile's region run as an autograd Function: AOTAutograd builds one only with grad enabled
# (under no_grad it takes its inference path), and runs the region's own ops without autograd.
_COMPILED_GRAD_RE = re.compile(r"^CompiledFunction$")
# Lower-case words one of which every match of the pattern contains: a substring test skips the
# regex on the thousands of Python-frame names a with_stack trace holds.
# Matrix-vector product kernels (cuBLAS ``gemv2T_kernel``, ``gemvx``; hipBLASLt/rocBLAS ``gemv``):
# what a batch-1 decode step's matmuls are, and an eager forward's GEMMs are not.
_GEMV_RE = re.compile(r"gemv", re.IGNORECASE)

_GATES = {
    _TRAINING_RE: (
        "backward",
        "optimizer",
        "_fused_",
        "_foreach_",
        "distributeddataparallel",
        "reducer::",
        "training_step",
        "autograd::engine",
    ),
    _BACKWARD_KERNEL_RE: ("backward", "bwd", "dgrad", "wgrad"),
    _OPTIMIZER_KERNEL_RE: (
        "adam",
        "sgd",
        "adagrad",
        "lambstage",
        "novograd",
        "unscale",
        "amp_update_scale",
        "listalphafunctor",
        "pointwiseop",
        "lerpfunctor",
    ),
    _GRAD_OFF_RE: ("grad_mode", "inference_mode"),
    _SERVER_RE: (
        "vllm",
        "sglang",
        "text_generation",
        "tensorrt_llm",
        "lmdeploy",
        "llama_cpp",
        "cuda_graph_runner",
        "model_runner",
        "execute_model",
        "forward_batch",
        "generate",
    ),
    _DECODE_RE: ("decode", "splitkv", "paged_attention", "flash_decoding"),
    _PREFILL_RE: ("prefill", "extend", "context_attention"),
    _GRAD_SYNC_RE: ("all_reduce", "allreduce"),
    _GEMV_RE: ("gemv",),
    _GRAPH_RE: ("graphlaunch",),
    _COMPILED_GRAD_RE: ("compiledfunction",),
}


class _Names:
    """Distinct names, searched through ``_GATES``: ``str.find`` of each gate word over all the
    lower-cased names joined in one string, the regex only on the lines the word is on."""

    def __init__(self, names: list[str] | Callable[[], list[str]]) -> None:
        self._names = names

    @functools.cached_property  # listed on the first search
    def names(self) -> list[str]:
        return self._names if isinstance(self._names, list) else self._names()

    @functools.cached_property  # built on the first search: a training trace never searches kernels
    def blob(self) -> str:
        return "\n".join(self.names).lower()

    @functools.cached_property
    def starts(self) -> list[int]:
        return (
            list(itertools.accumulate((len(n) + 1 for n in self.names[:-1]), initial=0)) if self.names else []
        )

    def __add__(self, other: _Names) -> _Names:
        return _Names(self.names + other.names)

    def matches(self, rx: re.Pattern[str], limit: int = 3) -> list[str]:
        found: set[int] = set()
        starts, blob, names = self.starts, self.blob, self.names
        # Once ``limit`` lines are found, a later line cannot be among the first ``limit``.
        stop = len(blob)
        for word in _GATES[rx]:
            pos = blob.find(word, 0, stop)
            while pos != -1:
                line = bisect.bisect_right(starts, pos) - 1
                if line not in found and rx.search(names[line]):
                    found.add(line)
                    if len(found) >= limit:
                        last = sorted(found)[limit - 1]
                        stop = starts[last + 1] if last + 1 < len(starts) else len(blob)
                end = starts[line + 1] if line + 1 < len(starts) else len(blob)
                pos = blob.find(word, end, stop)
        return [names[i] for i in sorted(found)[:limit]]

    def any(self, rx: re.Pattern[str]) -> bool:
        return bool(self.matches(rx, 1))


@dataclass(frozen=True)
class Workload:
    kind: str  # "training" | "inference" | "unknown" (nothing in the trace tells)
    phase: str | None = None  # inference: "decode", "prefill", "prefill+decode"; else None
    source: str = "trace"  # "metadata" or "trace"
    evidence: list[str] = field(default_factory=list)
    grad_disabled: bool = False  # the forward ran under no_grad/inference_mode (``grad_enabled``, frames)
    with_stack: bool = False  # Python frames recorded: grad_disabled=False then means "not used"
    server: bool = False  # a serving framework (vLLM, SGLang, ...): grad mode was set at start-up
    cuda_graphs: bool = False  # the trace already replays CUDA graphs
    kernels_per_step: float = 0.0
    median_kernel_us: float = 0.0
    # Whether autograd recorded the forward's matmul-class ops (their "Sequence number"): True, False
    # (none of them: no_grad/inference_mode), None (no such op in the trace); ``grad_evidence`` says so.
    grad_enabled: bool | None = None
    grad_evidence: str = ""

    @property
    def inference(self) -> bool:
        return self.kind == "inference"


def fits(kind: str, workloads: tuple[str, ...]) -> bool:
    """Whether advice for ``workloads`` fits a trace of ``kind``: an unknown workload (either kind)
    gets only advice that fits both."""
    return set(KINDS) <= set(workloads) if kind == "unknown" else kind in workloads


def detect_workload(trace: RankTrace, steps: list[Step], metadata: dict[str, Any] | None = None) -> Workload:
    """Training, inference or unknown, from metadata, then from the ops the trace holds (module docstring)."""
    host_names = _names(trace, lambda: trace.host.name)
    kernel_mask = trace.gpu_kind(GpuKind.KERNEL) if len(trace.gpu) else np.zeros(0, np.bool_)
    kernel_names = _names(trace, lambda: trace.gpu.name[kernel_mask]) if len(trace.gpu) else _Names([])
    per_step, median_us = _kernel_shape(trace, kernel_mask, steps)
    launches = trace.host_named(_GRAPH_RE.search, "workload.graphs", HostKind.RUNTIME, HostKind.DRIVER)
    graphs = bool(launches.any())
    grad_enabled, grad_evidence = _grad_mode(trace, host_names)
    # Recorded ops decide; the frames of a grad-disabling context only where no op tells.
    grad_off = grad_enabled is False or (grad_enabled is None and host_names.any(_GRAD_OFF_RE))
    base = Workload(
        "inference",
        grad_disabled=grad_off,
        with_stack=bool(trace.host_kind(HostKind.PYTHON_FUNCTION).any()),
        cuda_graphs=graphs,
        kernels_per_step=per_step,
        median_kernel_us=median_us,
        grad_enabled=grad_enabled,
        grad_evidence=grad_evidence,
    )
    declared = _declared(metadata)
    if declared in KINDS:
        phase = (
            _named_phase(host_names, kernel_names) or _shape_phase(per_step, median_us, kernel_names)
            if declared == "inference"
            else None
        )
        return replace(
            base,
            kind=declared,
            phase=phase,
            source="metadata",
            evidence=[f"run metadata workload={declared}"],
        )
    training = [f"training op: {n[:80]}" for n in host_names.matches(_TRAINING_RE)]
    training = training or [f"training kernel: {n[:80]}" for n in kernel_names.matches(_BACKWARD_KERNEL_RE)]
    training = training or [_optimizer_evidence(n) for n in kernel_names.matches(_OPTIMIZER_KERNEL_RE)]
    if training:
        return replace(base, kind="training", evidence=training)
    evidence = ["no backward or optimizer ops"]
    if grad_off:
        evidence.append(grad_evidence or "a no_grad/inference_mode context is entered")
    server = next(iter(host_names.matches(_SERVER_RE, 1)), None)
    if server:
        evidence.append(f"serving code: {server[:80]}")
    named = _named_phase(host_names, kernel_names)
    phase = named or _shape_phase(per_step, median_us, kernel_names)
    sync_grads = next(iter(host_names.matches(_GRAD_SYNC_RE, 1)), None)
    if sync_grads and not (grad_off or server or phase or graphs):
        # A process-group all-reduce and nothing that says "serving": a capture window of a
        # data-parallel job that missed the backward pass, more likely than an inference job.
        return replace(base, kind="training", evidence=[f"gradient all-reduce: {sync_grads}"])
    blind = _host_blind(trace, kernel_mask, launches)
    if blind and not (grad_off or server or named):  # the shape alone does not say inference
        return replace(base, kind="unknown", evidence=[blind, "no backward or optimizer kernels"])
    return replace(base, phase=phase, evidence=evidence, server=server is not None)


def _grad_mode(trace: RankTrace, host_names: _Names) -> tuple[bool | None, str]:
    """Was grad enabled in the forward: do its matmul-class ops carry autograd's sequence number?

    PyTorch stamps an op with the next autograd sequence number when grad mode is on (no number
    under no_grad in recent releases, older ones numbered those too; none under inference_mode,
    which bypasses autograd); Kineto writes it as ``"Sequence number"``. Backward ops carry none either, but a backward means training anyway.
    A torch.compile region's ops run without autograd whatever the mode: its ``CompiledFunction``
    says grad was on. Only Kineto traces: older formats did not write the number.
    """
    if trace.format != "kineto":
        return None, ""
    # The same pattern and key as ``precision.kernel_op_precision``'s: one mask per trace.
    ops = trace.host_named(_MATMUL_OP_RE.match, "precision.matmul_ops", HostKind.CPU_OP)
    n = int(np.count_nonzero(ops))
    recorded = int(np.count_nonzero(trace.host.grad_seq[ops] != NONE)) if n else 0
    if recorded:
        return True, f"autograd recorded {recorded} of {n} matmul-class ops (they carry a 'Sequence number')"
    if host_names.any(_COMPILED_GRAD_RE):
        return True, "torch.compile regions run as autograd functions (CompiledFunction)"
    if n:
        return (
            False,
            f"no matmul-class op of {n} carries an autograd 'Sequence number' (no_grad/inference_mode)",
        )
    return None, ""


def _host_blind(trace: RankTrace, kernels: np.ndarray, launches: np.ndarray) -> str | None:
    """Why the host's ops cannot show a backward pass, if they cannot: the trace holds no op at all,
    or most kernels are replayed from CUDA graphs (a replay launches the captured forward, backward
    and optimizer step in one call)."""
    if launches.any() and kernels.any():
        graph_corr = trace.host.correlation[launches]
        share = float(np.isin(trace.gpu.correlation[kernels], graph_corr[graph_corr != NONE]).mean())
        if share >= REPLAYED_BLIND_SHARE:
            return f"{100 * share:.0f}% of kernels replayed from CUDA graphs: the host shows no ops for them"
    if not trace.host_kind(HostKind.CPU_OP).any():
        return "no host ops recorded: the ops' absence tells nothing"
    return None


def _optimizer_evidence(name: str) -> str:
    m = _OPTIMIZER_KERNEL_RE.search(name)
    what = (m.group(1) or m.group(2)) if m else name
    return f"optimizer kernel: {what[:80]}"


def _declared(metadata: dict[str, Any] | None) -> str:
    """``workload`` from the run metadata or its tags (``stepdoctor.profile(tags={"workload": ...})``)."""
    md = metadata or {}
    tags = md.get("tags")
    value = md.get("workload") or (tags.get("workload") if isinstance(tags, dict) else None)
    return str(value or "").lower()


def _names(trace: RankTrace, ids: Callable[[], np.ndarray]) -> _Names:
    """Distinct names among ``ids()`` (a bincount: ~30× faster than ``np.unique`` on 200k events),
    listed when first searched."""

    def listed() -> list[str]:
        present = ids()
        if not present.size:
            return []
        strings = trace.strings
        return [strings[i] for i in np.bincount(present, minlength=len(strings)).nonzero()[0].tolist()]

    return _Names(listed)


def _kernel_shape(trace: RankTrace, kernels: np.ndarray, steps: list[Step]) -> tuple[float, float]:
    if not kernels.size or not kernels.any() or not steps:
        return 0.0, 0.0
    durs = trace.gpu.dur[kernels]
    return round(int(kernels.sum()) / len(steps), 1), round(median_of(durs) / 1e3, 3)


def _named_phase(host: _Names, kernels: _Names) -> str | None:
    """The inference phase the names state (annotations, attention kernels)."""
    names = host + kernels
    decode = names.any(_DECODE_RE)
    prefill = names.any(_PREFILL_RE)
    if decode and prefill:
        return "prefill+decode"
    if decode:
        return "decode"
    if prefill:
        return "prefill"
    return None


def _shape_phase(per_step: float, median_us: float, kernels: _Names) -> str | None:
    """Decode by the shape of the work: many tiny kernels per token, among them matrix-vector
    products (``gemv``: one token's activations times the weights). Many tiny kernels alone are any
    eager forward at small batch, or a Python loop over tensor elements: the phase words (decode,
    prefill) are kept for traces that show the phase."""
    tiny = per_step >= DECODE_MIN_KERNELS and 0 < median_us * 1e3 < DECODE_MAX_MEDIAN_NS
    return "decode" if tiny and kernels.any(_GEMV_RE) else None
