"""The report contract: the JSON a report is, defined once as msgspec types.

``Report.to_dict`` (what ``stepdoctor analyze --format json`` prints and the server stores) decodes
into ``ReportDoc`` strictly (``decode``), and ``schema()`` is the JSON Schema published at
docs/report.schema.json, shown by ``stepdoctor analyze --schema`` and inlined into the server's
OpenAPI. Readers (the run aggregate, the dashboard) can ``decode`` a stored report and read
attributes instead of guarding every ``.get``.

Sections whose inner layout belongs to one analyzer and is still growing (``metrics.*``,
``evidence``, ``tables``, ``timeline``, ``ranks``) are typed as objects with named keys at their top
level and free-form inside; the verdict, recommendations, breakdown, steps, limiter, iterations,
workload and device are typed field by field. ``schema_version`` (``SCHEMA_VERSION``) rises when a
typed field is removed, renamed or changes type; adding a field is not a breaking change.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .. import BOTTLENECK_KINDS, SCHEMA_VERSION
from ..analyzers.comm import CommStats
from ..analyzers.ops import OpStats
from ..analyzers.sync import Trigger
from ..analyzers.transfers import TransferStats

BASES = ("measured", "estimate", "single-pass")
# Plain ``str`` for the engine (rule kinds are strings), an enum in the schema, checked on decode
# and on construction (``_check``).
Kind = Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(BOTTLENECK_KINDS)})]
Basis = Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(BASES)})]


def _check(kind: str, basis: str) -> None:
    if kind not in BOTTLENECK_KINDS:
        raise ValueError(f"kind must be one of {', '.join(BOTTLENECK_KINDS)}, not {kind!r}")
    if basis not in BASES:
        raise ValueError(f"basis must be one of {', '.join(BASES)}, not {basis!r}")


class _Doc(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Unknown fields are refused, so the contract test fails when the report grows a field the
    contract does not declare yet."""


class Device(_Doc):
    type: str
    name: str | None
    memory_gb: float | None
    compute_capability: str | None
    vendor: str
    arch: str
    precisions: list[str]


class Bottleneck(_Doc):
    """The limiter (``primary``) or a runner-up (``secondary``); ``diagnose`` builds these."""

    kind: Kind
    share: float  # fraction of step wall time charged to this kind
    us_per_step: float
    confidence: float
    evidence: dict[str, Any] = msgspec.field(default_factory=dict)
    # Speedup if this kind's removable time went away, and whether that time is a measured wait or
    # an estimate (compute); ``note`` says in one sentence why the next optimization is not about it.
    gain: float = 1.0
    basis: Basis = "measured"
    note: str = ""

    def __post_init__(self) -> None:
        _check(self.kind, self.basis)


class Recommendation(_Doc):
    """A code change with its expected gain (``recommendations``) or a finding (``findings``);
    ``diagnose`` renders these from a rule's hit."""

    id: str  # a rule id (docs/rules.md)
    title: str
    kind: Kind
    change: str
    why: str
    expected_speedup: float
    removable_us_per_step: float
    confidence: float
    caveats: list[str]
    evidence: dict[str, Any]
    basis: Basis = "measured"  # a "measured" wait, an "estimate", "single-pass" (no per-step gain)
    expected_speedup_range: tuple[float, float] | None = None  # [low, high] for estimates

    def __post_init__(self) -> None:
        _check(self.kind, self.basis)


class Breakdown(_Doc):
    """TensorBoard's categories, µs per step, summing to the step.

    ``dataloader`` counts ``enumerate(DataLoader)#…__next__`` whether recorded as ``cpu_op`` or as
    ``user_annotation`` (torch 2.x). torch-tb-profiler 0.4.3 drops user annotations other than
    ProfilerStep and gloo/nccl ones, so its overview shows DataLoader 0 for such traces and counts
    that time as Other (``report.TENSORBOARD_DATALOADER_NOTE``)."""

    kernel: float
    memcpy: float
    memset: float
    communication: float
    runtime: float
    dataloader: float
    cpu_exec: float
    other: float


class StepRow(_Doc):
    """One profiled step (``pipeline`` builds these)."""

    number: int
    start_us: float
    duration_us: float
    kinds: dict[str, float]  # kind (or "other") -> µs


class LimiterEntry(_Doc):
    share: float
    # What the kind's best change surely removes (``diagnose.sure_share``): a measured wait all of it,
    # an estimated kernel speedup ESTIMATE_WEIGHT of it, an estimated shortening of a wait its low end.
    removable_share: float
    basis: Basis
    score: float  # what the verdict ranked (equal to removable_share since engine 0.3)


class Warmup(_Doc):
    count: int
    us: float
    ratio_to_median: float | None


class Iterations(_Doc):
    source: str  # markers|dataloader|optimizer|module|kernel-sequence|none
    anchor: str
    count: int
    warmup: Warmup


class Workload(_Doc):
    """``workload.Workload``: "unknown" when nothing in the trace tells (a CUDA-graph replay, no host
    ops), and then the report gives neither training-only nor inference-only advice."""

    kind: Literal["training", "inference", "unknown"]
    phase: str | None
    source: str
    evidence: list[str]
    grad_disabled: bool
    with_stack: bool
    cuda_graphs: bool
    server: bool
    kernels_per_step: float
    median_kernel_us: float
    grad_enabled: bool | None  # autograd recorded the forward's matmul-class ops; None: no such op
    grad_evidence: str


class GpuSection(_Doc):
    """TensorBoard's GPU metrics over the steps (``gpu_metrics``); GPU traces only."""

    utilization: float | None  # fraction of the window with a kernel running, 0..1
    sm_efficiency: float | None  # 0..1; None when no kernel reports blocks per SM
    occupancy: float | None  # percent 0..100; None when no kernel reports occupancy
    devices: list[dict[str, Any]]


class StepTimes(_Doc):
    """Step wall time over the analysed steps, µs."""

    mean: float
    p50: float
    max: float
    min: float


class SyncSection(_Doc):
    """Host↔device synchronisations per step (``sync.SyncStats``; its triggers as they are)."""

    calls_per_step: float
    blocked_us_per_step: float
    by_api: dict[str, Any]
    triggers: list[Trigger]


class InputSection(_Doc):
    """DataLoader waits (``inputs.InputStats`` without its intervals)."""

    loader_ns_per_step: float
    loader_per_step: list[int]
    calls_per_step: float
    single_process: bool
    multi_process: bool
    iterators: list[str]
    max_wait_ns: int


class MemoryCategories(_Doc):
    """Allocated memory on one device at one instant (its peak, or an out-of-memory event), by what
    holds it (``memory_use.CATEGORIES``; bytes that sum to ``allocated``, shares that sum to 1)."""

    device: str
    at_us: float  # from the first step's start, like ``series``
    allocated: int
    reserved: int
    bytes: dict[str, int]
    shares: dict[str, float]
    dominant: str | None
    basis: str  # how the categories were inferred
    largest: list[dict[str, Any]]  # the largest live blocks: bytes, category, allocating op


class MemoryLeak(_Doc):
    """Allocated memory at the end of each step on one device (``memory_use.LeakStats``)."""

    device: str
    step_end_bytes: list[int]
    growth_per_step: float  # bytes
    steady: bool
    survivors: list[dict[str, Any]]  # allocations that outlive their step: op, module, phase, bytes_per_step


class MemoryFragmentation(_Doc):
    """Reserved against allocated on one CUDA device (``memory_use.FragmentationStats``)."""

    device: str
    peak_allocated: int
    peak_reserved: int
    reserved_at_peak: int
    gap_share: float
    gap_time_share: float
    capacity: int


class OutOfMemoryEvent(_Doc):
    """An ``[OutOfMemory]`` event: the request that failed and what was allocated, by category, then."""

    device: str
    at_us: float
    requested: int
    allocated: int
    reserved: int
    by_category: MemoryCategories | None
    rule: str  # the near-capacity card, whose change follows what dominated then
    change: str


class MemorySection(_Doc):
    """``metrics.memory``: the allocator (``memory.MemoryStats``), what holds the memory at each device's
    peak, step-end growth, fragmentation and out-of-memory forensics (``memory_use``). ``devices``,
    ``allocator_evidence`` and ``series`` are free-form inside."""

    devices: list[dict[str, Any]] = []
    steady_alloc_calls_per_step: float = 0.0
    alloc_calls_per_step: float = 0.0
    alloc_call_us_per_step: float = 0.0
    allocator: str | None = None
    allocator_evidence: dict[str, Any] = {}
    out_of_memory: int = 0
    series: dict[str, Any] = {}
    by_category: list[MemoryCategories] = []
    leak: list[MemoryLeak] = []
    fragmentation: list[MemoryFragmentation] = []
    out_of_memory_at: list[OutOfMemoryEvent] = []


class Metrics(_Doc, omit_defaults=True):
    """Measurements by section. ``transfers``, ``communication`` and ``ops`` are their analyzers'
    own dataclasses (``transfers.TransferStats``, ``comm.CommStats``, ``ops.OpStats``); ``memory`` is
    ``MemorySection``; ``hta`` (HTA's tables) is an object with free-form values for now."""

    step_time_us: StepTimes
    kinds_us: dict[str, float]  # kind -> µs per step
    shares: dict[str, float]  # kind (and "other") -> fraction of the step
    transfers: TransferStats
    sync: SyncSection
    memory: MemorySection
    communication: CommStats
    input: InputSection
    ops: OpStats
    gpu: GpuSection | None = None
    hta: dict[str, Any] | None = None


class TableRow(_Doc, omit_defaults=True):
    """One operator or kernel of the top tables (``tables.build_tables``)."""

    name: str
    calls: int
    total_us: float
    mean_us: float
    share: float  # of the steps' op (or kernel) time
    tensor_core: bool | None = None  # kernels only


class Tables(_Doc):
    ops: list[TableRow]
    kernels: list[TableRow]
    tensor_core_share: float | None


class ReportDoc(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One diagnosis report (times in µs, shares as fractions of the step)."""

    schema_version: int
    engine_version: str
    source: str
    rank: int | None
    world_size: int | None
    format: str
    device: Device | None
    step_time_us: float
    primary: Bottleneck
    secondary: list[Bottleneck]
    breakdown: Breakdown
    recommendations: list[Recommendation]  # best first; [0] is the next optimization
    findings: list[Recommendation]
    steps: list[StepRow]
    metrics: Metrics
    warnings: list[str]
    workload: Workload | None
    iterations: Iterations | None = None
    limiter: dict[str, LimiterEntry] | None = None
    ranks: dict[str, Any] | None = None  # a directory's per-rank verdict (``ranks.RankVerdict``)
    tables: Tables | None = None  # operator/kernel tables
    timeline: dict[str, Any] | None = None  # drawn representative steps (``step_timeline``)
    deep: dict[str, Any] | None = None  # ``stepdoctor analyze --deep/--diff`` only: HTA's result
    # ``stepdoctor analyze RUN_DIR`` with the agent's step series: ``run_timeline.RunTimeline``
    run_timeline: dict[str, Any] | None = None


def decode(report: dict[str, Any] | bytes | str) -> ReportDoc:
    """A report (its dict or JSON text) as ``ReportDoc``; ``msgspec.ValidationError`` if it is not one."""
    if isinstance(report, dict):
        return msgspec.convert(report, ReportDoc)
    return msgspec.json.decode(report, type=ReportDoc)


def to_dict(doc: ReportDoc) -> dict[str, Any]:
    """The JSON form again (the same keys and values ``Report.to_dict`` gives)."""
    out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(doc))  # tuples as lists, like JSON
    return out


def _any_value(tp: Any) -> dict[str, Any]:
    """Analyzer dataclasses annotate free-form evidence values as ``object``: any JSON value."""
    if tp is object:
        return {"description": "any JSON value"}
    raise NotImplementedError(tp)


def schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a report, with ``schema_version`` pinned to this engine's."""
    out: dict[str, Any] = msgspec.json.schema(ReportDoc, schema_hook=_any_value)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "stepdoctor report"
    out["$defs"]["ReportDoc"]["properties"]["schema_version"]["const"] = SCHEMA_VERSION
    return out


def schema_text() -> str:
    """docs/report.schema.json: ``schema()`` as stable, diff-friendly JSON."""
    import json

    return json.dumps(schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def inline_schema() -> dict[str, Any]:
    """``schema()`` with every ``$ref`` replaced by its definition: a self-contained schema an
    OpenAPI document can embed at any path (its ``$defs`` would not resolve there)."""
    full = schema()
    defs = full.pop("$defs")

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    inlined: dict[str, Any] = resolve(full)
    inlined.pop("$schema", None)
    return inlined
