"""Decoded chunks -> numpy columns, with C-level ``map``/``attrgetter`` loops and no per-event Python.

Each chunk's events are classified in one lookup each (a complete event's category gives host or GPU
and its kind, any other event's ``cat`` is its type code), and each table's numeric fields read in
one structured ``fromiter`` whose record ``schema`` generates from the argument table. ``Builder`` keeps the per-chunk columns; ``assembly`` joins them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import islice, repeat
from operator import attrgetter, is_not, itemgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..errors import TraceError
from ..model.kinds import NONE, GpuKind, HostKind
from .schema import (
    ABSENT,
    ARGS,
    CATEGORIES,
    FLOW_CATEGORIES,
    FLOW_SKIPPED,
    FLOW_START,
    FLOW_STEP,
    GPU,
    GPU_OFFSET,
    HOST,
    INSTANT,
    MAX_DUR_US,
    MAX_TS_US,
    MEMORY,
    NAN,
    SKIPPED_CODE,
    TYPE_CODES,
    Arg,
    Event,
    Table,
    first_floating,
    listed,
    to_float,
    to_int,
)

# The op-arg name patterns, compiled at import: the matmul-op one takes ~1 ms to compile, which
# the first trace a process parses would otherwise pay.
_NAME_PATTERNS = {a.on_names: re.compile(a.on_names) for a in ARGS if a.on_names is not None}

# numpy compares against plain ints several times faster than against IntEnum members.
_RUNTIME, _DRIVER = int(HostKind.RUNTIME), int(HostKind.DRIVER)
_MEMSET = int(GpuKind.MEMSET)

_CAT = attrgetter("cat")  # a complete event's category, any other event's type code (``schema``)
_FLOW_CAT = attrgetter("flow_cat")
_NAME = attrgetter("name")
_TS = attrgetter("ts")
_ID = attrgetter("id")
_PID = attrgetter("pid")
_TID = attrgetter("tid")
_MEM_FIELDS = attrgetter(*MEMORY.fields)

# What a loose arg's column holds where the event lacks it (``Arg.absent``), from the event's pid/tid:
# a GPU op's pid is its device when it is a device index; Kineto draws each stream as a thread.
FALLBACKS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "pid": lambda pid, tid: np.where(pid >= 0, pid, NONE),
    "tid": lambda pid, tid: tid,
}


def arg_columns(record: Any, table: Table, pid: np.ndarray, tid: np.ndarray) -> dict[str, np.ndarray]:
    """The table's arg columns from its decoded record, missing values resolved, in model dtypes."""
    out: dict[str, np.ndarray] = {}
    for arg in table.args:
        values = record[arg.attr]
        if arg.absent:
            values = np.where(values == ABSENT, FALLBACKS[arg.absent](pid, tid), values)
        col = table.column(arg)
        first = out.get(col)
        if first is None:
            out[col] = values
        elif (first == NONE).any():  # a second spelling fills where the first is missing
            out[col] = np.where(first == NONE, values, first)
    return {k: v.astype(table.dtypes[k], copy=False) for k, v in out.items()}


# The op-arg columns holding interned strings: renumbered wherever two sets of ids are joined.
TEXT_COLUMNS = {t.name: frozenset(t.column(a) for a in t.sparse if a.text) for t in (HOST, GPU)}


def renumbered(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Ids through ``table`` (old id -> new), NONE (missing) kept; in ``ids``' dtype."""
    return np.where(ids != NONE, table[np.maximum(ids, 0)], NONE).astype(ids.dtype, copy=False)


# Bounded memory (#12): names are kept once each, so their total is what a trace could inflate.
# A longer name is cut (real kernel names stay under ~3,000 characters) and is not kept under its
# full spelling; past the total budget the trace is refused rather than held.
MAX_NAME_CHARS = 8192
MAX_NAMES_CHARS = 256 << 20


class _Interner(dict[str, int]):
    """Name -> dense id; ``__getitem__`` stays in C for names already seen.

    The budget is checked once per chunk (``account``), not per new name: the per-name check more
    than doubled the cost of interning a new name.
    """

    chars = 0
    counted = 0  # entries whose characters are in ``chars``
    reserved = 0  # entries that hold no id (``_Values`` keeps None)

    def __missing__(self, key: str) -> int:
        if key is not None and len(key) > MAX_NAME_CHARS:
            return self[key[: MAX_NAME_CHARS - 1] + "…"]
        v = self[key] = len(self) - self.reserved
        return v

    def newest(self, n: int) -> list[str]:
        """The last ``n`` keys, in insertion order (read from the end: no walk over the older ones)."""
        return list(islice(reversed(self), n))[::-1]

    def account(self) -> None:
        """Add the new names' characters to the total; refuse the trace past the budget."""
        if len(self) > self.counted:
            self.chars += sum(map(len, filter(None, self.newest(len(self) - self.counted))))
            self.counted = len(self)
            if self.chars > MAX_NAMES_CHARS:
                raise TraceError(
                    f"event names total more than {MAX_NAMES_CHARS >> 20} Mi characters; refusing the trace"
                )


# An op arg that this many of its carriers lacked, with none having it, is not looked for again:
# the profiler writes such args for a whole session (``record_shapes`` puts ``Input type`` on every
# cpu_op), so a trace without them in its first ops has none, and reading it per op cost ~5% of a parse.
ABSENT_AFTER = 4096


class _Values(_Interner):
    """String arg values -> dense ids of their own; an absent value (None) is ``NONE``.

    Kept apart from the names so the name ids stay what they were; ``assembly`` appends the values
    to the trace's strings and renumbers them.
    """

    reserved = 1

    def __init__(self) -> None:
        super().__init__()
        self[None] = NONE  # type: ignore[index]


class _FirstFloat(dict[bytes, int]):
    """An op's ``Input type`` JSON text -> the value id of its first floating dtype, worked out once
    per distinct text: ops repeat a few signatures, so most ops cost one dict lookup and no decoding.

    ``listed``: some op had the arg as a list at all: an ``Input type`` with no floating dtype
    (``["long"]``, ``[]``) still shows record_shapes is on, though its column value is NONE.
    """

    def __init__(self, values: dict[Any, int]) -> None:
        super().__init__()
        self.value_ids = values
        self.listed = False

    def __missing__(self, text: bytes) -> int:
        types = listed(text)
        self.listed = self.listed or types is not None
        v = self.value_ids[first_floating(types)]
        if len(self) < 4096 and len(text) <= 4096:  # odd signatures are not kept (bounded memory)
            self[text] = v
        return v


class _Codes(dict[str | int, int]):
    """Category of a complete event -> host kind or ``GPU_OFFSET`` + GPU kind, once per distinct category;
    the other events' type codes (negative) map to themselves."""

    def __init__(self) -> None:
        super().__init__(zip(TYPE_CODES, TYPE_CODES, strict=True))

    def __missing__(self, cat: str) -> int:
        code = CATEGORIES.get(cat)
        v = int(code if code is not None else CATEGORIES.get(cat.lower(), HostKind.OTHER))
        if len(cat) <= 256:  # real categories are short; an absurd one is not kept (bounded memory)
            self[cat] = v
        return v


MAX_OOM_ROWS = 64  # [OutOfMemory] events kept as rows per trace (the rest only counted)


def pick(events: Sequence[Event], idx: np.ndarray) -> Sequence[Event]:
    """The events at ``idx``, gathered in C."""
    if idx.size == 1:
        return [events[int(idx[0])]]
    return itemgetter(*idx.tolist())(events)


# Each table's op args (``Arg.sparse``) with the column each fills and its dtype, worked out once and
# grouped by the events that carry them (one pattern or kind): a group's carriers are found and
# gathered once per chunk, however many of its args are read.
_SparseArg = tuple[Arg, str, np.dtype[Any]]


def _sparse_groups(t: Table) -> tuple[tuple[Arg, tuple[_SparseArg, ...]], ...]:
    groups: dict[Any, list[_SparseArg]] = {}
    for a in t.sparse:
        groups.setdefault((a.on_names, a.on_kind), []).append((a, t.column(a), t.dtypes[t.column(a)]))
    return tuple((group[0][0], tuple(group)) for group in groups.values())


_SPARSE = {t.name: _sparse_groups(t) for t in (HOST, GPU)}


def _texts(raws: Sequence[msgspec.Raw]) -> list[bytes]:
    """JSON texts as bytes (hashable): one join and one split, ~2x cheaper than ``bytes()`` on each.
    Valid JSON holds no NUL byte (a string escapes it), so the split gives back each text."""
    texts = b"\0".join(raws).split(b"\0")
    return texts if len(texts) == len(raws) else list(map(bytes, raws))


def _outside(values: np.ndarray, limit: float) -> np.ndarray:
    """Where a time is missing (NaN), infinite or beyond ``limit`` (one comparison: NaN fails it)."""
    return ~(np.abs(values) <= limit)


_NO_HITS = np.zeros(0, np.bool_)
_NO_ROWS = np.zeros(0, np.intp)


class Builder:
    """Accumulates per-chunk numpy columns (``assembly.assemble`` makes the RankTrace)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ids = _Interner()
        self.values = _Values()  # string arg values (assembly renumbers them)
        self._first_float = _FirstFloat(self.values)
        # pattern -> (by name id: does the name match, does any)
        self._name_hits: dict[str, tuple[np.ndarray, bool]] = {}
        self._absent: dict[str, int] = {}  # op arg -> carriers seen without it so far (-1: found once)
        self.codes: dict[str | int, int] = _Codes()
        self.host: list[dict[str, np.ndarray]] = []
        self.gpu: list[dict[str, np.ndarray]] = []
        self.mem: list[dict[str, np.ndarray]] = []
        self.flows: list[dict[str, np.ndarray]] = []  # flow endpoints, to repair missing correlations
        self.rows = {"host": 0, "gpu": 0}  # rows in each table so far
        # Per table: the op-arg values read so far, as (column, rows in the table, values).
        self.sparse: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {"host": [], "gpu": []}
        self.oom = 0
        self.oom_mem: list[dict[str, np.ndarray]] = []  # the [OutOfMemory] instants' args (few)
        self.n_events = 0
        self.top: dict[str, Any] = {}
        self.labels: dict[Any, int] = {}  # string pid/tid -> negative id
        # Per table: its last chunk held a label pid/tid, so the next one is read the labelled way too.
        self._labelled = {"host": False, "gpu": False}
        self.flows_skipped = False  # the last chunk needs flow events its lean decoding skipped
        self._label_seen = False  # ``_ids`` met a label pid/tid in the column it just read

    def label(self, v: Any) -> int:
        """Stable negative id for a non-integer pid/tid label (``forked`` renumbers with it)."""
        if type(v) is int:
            return v
        got = self.labels.get(v)
        if got is None:
            got = self.labels[v] = -2 - len(self.labels)
        return got

    def absorb(self, events: list[Event]) -> None:
        """Fold one decoded chunk into numpy columns.

        A number too large for its column (a 30-digit pid or argument) stops the trace with the
        chunk's event range, as a TraceError: bad input, never an internal error.
        """
        n = len(events)
        if n == 0:
            return
        first = self.n_events
        self.n_events += n
        try:
            self._absorb(events, first)
        except OverflowError:
            raise self._overflow(first, n) from None

    def _overflow(self, first: int, n: int) -> TraceError:
        return TraceError(
            f"{Path(self.source).name}: a number in events #{first}-#{first + n - 1} is too large for "
            "its field (pid, tid and arguments are 64-bit or smaller integers)"
        )

    def _absorb(self, events: list[Event], first: int) -> None:
        codes = self._codes(events)
        host_before, gpu_before = len(self.host), len(self.gpu)
        on_gpu = codes >= GPU_OFFSET
        for mask, add_to, offset, table in (
            ((codes >= 0) & ~on_gpu, self.host, 0, HOST),
            (on_gpu, self.gpu, GPU_OFFSET, GPU),
        ):
            idx = mask.nonzero()[0]
            if idx.size:
                cols = self._columns(pick(events, idx), codes[idx] - offset, table)
                self.ids.account()
                self.values.account()
                self._check(cols, first + idx)
                add_to.append(cols)
        instants = (codes == INSTANT).nonzero()[0]
        if instants.size:
            self._instants(pick(events, instants), first + instants)
        flows = ((codes <= FLOW_START) & (codes >= FLOW_SKIPPED) & (codes != SKIPPED_CODE)).nonzero()[0]
        if flows.size and self._needs_flows(len(self.host) - host_before, len(self.gpu) - gpu_before):
            if (codes[flows] == FLOW_SKIPPED).any():
                self.flows_skipped = True  # the parser decodes this chunk again and calls absorb_flows
            else:
                self._flows(pick(events, flows), codes[flows], first + flows)

    def absorb_flows(self, events: list[Event]) -> None:
        """The flow events of a chunk already absorbed (decoded again, in full)."""
        codes = self._codes(events)
        flows = ((codes <= FLOW_START) & (codes >= FLOW_STEP)).nonzero()[0]
        if flows.size:
            first = self.n_events - len(events)
            try:
                self._flows(pick(events, flows), codes[flows], first + flows)
            except OverflowError:
                raise self._overflow(first, len(events)) from None

    def _codes(self, events: list[Event]) -> np.ndarray:
        """Each event's kind (complete events) or type code (the others), in one C-level pass."""
        return np.fromiter(map(self.codes.__getitem__, map(_CAT, events)), np.int16, len(events))

    def _needs_flows(self, new_host: int, new_gpu: int) -> bool:
        """Flows only matter where launch calls or GPU ops of this chunk lack a correlation id."""
        for cols in self.host[len(self.host) - new_host :]:
            launch = (cols["kind"] == _RUNTIME) | (cols["kind"] == _DRIVER)
            if (cols["correlation"][launch] == NONE).any():
                return True
        for cols in self.gpu[len(self.gpu) - new_gpu :]:
            ops = cols["kind"] <= _MEMSET
            if (cols["correlation"][ops] == NONE).any():
                return True
        return False

    def _instants(self, evs: Sequence[Event], positions: np.ndarray) -> None:
        """``[memory]`` instants become rows; ``[OutOfMemory]`` ones are counted, and the first
        ``MAX_OOM_ROWS`` kept as rows (request size, totals, time: the OOM forensics); others ignored."""
        names = list(map(_NAME, evs))
        ooms = names.count("[OutOfMemory]")
        kept = sum(len(c["ts"]) for c in self.oom_mem)
        if ooms and kept < MAX_OOM_ROWS:  # rare; bounded whatever a trace holds
            at = [i for i, n in enumerate(names) if n == "[OutOfMemory]"][: MAX_OOM_ROWS - kept]
            cols = self._mem_columns(pick(evs, np.asarray(at)))
            keep = ~_outside(cols["ts"], MAX_TS_US)
            self.oom_mem.append({k: v[keep] for k, v in cols.items()})
        self.oom += ooms
        is_mem = np.fromiter(map("[memory]".__eq__, names), np.bool_, len(names))
        if is_mem.any():
            rows = np.flatnonzero(is_mem)
            cols = self._mem_columns(pick(evs, rows))
            bad = _outside(cols["ts"], MAX_TS_US)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise self._bad_time("a [memory] event", "ts", cols["ts"][i], int(positions[rows[i]]))
            self.mem.append(cols)

    def _flows(self, evs: Sequence[Event], types: np.ndarray, positions: np.ndarray) -> None:
        keep = np.flatnonzero(
            np.fromiter(map(FLOW_CATEGORIES.__contains__, map(_FLOW_CAT, evs)), np.bool_, len(evs))
        )
        if keep.size == 0:
            return
        kept = pick(evs, keep)
        ts = np.fromiter(map(_TS, kept), np.float64, len(kept))
        bad = np.abs(ts) > MAX_TS_US  # a flow without a time binds to nothing; one out of range is refused
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise self._bad_time("a flow event", "ts", ts[i], int(positions[keep[i]]))
        self.flows.append(
            {
                "id": self._ids(kept, _ID),
                "start": types[keep] == FLOW_START,
                "pid": self._ids(kept, _PID),
                "tid": self._ids(kept, _TID),
                "ts": ts,
            }
        )

    def _check(self, cols: dict[str, np.ndarray], positions: np.ndarray) -> None:
        """Complete events need name, and ts and dur in range (``schema.MAX_TS_US``); say which
        event lacks what, or which field is out of range."""
        bad_ts, bad_dur = _outside(cols["ts"], MAX_TS_US), _outside(cols["dur"], MAX_DUR_US)
        bad_name = cols["name"] == self.ids.get(None, -1)  # type: ignore[call-overload]
        bad = bad_ts | bad_dur | bad_name
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            field = "ts" if bad_ts[i] else "dur" if bad_dur[i] else "name"
            raise self._bad_time(
                "a complete ('X') event", field, cols[field][i] if field != "name" else NAN, int(positions[i])
            )

    def _bad_time(self, what: str, field: str, value: float, position: int) -> TraceError:
        """'lacks' for a missing value (NaN), 'out of range' with the value for any other."""
        name = Path(self.source).name
        if value != value:
            return TraceError(f"{name}: {what} lacks '{field}' (event #{position})")
        limit = MAX_DUR_US if field == "dur" else MAX_TS_US
        return TraceError(
            f"{name}: {what} has '{field}' {value:.6g} µs, out of range (at most ±{limit:.3g} µs) "
            f"(event #{position})"
        )

    def _names(self, evs: Sequence[Event]) -> np.ndarray:
        return np.fromiter(map(self.ids.__getitem__, map(_NAME, evs)), np.int32, len(evs))

    def _ids(
        self, evs: Sequence[Event], getter: Callable[[Event], Any], labelled: bool = False
    ) -> np.ndarray:
        """pid/tid column; string labels (``"Spans"``) get stable negative ids.

        ``labelled``: the caller knows a label is among them, so skip the all-integer attempt.
        """
        n = len(evs)
        if not labelled:
            try:
                return np.fromiter(map(getter, evs), np.int64, n)
            except (TypeError, ValueError):
                pass
        vals = list(map(getter, evs))
        for v in set(vals):
            if v.__class__ is not int:
                self.label(v)
                self._label_seen = True
        return np.fromiter(map(self.labels.get, vals, vals), np.int64, n)

    def _records(self, evs: Sequence[Event], table: Table) -> tuple[Any, np.ndarray, np.ndarray]:
        """The table's numeric record (``Table.fields``), then pid and tid.

        One structured ``fromiter`` (pid and tid included) is ~2x faster than one per field. Label
        pids/tids (``"Spans"``) break it, so they are read apart: in a chunk that follows one holding
        a label (where labels recur, they recur in every chunk), and when the chunk's last event has
        one (Kineto writes its ``"Spans"`` span last, so a failed attempt would have cost a whole
        pass). A chunk after a label-free one is tried the fast way again: a trace with one
        ``"Spans"`` span per profiling window (or a file of several traces) was read the slow way
        from the first span on, ~5% of parsing an 860 MB one. A chunk holding another odd value (a
        hex-string stream) is redone field by field, coercing.
        """
        n = len(evs)
        last = evs[-1]
        labelled = last.pid.__class__ is not int or last.tid.__class__ is not int
        if not self._labelled[table.name] and not labelled:
            try:
                cols = np.fromiter(map(attrgetter(*table.fields, "pid", "tid"), evs), table.record_ids, n)
                return cols, cols["pid"], cols["tid"]
            except (TypeError, ValueError, OverflowError):
                pass
        self._label_seen = False
        pid, tid = self._ids(evs, _PID, labelled), self._ids(evs, _TID, labelled)
        self._labelled[table.name] = self._label_seen
        try:
            return np.fromiter(map(attrgetter(*table.fields), evs), table.record, n), pid, tid
        except (TypeError, ValueError, OverflowError):
            pass
        out: dict[str, np.ndarray] = {}
        for field, col in zip(table.fields, table.record.names or (), strict=True):
            get = attrgetter(field)
            dtype = table.record.fields[col][0] if table.record.fields else np.dtype(np.int64)
            try:
                out[col] = np.fromiter(map(get, evs), dtype, n)
            except (TypeError, ValueError, OverflowError):
                conv = to_float if dtype.kind == "f" else to_int
                out[col] = np.fromiter((conv(get(e)) for e in evs), dtype, n)
        return out, pid, tid

    def _columns(self, evs: Sequence[Event], kinds: np.ndarray, table: Table) -> dict[str, np.ndarray]:
        """A host or GPU table's columns for these complete events."""
        rec, pid, tid = self._records(evs, table)
        cols = {
            "name": self._names(evs),
            "kind": kinds.astype(np.int8),
            "ts": rec["ts"],
            "dur": rec["dur"],
            "pid": pid,
            "tid": tid,
            **arg_columns(rec, table, pid, tid),
        }
        if table.sparse:
            self._sparse_columns(evs, cols["name"], cols["kind"], table)
        self.rows[table.name] += len(evs)
        return cols

    def _sparse_columns(
        self, evs: Sequence[Event], names: np.ndarray, kinds: np.ndarray, table: Table
    ) -> None:
        """Op args, read on the few events that can carry them; strings as value ids.

        Only the values some carrier has are kept, with their rows in the table: ``assembly``
        scatters them into columns that are NONE elsewhere (a full column per chunk cost ~5% of a parse).
        """
        rows = self.rows[table.name]
        for carrier, group in _SPARSE[table.name]:
            wanted = [g for g in group if self._absent.get(g[0].attr, 0) < ABSENT_AFTER]
            if not wanted:
                continue
            idx = self._carriers(names, kinds, carrier)
            if not idx.size:
                continue
            carriers = pick(evs, idx)
            at = idx + rows
            for arg, column, dtype in wanted:
                got = self._sparse_values(carriers, arg, dtype)
                found = bool((got != NONE).any())
                if found:
                    self.sparse[table.name].append((column, at, got))
                missing = self._absent.get(arg.attr, 0)
                if missing >= 0:  # still unseen in this trace: count the events that lacked it
                    found = found or self._carried(carriers, arg)
                    self._absent[arg.attr] = -1 if found else missing + idx.size

    def _carriers(self, names: np.ndarray, kinds: np.ndarray, arg: Arg) -> np.ndarray:
        """Positions of the events that may carry ``arg``: by name pattern (once per name), else kind."""
        if arg.on_names is None:
            return (kinds == arg.on_kind).nonzero()[0]
        hits, some = self._name_hits.get(arg.on_names, (_NO_HITS, False))
        if hits.size < len(self.ids):  # names arrived: test the new ones
            new = self.ids.newest(len(self.ids) - hits.size)
            if None in new:  # an event without a name (refused by ``_check``)
                new = [s or "" for s in new]
            matched = map(is_not, map(_NAME_PATTERNS[arg.on_names].match, new), repeat(None))
            hits = np.concatenate([hits, np.fromiter(matched, np.bool_, len(new))])
            some = bool(hits.any())
            self._name_hits[arg.on_names] = hits, some
        return hits.take(names).nonzero()[0] if some else _NO_ROWS

    def _carried(self, evs: Sequence[Event], arg: Arg) -> bool:
        """Whether any of these carriers has ``arg`` at all, whatever its value.

        Every ``Input type`` text read so far went through ``_FirstFloat``, which notes a list.
        """
        if arg.text == "first_float":
            return self._first_float.listed
        return any(map(is_not, map(attrgetter(f"args.{arg.attr}"), evs), repeat(None)))

    def _sparse_values(self, evs: Sequence[Event], arg: Arg, dtype: np.dtype[Any]) -> np.ndarray:
        """The arg's values on these events (string ones as value ids), in the column's dtype."""

        def values(coerce: bool) -> Any:
            got = map(attrgetter(f"args.{arg.attr}"), evs)
            if coerce:
                got = map(arg.coerce, got)
            if arg.text == "first_float":
                return map(self._first_float.__getitem__, _texts(list(got)))
            return map(self.values.__getitem__, got) if arg.text else got

        try:
            return np.fromiter(values(False), dtype, len(evs))
        except (TypeError, ValueError, OverflowError):  # an odd value: coerce one by one (rare)
            return np.fromiter(values(True), dtype, len(evs))

    def _mem_columns(self, evs: Sequence[Event]) -> dict[str, np.ndarray]:
        rec = np.fromiter(map(_MEM_FIELDS, evs), MEMORY.record, len(evs))
        cols = {"ts": rec["ts"], **{MEMORY.column(a): rec[a.attr] for a in MEMORY.args}}
        return {k: np.ascontiguousarray(v) for k, v in cols.items()}

    def set_top(self, top: dict[str, Any]) -> None:
        self.top = top
