"""What a Kineto event means to us: the argument table, the msgspec event types and the categories.

The ``args`` we read are declared once, in ``ARGS``. Everything else that names an argument is
generated from it: the typed ``Args`` Struct the fast decoder fills (in C), the untyped ``LaxArgs``
used for producers that write odd values, the coercion of those values, and the numeric records and
column dtypes of each table (``HOST``, ``GPU``, ``MEMORY``). Adding a kernel argument is one row here
(plus its field in ``model.GpuEvents``, the contract analyzers read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgspec
import numpy as np

from ..model.kinds import NONE, GpuKind, HostKind

NAN = float("nan")
ABSENT = -(2**62)  # stream/device arg missing (distinct from a real -1, e.g. "Event Sync" on stream -1)
NO_TEXT = msgspec.Raw(b"")  # a "first_float" arg the event lacks
# Times are read in µs and kept as int64 ns. A start within ±2**62 ns (epoch times up to the year
# 2116) and a duration within 2**61 ns keep every start, end and difference inside int64; beyond
# them a trace is refused (``columns.Builder._check``), not wrapped around.
MAX_TS_US = 2.0**62 / 1e3
MAX_DUR_US = 2.0**61 / 1e3
_INT64 = range(-(2**63), 2**63)


def to_int(v: Any) -> int:
    """Best-effort integer for an untyped arg value; NONE when absent or unusable."""
    if type(v) is int:
        return v if v in _INT64 else NONE
    if v is None or isinstance(v, bool):
        return NONE
    if isinstance(v, float):
        return int(v) if v == v and abs(v) < 2**63 else NONE
    if isinstance(v, str):
        try:
            n = int(v, 0) if v[:2].lower() == "0x" else int(float(v))
        except (ValueError, OverflowError):
            return NONE
        return n if n in _INT64 else NONE
    return NONE


def to_float(v: Any) -> float:
    """Best-effort float for an untyped value; NaN when absent or unusable."""
    if type(v) is float or type(v) is int:
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return NAN
    return NAN


# --------------------------------------------------------------------------- the argument table


@dataclass(frozen=True)
class Arg:
    """One ``args`` entry we read, and the column(s) it fills.

    ``dtype`` is the column's dtype in the model. ``absent`` marks a loose argument: the fast
    decoder accepts any JSON value for it (AMD writes some streams as hex strings), a missing one
    reads as ``ABSENT`` and the column takes the event's own ``pid`` or ``tid`` instead (see
    ``columns.FALLBACKS``). Two args naming the same column are two spellings of it: the first wins,
    the next fills where it is missing.
    """

    attr: str  # attribute on the decoded Struct (unique)
    key: str  # the JSON key inside the event's "args"
    dtype: str  # numpy dtype of the model column
    host: str | None = None  # the column it fills in each table, if any
    gpu: str | None = None
    memory: str | None = None
    absent: str | None = None  # loose: "pid" or "tid", the event field a missing value falls back to
    # A string arg, interned: "value" (the string) or "first_float": a list of dtypes, of which the
    # first floating one is kept; the typed decoder leaves that list as its JSON text (``msgspec.Raw``)
    # and the columns step reads each distinct text once (see ``first_floating``).
    text: str | None = None
    # Read only on some events (op args): those whose name matches ``on_names`` (tested once per
    # distinct name), else those of host kind ``on_kind``. Everywhere else the column is NONE.
    on_names: str | None = None
    on_kind: int | None = None  # a plain int: numpy compares against an IntEnum member far slower

    @property
    def sparse(self) -> bool:
        """Read apart from the per-event record, on the events that can carry it only."""
        return self.text is not None or self.on_names is not None or self.on_kind is not None

    @property
    def is_float(self) -> bool:
        return np.dtype(self.dtype).kind == "f"

    @property
    def record_dtype(self) -> np.dtype[Any]:
        """What the decoded value is read into: loose args hold the 64-bit ``ABSENT`` marker first."""
        return np.dtype(np.int64) if self.absent else np.dtype(self.dtype)

    @property
    def default(self) -> Any:
        return ABSENT if self.absent else NAN if self.is_float else NONE

    def coerce(self, v: Any) -> Any:
        """An untyped value (lax path) in the form the typed decoder would have produced."""
        if self.text == "value":
            return v if isinstance(v, str) else None
        if self.text == "first_float":
            if isinstance(v, msgspec.Raw):
                return v
            return msgspec.Raw(msgspec.json.encode(v)) if isinstance(v, list) else NO_TEXT
        if self.absent and v is None:
            return ABSENT
        return to_float(v) if self.is_float else to_int(v)


# Host ops that carry a collective's args (``record_param_comms``; c10d and backend ranges in some builds).
COMM_OPS = r"^(?:record_param_comms|c10d::|_?c10d_functional::|(?:nccl|rccl|gloo|xccl):)"
# Host ops doing matmul-class work: the ops whose input dtype is the precision of the kernels they
# launch (``precision.kernel_op_precision``), and so the only ops whose ``Input type`` is read.
MATMUL_OPS = (
    r"^aten::(?:mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_addmm_activation|_scaled_mm|"
    r"(?:cudnn_|miopen_|mkldnn_|_)?conv\w*|(?:_|cudnn_|miopen_)?convolution\w*|"
    r"_?scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*)$"
)

# The rows are in the order Kineto writes the keys: msgspec looks each key up from the field after the
# last one matched, so a key where it is expected costs one comparison (decoding 1.5% faster).
ARGS: tuple[Arg, ...] = (
    #   attribute             JSON key                       dtype  column(s) it fills
    Arg("external_id",        "External id",                 "i8",  host="external_id"),
    Arg("external_id_legacy", "external id",                 "i8",  host="external_id"),
    # Autograd's sequence number on a matmul-class op: written only when autograd recorded the op, so
    # none on a forward run under no_grad/inference_mode (``workload`` reads grad mode from it).
    Arg("grad_seq",           "Sequence number",             "i8",  host="grad_seq", on_names=MATMUL_OPS),
    Arg("device",             "device",                      "i4",  gpu="device", absent="pid"),
    Arg("stream",             "stream",                      "i8",  gpu="stream", absent="tid"),
    Arg("correlation",        "correlation",                 "i8",  host="correlation", gpu="correlation"),
    Arg("nbytes",             "bytes",                       "i8",  gpu="bytes"),
    Arg("blocks_per_sm",      "blocks per SM",               "f4",  gpu="blocks_per_sm"),
    Arg("occupancy",          "est. achieved occupancy %",   "f4",  gpu="occupancy"),
    Arg("device_type",        "Device Type",                 "i1",  memory="device_type"),
    Arg("device_id",          "Device Id",                   "i4",  memory="device_id"),
    Arg("addr",               "Addr",                        "i8",  memory="addr"),
    Arg("mem_bytes",          "Bytes",                       "i8",  memory="bytes"),
    Arg("total_allocated",    "Total Allocated",             "i8",  memory="total_allocated"),
    Arg("total_reserved",     "Total Reserved",              "i8",  memory="total_reserved"),
    # record_param_comms (#11): what the collective is, whatever its kernels are called. Every field
    # here costs every event's decoding a little (msgspec matches each args key against them), so
    # only what the analysis reads: not "Group size" or "Process Group Name".
    Arg("collective",         "Collective name",             "i4",  host="collective", text="value", on_names=COMM_OPS),
    Arg("msg_dtype",          "dtype",                       "i4",  host="msg_dtype", text="value", on_names=COMM_OPS),
    Arg("in_nelems",          "In msg nelems",               "i8",  host="in_nelems", on_names=COMM_OPS),
    Arg("out_nelems",         "Out msg nelems",              "i8",  host="out_nelems", on_names=COMM_OPS),
    # record_shapes (#9): the dtype of a matmul-class op's first floating input; the list is not kept.
    Arg("input_types",        "Input type",                  "i4",  host="input_dtype", text="first_float", on_names=MATMUL_OPS),
)  # fmt: skip

# Floating dtypes as ``Input type`` spells them ("float", "c10::BFloat16", "c10::Half", "float8_e4m3fn").
_FLOATING = ("float", "half", "double", "bfloat16")


class _Floating(dict[str, bool]):
    """dtype spelling -> whether it is floating, worked out once per spelling (a trace has a few)."""

    def __missing__(self, t: str) -> bool:
        low = t.lower()
        v = "complex" not in low and any(f in low for f in _FLOATING)
        if len(self) < 4096 and len(t) <= 256:  # real spellings are short and few (bounded memory)
            self[t] = v
        return v


_IS_FLOATING = _Floating()


def first_floating(types: tuple[str, ...] | None) -> str | None:
    """The first floating dtype among an op's input types (None when none is floating)."""
    return next(filter(_IS_FLOATING.__getitem__, types or ()), None)


_STRINGS = msgspec.json.Decoder(tuple[str, ...] | None)


def listed(text: bytes) -> tuple[str, ...] | None:
    """A "first_float" arg's JSON text -> its string items; None when it is absent or not a list."""
    if not text:
        return None
    try:
        return _STRINGS.decode(text)  # the usual list of strings, decoded in C
    except msgspec.ValidationError:
        v = msgspec.json.decode(text)
        return tuple(x for x in v if isinstance(x, str)) if isinstance(v, list) else None


def args_struct(args: tuple[Arg, ...], *, lax: bool = False, called: str = "Args") -> type[msgspec.Struct]:
    """The Struct an event's ``args`` decode into: typed (fast, converted in C) or ``lax`` (any value)."""
    fields = []
    for a in args:
        kind: Any = Any if lax or a.absent else float if a.is_float else int
        default = None if lax or a.text else a.default
        if a.text and not lax:
            kind, default = (str | None, None) if a.text == "value" else (msgspec.Raw, NO_TEXT)
        name = a.key if a.key != a.attr else None
        fields.append((a.attr, kind, msgspec.field(default=default, name=name)))
    return msgspec.defstruct("LaxArgs" if lax else called, fields, gc=False, module=__name__)


# Event fields every table's record starts with, then the columns filled around the args.
_EVENT_FIELDS = {"host": ("ts", "dur"), "gpu": ("ts", "dur"), "memory": ("ts",)}
_OWN_COLUMNS = {
    "host": {"name": "i4", "kind": "i1", "ts": "f8", "dur": "f8", "pid": "i8", "tid": "i8"},
    "gpu": {"name": "i4", "kind": "i1", "ts": "f8", "dur": "f8", "pid": "i8", "tid": "i8"},
    "memory": {"ts": "f8"},
}


@dataclass(frozen=True)
class Table:
    """How one model table is read: the args that fill it, one numeric record per event, its columns."""

    name: str
    args: tuple[Arg, ...]  # its numeric args, in ARGS order
    sparse: tuple[Arg, ...]  # args read apart, on the events that carry them (``Arg.sparse``)
    fields: tuple[str, ...]  # attribute paths read per event ("ts", "args.correlation", ...)
    record: np.dtype[Any]  # one typed row per event, named "ts", "dur" and each arg's attr
    record_ids: np.dtype[Any]  # the same, then pid and tid
    dtypes: dict[str, np.dtype[Any]]  # the finished columns (event fields and arg columns)
    arg_columns: tuple[str, ...]  # the columns args fill, each once

    def column(self, arg: Arg) -> str:
        col: str = getattr(arg, self.name)
        return col


def _check_unique(attrs: list[str], event_fields: list[str]) -> None:
    """Records name their fields by attribute, next to the event's own: a clash would read the wrong value."""
    if len(set(attrs) | set(event_fields)) != len(attrs) + len(event_fields):
        raise ValueError("argument attributes must be unique and differ from the event fields")


def table(name: str, args: tuple[Arg, ...] = ARGS) -> Table:
    """Generate a table's record and column dtypes from the argument table."""
    every = tuple(a for a in args if getattr(a, name) is not None)
    mine = tuple(a for a in every if not a.sparse)
    events = _EVENT_FIELDS[name]
    _check_unique([a.attr for a in args], [*events, "pid", "tid"])
    record = np.dtype([(f, "f8") for f in events] + [(a.attr, a.record_dtype) for a in mine])
    dtypes = {k: np.dtype(v) for k, v in _OWN_COLUMNS[name].items()}
    for a in every:
        dtypes.setdefault(getattr(a, name), np.dtype(a.dtype))
    return Table(
        name=name,
        args=mine,
        sparse=tuple(a for a in every if a.sparse),
        fields=events + tuple(f"args.{a.attr}" for a in mine),
        record=record,
        record_ids=np.dtype([*record.descr, ("pid", "i8"), ("tid", "i8")]),
        dtypes=dtypes,
        arg_columns=tuple(dict.fromkeys(getattr(a, name) for a in every)),
    )


HOST, GPU, MEMORY = table("host"), table("gpu"), table("memory")
Args = args_struct(ARGS)  # every arg: what the lax path (``tighten``) fills
LaxArgs = args_struct(ARGS, lax=True)
# Each event type decodes only the args its tables read: every field costs the decoding of every
# args key of every event (msgspec tests each key against the fields); the six memory fields on
# complete events cost ~7% of decoding control.json.gz.
CompleteArgs = args_struct(tuple(a for a in ARGS if a.host or a.gpu), called="CompleteArgs")
InstantArgs = args_struct(tuple(a for a in ARGS if a.memory), called="InstantArgs")


# --------------------------------------------------------------------------- event types

# Every event but a complete one has, where a complete event has its category (``cat``), a negative
# code for its type (the ``cat`` of a flow is its ``flow_cat``): one lookup per event, categories and
# these codes in one dict (``columns._Codes``), classifies a chunk; an int never equals a category.
INSTANT, FLOW_START, FLOW_END, FLOW_STEP, SKIPPED_CODE, FLOW_SKIPPED = -1, -2, -3, -4, -5, -6


class Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    """A duration event (``ph: X``): every host op, launch call and GPU op.

    Fields in Kineto's key order, as ``ARGS`` (decoding control.json.gz 1.5% faster).
    """

    cat: str = ""
    name: str | None = None
    pid: int | str = NONE
    tid: int | str = NONE
    ts: float = NAN
    dur: float = NAN
    args: CompleteArgs = msgspec.field(default_factory=CompleteArgs)  # type: ignore[valid-type]


class Instant(msgspec.Struct, tag_field="ph", tag="i", gc=False):
    """An instant event: ``[memory]`` and ``[OutOfMemory]`` are the ones we keep."""

    cat: ClassVar[int] = INSTANT
    name: str | None = None
    ts: float = NAN
    args: InstantArgs = msgspec.field(default_factory=InstantArgs)  # type: ignore[valid-type]


class InstantLegacy(Instant, tag="I"):
    pass


class FlowStart(msgspec.Struct, tag_field="ph", tag="s", gc=False):
    """Flow endpoints: only needed to recover correlation ids in traces that lack them."""

    cat: ClassVar[int] = FLOW_START
    flow_cat: str = msgspec.field(default="", name="cat")
    id: int | str | None = None
    ts: float = NAN
    pid: int | str = NONE
    tid: int | str = NONE


class FlowEnd(FlowStart, tag="f"):
    cat: ClassVar[int] = FLOW_END


class FlowStep(FlowStart, tag="t"):
    cat: ClassVar[int] = FLOW_STEP


# Every other Chrome trace phase decodes into an empty Struct: parsed, never materialised.
SKIPPED = tuple(
    msgspec.defstruct(f"_Skip{i}", [], tag_field="ph", tag=ph, gc=False, namespace={"cat": SKIPPED_CODE})
    for i, ph in enumerate(
        ("M", "B", "E", "C", "b", "n", "e", "P", "N", "O", "D", "V", "v", "R", "c", "(", ")")
    )
)
Event = Any  # one of the tagged Structs above
TYPE_CODES = (INSTANT, FLOW_START, FLOW_END, FLOW_STEP, SKIPPED_CODE, FLOW_SKIPPED)
_EventUnion = Union[(Complete, Instant, InstantLegacy, FlowStart, FlowEnd, FlowStep, *SKIPPED)]  # type: ignore[valid-type]
# Flow events are a third of a modern trace but only matter when correlation ids are missing (old
# traces): the lean decoder skips them (``FLOW_SKIPPED``); a chunk that turns out to need them is decoded
# again in full, and so is the rest of that trace.
_FLOWS_SKIPPED = tuple(
    msgspec.defstruct(f"_SkipFlow{i}", [], tag_field="ph", tag=ph, gc=False, namespace={"cat": FLOW_SKIPPED})
    for i, ph in enumerate("sft")
)
_LeanUnion = Union[(Complete, Instant, InstantLegacy, *_FLOWS_SKIPPED, *SKIPPED)]  # type: ignore[valid-type]


class LaxEvent(msgspec.Struct, gc=False):
    """Any event, untyped: for producers that write odd values (null, strings, lists)."""

    ph: Any = ""
    cat: Any = ""
    name: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    tid: Any = None
    id: Any = None
    args: Any = None


EVENTS_DECODER = msgspec.json.Decoder(list[_EventUnion])
LEAN_DECODER = msgspec.json.Decoder(list[_LeanUnion])
LAX_DECODER = msgspec.json.Decoder(list[LaxEvent], strict=False)
_FLOW_TYPES = {"s": FlowStart, "f": FlowEnd, "t": FlowStep}


def _id_or(v: Any, default: Any) -> Any:
    return v if isinstance(v, (int, str)) and not isinstance(v, bool) else default


def tighten(events: list[LaxEvent]) -> list[Event]:
    """Coerce untyped events into the typed form, value by value (slow path, rare)."""
    out: list[Event] = []
    for e in events:
        ph = e.ph if isinstance(e.ph, str) else ""
        a = e.args
        args = Args()
        if isinstance(a, dict):
            lax = msgspec.convert(a, LaxArgs, strict=False)
            for arg in ARGS:
                setattr(args, arg.attr, arg.coerce(getattr(lax, arg.attr)))
        name = None if e.name is None else str(e.name)
        ts = to_float(e.ts) if e.ts is not None else NAN
        pid, tid = _id_or(e.pid, NONE), _id_or(e.tid, NONE)
        cat = e.cat if isinstance(e.cat, str) else ""
        if ph == "X":
            dur = to_float(e.dur) if e.dur is not None else NAN
            out.append(Complete(cat=cat, name=name, ts=ts, dur=dur, pid=pid, tid=tid, args=args))
        elif ph in ("i", "I"):
            out.append(Instant(name=name, ts=ts, args=args))
        elif ph in _FLOW_TYPES:
            out.append(_FLOW_TYPES[ph](flow_cat=cat, id=_id_or(e.id, None), ts=ts, pid=pid, tid=tid))
        else:
            out.append(SKIPPED[0]())
    return out


# --------------------------------------------------------------------------- categories

# Category -> kind. Host kinds are 0..9, GPU kinds are offset by GPU_OFFSET.
GPU_OFFSET = 100
CATEGORIES: dict[str, int] = {
    "cpu_op": HostKind.CPU_OP,
    "operator": HostKind.CPU_OP,
    "python": HostKind.CPU_OP,  # legacy autograd-profiler Python ops; tb-profiler counts them as CPU ops
    "user_annotation": HostKind.USER_ANNOTATION,
    "python_function": HostKind.PYTHON_FUNCTION,
    "cuda_runtime": HostKind.RUNTIME,
    "runtime": HostKind.RUNTIME,
    "hip_runtime": HostKind.RUNTIME,
    "cuda_driver": HostKind.DRIVER,
    "overhead": HostKind.OVERHEAD,
    "kernel": GPU_OFFSET + GpuKind.KERNEL,
    "gpu_memcpy": GPU_OFFSET + GpuKind.MEMCPY,
    "memcpy": GPU_OFFSET + GpuKind.MEMCPY,
    "gpu_memset": GPU_OFFSET + GpuKind.MEMSET,
    "memset": GPU_OFFSET + GpuKind.MEMSET,
    "cuda_sync": GPU_OFFSET + GpuKind.SYNC,
    "gpu_user_annotation": GPU_OFFSET + GpuKind.ANNOTATION,
}
FLOW_CATEGORIES = frozenset({"ac2g", "async_cpu_to_gpu", "async", "launch", "async_gpu"})
LEGACY_CATEGORIES = frozenset({"Operator", "Runtime", "Kernel", "Memcpy", "Memset"})
