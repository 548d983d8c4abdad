"""Per-chunk columns -> one ``RankTrace``: joined, on one ns clock, sorted by time, correlations repaired."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TraceError
from ..model.trace import (
    NONE,
    CopyKind,
    DeviceInfo,
    GpuEvents,
    GpuKind,
    HostEvents,
    HostKind,
    HostMem,
    MemoryEvents,
    RankTrace,
)
from .columns import TEXT_COLUMNS, renumbered
from .memory_timeline import KEY as MEMORY_TIMELINE_KEY
from .memory_timeline import read as read_memory_timeline
from .schema import GPU, HOST, LEGACY_CATEGORIES, MEMORY, Table, to_int

if TYPE_CHECKING:
    from .columns import Builder

_MEMCPY = int(GpuKind.MEMCPY)
# Op-arg columns (``Arg.sparse``) are not in the chunks' columns: ``_Sparse`` builds them.
_SPARSE_COLUMNS = {t.name: tuple(dict.fromkeys(t.column(a) for a in t.sparse)) for t in (HOST, GPU)}
_DENSE = {
    t.name: {k: dt for k, dt in t.dtypes.items() if k not in _SPARSE_COLUMNS[t.name]} for t in (HOST, GPU)
}
_FLOW_DTYPES = {"id": np.int64, "start": np.bool_, "pid": np.int64, "tid": np.int64, "ts": np.float64}
_DIRECTIONS = (
    ("HtoD", CopyKind.HTOD),
    ("DtoH", CopyKind.DTOH),
    ("DtoD", CopyKind.DTOD),
    ("HtoH", CopyKind.HTOH),
    ("PtoP", CopyKind.PTOP),
)


def assemble(b: Builder) -> RankTrace:
    """The finished trace: every table sorted by start time, times as int64 ns from one origin."""
    if not b.host and not b.gpu and not b.mem:
        raise no_events(b.source)
    host = concat(b.host, _DENSE["host"])
    gpu = concat(b.gpu, _DENSE["gpu"])
    mem = concat(b.mem, MEMORY.dtypes)
    oom = concat(b.oom_mem, MEMORY.dtypes)
    origin = _origin(host["ts"], gpu["ts"], mem["ts"])
    host_ts, gpu_ts, mem_ts = (to_ns(a, origin) for a in (host["ts"], gpu["ts"], mem["ts"]))
    if b.flows:
        repair_correlation(b.flows, host, host_ts, gpu, gpu_ts, origin)
    strings = list(b.ids)
    renumber = _intern_values(b, strings)
    top = b.top
    dist = top.get("distributedInfo")
    dist = dist if isinstance(dist, dict) else {}
    return RankTrace(
        source=b.source,
        strings=strings,
        host=_host_events(host, host_ts, _Sparse(b.sparse["host"], renumber)),
        gpu=_gpu_events(gpu, gpu_ts, strings, _Sparse(b.sparse["gpu"], renumber)),
        memory=_memory_events(mem, mem_ts),
        devices=_devices(top.get("deviceProperties")),
        rank=_int_or_none(dist.get("rank")),
        world_size=_int_or_none(dist.get("world_size")),
        out_of_memory=b.oom,
        oom_events=_memory_events(oom, to_ns(oom["ts"], origin)) if len(oom["ts"]) else None,
        format="legacy-2021" if any(c in b.codes for c in LEGACY_CATEGORIES) else "kineto",
        metadata={
            k: v for k, v in top.items() if k not in ("deviceProperties", "distributedInfo") and _small(v)
        },
        distributed=dist,
        run_metadata=_run_metadata(top.get(RUN_METADATA_KEY)),
        memory_timeline=read_memory_timeline(top.get(MEMORY_TIMELINE_KEY), top.get("baseTimeNanoseconds")),
    )


RUN_METADATA_KEY = "stepdoctor"  # the agent's ``preset_metadata_json("stepdoctor", ...)``


def _run_metadata(value: Any) -> dict[str, Any]:
    """The agent's embedded run metadata: a JSON object (a JSON string of one from writers that
    quote it); anything else is not ours and is ignored."""
    if isinstance(value, str):
        import json  # rare: only writers that quote the object

        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def no_events(source: str) -> TraceError:
    return TraceError(f"{Path(source).name}: the trace contains no events")


def _intern_values(b: Builder, strings: list[str]) -> np.ndarray:
    """String arg values join the trace's strings after the names (name ids unchanged): value id -> string id."""
    values = [v for v in b.values if v is not None]
    renumber = np.empty(len(values), np.int32)
    for i, v in enumerate(values):
        got = b.ids.get(v)
        if got is None:
            got = len(strings)
            strings.append(v)
        renumber[i] = got
    return renumber


class _Sparse:
    """A table's op-arg values as the builder read them, (column, rows, values) per chunk and arg."""

    def __init__(self, pieces: list[tuple[str, np.ndarray, np.ndarray]], renumber: np.ndarray) -> None:
        self.pieces = pieces
        self.renumber = renumber

    def columns(self, table: Table, order: np.ndarray) -> dict[str, np.ndarray]:
        """The table's op-arg columns in time order: NONE but on the rows that have a value.

        Built in place from the few values (the rows mapped through the sort), not gathered from
        full-length columns; string values become string ids.
        """
        n = len(order)
        out = {c: np.full(n, NONE, table.dtypes[c]) for c in _SPARSE_COLUMNS[table.name]}
        if not self.pieces:
            return out
        at = np.empty_like(order)
        at[order] = np.arange(n)  # row -> its place in time order
        gathered: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for column, rows, values in self.pieces:
            gathered.setdefault(column, []).append((rows, values))
        self.pieces.clear()
        for column, got in gathered.items():
            rows = np.concatenate([r for r, _ in got])
            values = np.concatenate([v for _, v in got])
            if column in TEXT_COLUMNS[table.name]:
                values = renumbered(values, self.renumber)
            out[column][at[rows]] = values
        return out


def _host_events(cols: dict[str, np.ndarray], ts: np.ndarray, sparse: _Sparse) -> HostEvents:
    order = np.argsort(ts, kind="stable")
    return HostEvents(
        name=cols["name"][order],
        kind=cols["kind"][order],
        ts=ts[order],
        dur=_dur_ns(cols["dur"])[order],
        pid=cols["pid"][order],
        tid=cols["tid"][order],
        **_in_order(cols, HOST.arg_columns, order),
        **sparse.columns(HOST, order),
    )


def _gpu_events(
    cols: dict[str, np.ndarray], ts: np.ndarray, strings: list[str], sparse: _Sparse
) -> GpuEvents:
    order = np.argsort(ts, kind="stable")
    copy_table, mem_table = _copy_tables(strings)
    name = cols["name"][order]
    kind = cols["kind"][order]
    is_copy = kind == _MEMCPY
    return GpuEvents(
        name=name,
        kind=kind,
        ts=ts[order],
        dur=_dur_ns(cols["dur"])[order],
        copy_kind=np.where(is_copy, copy_table[name], np.int8(CopyKind.NONE)),
        host_mem=np.where(is_copy, mem_table[name], np.int8(HostMem.NONE)),
        **_in_order(cols, GPU.arg_columns, order),
        **sparse.columns(GPU, order),
    )


def _memory_events(cols: dict[str, np.ndarray], ts: np.ndarray) -> MemoryEvents:
    order = np.argsort(ts, kind="stable")
    return MemoryEvents(ts=ts[order], **_in_order(cols, MEMORY.arg_columns, order))


def _dur_ns(dur_us: np.ndarray) -> np.ndarray:
    return np.maximum(np.rint(dur_us * 1000.0), 0).astype(np.int64)


def _int_or_none(v: Any) -> int | None:
    n = to_int(v)
    return n if n != NONE else None


def _in_order(cols: dict[str, np.ndarray], names: tuple[str, ...], order: np.ndarray) -> dict[str, Any]:
    """The named columns (a table's arg columns, generated from ``schema.ARGS``) it has, in time order."""
    return {c: cols[c][order] for c in names if c in cols}


def repair_correlation(
    flows: list[dict[str, np.ndarray]],
    host: dict[str, np.ndarray],
    host_ts: np.ndarray,
    gpu: dict[str, np.ndarray],
    gpu_ts: np.ndarray,
    origin: int,
) -> None:
    """Old traces link launches to GPU ops only by flow events: turn flow ids into correlations.

    A flow start binds to the host slice on its thread beginning at its timestamp, a flow end to
    the GPU slice on its (pid, tid) beginning at its timestamp (Chrome's ``bp: e`` binding).
    """
    need_h = np.flatnonzero(
        (host["correlation"] == NONE) & np.isin(host["kind"], (HostKind.RUNTIME, HostKind.DRIVER))
    )
    need_g = np.flatnonzero(gpu["correlation"] == NONE)
    if need_h.size == 0 and need_g.size == 0:
        return
    f = concat(flows, _FLOW_DTYPES)
    f_ts = to_ns(f["ts"], origin)
    keys = zip(
        f["pid"].tolist(),
        f["tid"].tolist(),
        f_ts.tolist(),
        f["id"].tolist(),
        f["start"].tolist(),
        strict=True,
    )
    starts: dict[tuple[int, int, int], int] = {}
    ends: dict[tuple[int, int, int], int] = {}
    for pid, tid, ts, cid, is_start in keys:
        (starts if is_start else ends)[(pid, tid, ts)] = cid
    for i in need_h:
        c = starts.get((int(host["pid"][i]), int(host["tid"][i]), int(host_ts[i])))
        if c is not None:
            host["correlation"][i] = c
    for i in need_g:
        c = ends.get((int(gpu["pid"][i]), int(gpu["tid"][i]), int(gpu_ts[i])))
        if c is not None:
            gpu["correlation"][i] = c


def concat(parts: list[dict[str, np.ndarray]], dtypes: dict[str, Any]) -> dict[str, np.ndarray]:
    """One table's chunks joined (the list is emptied to free them early); empty columns when none.

    A column a chunk leaves out reads as NONE there.
    """
    if not parts:
        return {k: np.empty(0, dt) for k, dt in dtypes.items()}
    sizes = [len(next(iter(p.values()))) for p in parts]
    out: dict[str, np.ndarray] = {}
    for k, dt in dtypes.items():
        cols = [p.get(k) for p in parts]
        if len(cols) == 1 and cols[0] is not None:
            out[k] = cols[0]
        elif all(c is not None for c in cols):
            out[k] = np.concatenate(cols)  # type: ignore[arg-type]
        elif all(c is None for c in cols):
            out[k] = np.full(sum(sizes), NONE, dt)
        else:
            out[k] = np.concatenate(
                [np.full(n, NONE, dt) if c is None else c for c, n in zip(cols, sizes, strict=True)]
            )
    parts.clear()
    return out


def _origin(*arrays: np.ndarray) -> int:
    """Whole-µs origin: subtracting it first keeps the µs→ns conversion exact for epoch times."""
    lows = [float(a.min()) for a in arrays if a.size]
    return int(np.floor(min(lows))) if lows else 0


def to_ns(ts_us: np.ndarray, origin: int) -> np.ndarray:
    # ts - origin is exact in float64 (both near each other), so rounding happens on small values.
    return origin * 1000 + np.rint((ts_us - origin) * 1000.0).astype(np.int64)


def _copy_tables(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-string memcpy direction and host memory kind, parsed once per distinct name."""
    n = len(strings)
    kinds = np.full(max(n, 1), CopyKind.NONE, np.int8)
    mems = np.full(max(n, 1), HostMem.NONE, np.int8)
    for i, s in enumerate(strings):
        if "Memcpy" in s or "memcpy" in s:
            kinds[i], mems[i] = _copy_kind(s)
    return kinds, mems


def _copy_kind(name: str) -> tuple[int, int]:
    kind = next((k for tag, k in _DIRECTIONS if tag in name), CopyKind.UNKNOWN)
    if kind in (CopyKind.HTOD, CopyKind.DTOH, CopyKind.HTOH):
        mem = (
            HostMem.PAGEABLE
            if "Pageable" in name
            else HostMem.PINNED
            if "Pinned" in name
            else HostMem.UNKNOWN
        )
    else:
        mem = HostMem.NONE
    return int(kind), int(mem)


def _devices(props: Any) -> list[DeviceInfo]:
    if not isinstance(props, list):
        return []
    out = []
    for i, d in enumerate(props):
        if not isinstance(d, dict):
            continue
        dev_id = to_int(d.get("id"))
        out.append(
            DeviceInfo(
                id=dev_id if dev_id != NONE else i,
                name=str(d.get("name", "")),
                total_memory=max(to_int(d.get("totalGlobalMem")), 0),
                num_sms=max(to_int(d.get("numSms")), 0),
                compute_major=max(to_int(d.get("computeMajor")), 0),
                compute_minor=max(to_int(d.get("computeMinor")), 0),
            )
        )
    return out


def _small(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool)) or v is None
