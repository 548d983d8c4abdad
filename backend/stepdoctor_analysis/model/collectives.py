"""Which events are collective communication, and of which type (anchors §9).

The profiler records communication in several ways, and a job may use any mix of them:
- host ops of the process-group backends: ``nccl:all_reduce``, ``gloo:all_reduce`` (record_function
  names), ``c10d::allreduce_``/``c10d::_allgather_base_``/``c10d::alltoall_base_`` (dispatcher ops),
  ``_c10d_functional::all_gather_into_tensor`` (FSDP2, tensor parallel, torch.compile) and
  ``record_param_comms``, the op that carries ``Collective name`` and the message sizes;
- GPU kernels of the collective libraries: NCCL and RCCL (``ncclKernel_*``/``ncclDevKernel_*``),
  MSCCL, NVSHMEM, expert-parallel libraries (DeepEP's ``dpsk::ep::``/``deep_ep::`` dispatch and
  combine, pplx) and the custom all-reduce kernels inference servers use instead of NCCL
  (vLLM/SGLang ``cross_device_reduce``, ``multimem`` all-reduce, symmetric-memory one/two-shot,
  FlashInfer's all-reduce fusion, AMD quick-reduce).

The type comes first from what the profiler recorded: ``record_param_comms`` carries the collective's
``Collective name`` (``allreduce``, ``_allgather_base``, ``all_to_allv``, ``send``), its element
counts and ``dtype`` (``recorded_type``, ``dtype_bytes``); a kernel launched under such an op is of
that type whatever it is called. Without it, names give the type: a kernel's own name when it says
it (``AllReduce``, ``dispatch``), else the typed host op it was launched under (an NCCL ``SendRecv``
kernel under ``nccl:all_to_all`` is an all-to-all, under ``nccl:send`` a pipeline send).
``COLLECTIVE_TYPES`` is the vocabulary.
"""

from __future__ import annotations

import functools
import re

COLLECTIVE_TYPES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "broadcast",
    "reduce",
    "barrier",
    "other",
)

# Host ops that are (or directly wrap) one collective call.
_HOST_OP_RE = re.compile(
    r"^(?:(?:nccl|gloo|mpi|ucc|xccl|hccl|rccl):\w|c10d::|_?c10d_functional::|record_param_comms$)"
)
_HOST_NOT_COLLECTIVE = re.compile(r"wait|barrier_init|work", re.IGNORECASE)

# GPU kernels of collective libraries (case-sensitive library prefixes, then lower-cased families).
_KERNEL_LIB_PREFIXES = ("nccl", "rccl", "msccl", "void nccl", "void rccl", "void msccl")
_CUSTOM_ALL_REDUCE_RE = re.compile(
    r"cross_device_reduce|multimem_?all_?(?:reduce|gather)|multimem_(?:ld_)?reduce|"
    r"(?:one|two)_shot_all_?reduce|all_?reduce_fusion|custom_?all_?reduce|quick_?reduce|lamport"
)
_EP_RE = re.compile(r"dpsk::ep::|deep_ep::|pplx::")

# Checked in order on the lower-cased name with separators removed: longer words first.
_TYPE_WORDS: tuple[tuple[str, str], ...] = (
    ("reducescatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("crossdevicereduce", "all_reduce"),
    ("quickreduce", "all_reduce"),
    ("lamport", "all_reduce"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("dispatch", "all_to_all"),  # expert-parallel token dispatch/combine are all-to-alls
    ("combine", "all_to_all"),
    ("sendrecv", "send_recv"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
)
_SEPARATORS = re.compile(r"[^a-z]")


def is_collective_op_name(name: str) -> bool:
    """A host op that issues one collective (not ``c10d::wait`` and other bookkeeping)."""
    return _HOST_OP_RE.match(name) is not None and _HOST_NOT_COLLECTIVE.search(name) is None


def is_collective_kernel_name(name: str) -> bool:
    """A GPU kernel of a collective library or an inference server's custom all-reduce.

    Prefix and substring tests, not a regex, for the libraries, and a guard on ``_CUSTOM_ALL_REDUCE_RE``: an
    unanchored alternation is tried at every position of long templated kernel names, and most
    names contain none of the words any alternative needs.
    """
    if name.startswith(_KERNEL_LIB_PREFIXES) or (
        "mscclKernel" in name
        or "nvshmem" in name
        or "dpsk::ep::" in name
        or "deep_ep::" in name
        or "pplx::" in name
    ):
        return True
    low = name.lower()
    if "reduce" not in low and "gather" not in low and "lamport" not in low:
        return False
    return _CUSTOM_ALL_REDUCE_RE.search(low) is not None


@functools.lru_cache(maxsize=1 << 14)  # per distinct name, for every trace of a model
def collective_type(name: str) -> str | None:
    """The collective type a kernel or op name states, or None when it does not say."""
    squashed = _SEPARATORS.sub("", _signature(name).lower())
    for word, kind in _TYPE_WORDS:
        if word in squashed:
            return kind
    return None


# ``Collective name`` values that are bookkeeping, not a transfer (``wait`` on a work handle, setup).
_BOOKKEEPING = re.compile(r"^(?:wait|init|abort|destroy|shutdown|comm_split|work)", re.IGNORECASE)


def recorded_type(value: str) -> str | None:
    """The type of a ``Collective name`` arg; None for bookkeeping (``wait``) that moves no data."""
    if not value or _BOOKKEEPING.match(value):
        return None
    return collective_type(value) or "other"  # gather, scatter, ...: a collective of no listed type


# Bytes per element of the ``dtype`` record_param_comms writes (c10 ScalarType names).
_DTYPE_BYTES = {
    "byte": 1, "char": 1, "bool": 1, "uint8": 1, "int8": 1, "short": 2, "int16": 2, "uint16": 2,
    "half": 2, "bfloat16": 2, "complexhalf": 4, "int": 4, "int32": 4, "uint32": 4, "float": 4,
    "long": 8, "int64": 8, "uint64": 8, "double": 8, "complexfloat": 8, "complexdouble": 16,
}  # fmt: skip


def dtype_bytes(dtype: str) -> int | None:
    """Bytes per element of a ScalarType name (``Float``, ``BFloat16``, ``Float8_e4m3fn``); None if unknown."""
    low = dtype.lower().removeprefix("c10::")
    if low.startswith("float8"):
        return 1
    return _DTYPE_BYTES.get(low)


@functools.lru_cache(maxsize=1 << 14)
def library(name: str) -> str:
    """Which family a collective kernel or op belongs to, for evidence (``nccl``, ``deepep``, ...)."""
    low = name.lower()
    if _EP_RE.search(name):
        return "pplx" if "pplx::" in name else "deepep"
    if _CUSTOM_ALL_REDUCE_RE.search(low):
        return "custom_all_reduce"
    for lib in ("msccl", "rccl", "nccl", "nvshmem", "gloo", "mpi", "ucc"):
        if low.startswith(lib) or f"{lib}kernel" in low or low.startswith(f"void {lib}"):
            return lib
    if low.startswith(("c10d", "_c10d", "record_param_comms")):
        return "c10d"
    return "other"


def _signature(name: str) -> str:
    """The name without its argument list: ``dispatch<...>(int*, ...)`` says nothing in its arguments."""
    cut = name.find("(")
    head = name if cut < 0 else name[:cut]
    if "<" not in head and ">" not in head:  # nothing to drop: skip the character walk
        return head
    # Template arguments can mention unrelated words (a ``Combine`` functor); keep the outer name.
    depth, out = 0, []
    for ch in head:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)
