"""One trace parsed by two processes: a forked child (``forking.Started``) and the parent share its chunks.

Decoding events and folding them into columns is most of a load and runs under the GIL, so a second
core helps only from another process. Both processes read the whole file and cut it into the same
chunks (the cuts depend only on the text); each chunk is decoded by the process that reaches it
first (``forking._Claims``), and the other drops it undecoded.
The child writes each chunk's arrays into a shared memory file as soon as the chunk is done, and at
the end pickles its builder's state down a pipe with each array named by its place in that file;
the parent maps the file (no copy through the pipe). ``merge`` joins the two builders in chunk
order, renumbering names and string values as one builder reading the file front to back would
have numbered them, so the trace is the one ``loading.load_trace`` builds alone, column for column.

Anything out of the ordinary (a chunk one process cannot cut where the other did, more
``[OutOfMemory]`` rows than one process keeps, a refused trace, a child that dies) returns None,
and the caller parses the file alone: its errors, with their event numbers, are the serial parser's.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import TraceError
from .columns import MAX_OOM_ROWS, TEXT_COLUMNS, Builder, renumbered
from .reading import decompressed_blocks
from .splitting import Diverged, StreamParser

_LISTS = ("host", "gpu", "mem", "flows", "oom_mem")
# The lists whose earlier chunks the builder never reads again (``oom_mem`` it counts): the child
# writes their arrays into the shared file as each chunk is done, while the parent still parses.
_STREAMED = ("host", "gpu", "mem", "flows")
_HEADER = struct.Struct("<Q")  # pickle bytes
# What is parsed (``forking.Started.of``): path, byte cap, label in messages, source name.
_Of = tuple[Path, int, str, str]


class _Mark(NamedTuple):
    """A builder's sizes after it absorbed a chunk: what that chunk added is the difference from
    the mark before it."""

    chunk: int
    host: int
    gpu: int
    mem: int
    flows: int
    oom_mem: int
    sparse_host: int
    sparse_gpu: int
    rows_host: int
    rows_gpu: int
    ids: int
    values: int  # the reserved None included
    labels: int


_NO_MARK = _Mark._make((0,) * len(_Mark._fields))


class _Marks:
    """A builder's ``_Mark`` after each chunk it absorbs (``StreamParser.on_chunk``)."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        self.rows: list[_Mark] = []

    def __call__(self, chunk: int) -> None:
        b = self.b
        self.rows.append(
            _Mark(
                chunk,
                host=len(b.host),
                gpu=len(b.gpu),
                mem=len(b.mem),
                flows=len(b.flows),
                oom_mem=len(b.oom_mem),
                sparse_host=len(b.sparse["host"]),
                sparse_gpu=len(b.sparse["gpu"]),
                rows_host=b.rows["host"],
                rows_gpu=b.rows["gpu"],
                ids=len(b.ids),
                values=len(b.values),
                labels=len(b.labels),
            )
        )


def _share(
    of: _Of, skip: Callable[[int], bool], *, tail: bool, done: Callable[[Builder], None] | None = None
) -> tuple[Builder, _Marks]:
    """This process's chunks of the file (all but those ``skip`` names), and the tail's if ``tail``;
    ``done(builder)`` after each chunk it absorbs."""
    path, cap, label, source = of
    b = Builder(source)
    marks = _Marks(b)

    def on_chunk(k: int) -> None:
        marks(k)
        if done is not None:
            done(b)

    parser = StreamParser(b, label, skip=skip, on_chunk=on_chunk)
    blocks = decompressed_blocks(path, cap, label)
    try:
        for block in blocks:
            parser.feed(block)
        if tail:
            parser.finish()
    finally:
        blocks.close()
    return b, marks


class _Stored(NamedTuple):
    """An array the child wrote into the shared columns file: where it starts, and what it is."""

    at: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


class _ColumnsFile:
    """The child's end of the shared columns file: arrays appended, 64-byte aligned."""

    def __init__(self, fd: int) -> None:
        self.out = io.FileIO(fd, "wb", closefd=False)
        self.at = 0
        self.streamed = dict.fromkeys(_STREAMED, 0)  # chunks of each list already in the file

    def store(self, v: np.ndarray) -> _Stored:
        v = np.ascontiguousarray(v)
        self.at += _write_all(self.out, memoryview(bytes(-self.at % 64)))
        at = self.at
        self.at += _write_all(self.out, v.reshape(-1).view(np.uint8).data)
        return _Stored(at, v.dtype, v.shape)

    def stream(self, b: Builder) -> None:
        """The chunks absorbed since the last call: their arrays go to the file now (while the
        parent still parses), and placeholders stay in their place."""
        for name in _STREAMED:
            chunks = getattr(b, name)
            for cols in chunks[self.streamed[name] :]:
                for key, v in cols.items():
                    cols[key] = self.store(v)
            self.streamed[name] = len(chunks)


class _Sender(pickle.Pickler):
    """Pickles the child's state with every array (stored already or now) as a ``_Stored`` id."""

    def __init__(self, out: io.BytesIO, columns: _ColumnsFile) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.columns = columns

    def persistent_id(self, obj: Any) -> Any:
        if obj.__class__ is _Stored:
            return obj
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            return self.columns.store(obj)
        return None


class _Receiver(pickle.Unpickler):
    """The parent's side: each ``_Stored`` id becomes a view of the mapped columns file."""

    def __init__(self, data: bytes | bytearray, mapped: memoryview) -> None:
        super().__init__(io.BytesIO(data))
        self.mapped = mapped

    def persistent_load(self, pid: Any) -> Any:
        at, dtype, shape = pid
        count = math.prod(shape)
        if at + count * dtype.itemsize > self.mapped.nbytes:
            raise _Truncated
        array = np.frombuffer(self.mapped, dtype, count, at)
        return array if len(shape) == 1 else array.reshape(shape)


class _Truncated(Exception):
    """The columns file ends before an array the state names: the child died while writing it."""


def run_child(of: _Of, out: int, columns: int, skip: Callable[[int], bool]) -> None:
    """Decode the child's chunks, their arrays written to ``columns`` as it goes, and send back its
    builder's state (what was not streamed, ``_Sender`` writes then)."""
    shared = _ColumnsFile(columns)
    b, marks = _share(of, skip, tail=False, done=shared.stream)
    state = {
        **{name: getattr(b, name) for name in _LISTS},
        "sparse": b.sparse,
        "ids": list(b.ids),
        "values": list(b.values),
        "labels": list(b.labels),
        "codes": list(b.codes),
        "oom": b.oom,
        "marks": marks.rows,
    }
    _send(out, shared, state)


def collect(
    of: _Of, skip: Callable[[int], bool], pipe: int, columns: int
) -> tuple[Builder, list[_Mark], dict[str, Any]] | None:
    """The parent's share of the chunks (the tail too), and then the child's state; None where
    the two cannot be joined (a cut one process could not decode, a refused trace, no state)."""
    try:
        b, marks = _share(of, skip, tail=True)
        theirs = _receive(pipe, columns)
    except (TraceError, Diverged):
        return None
    return None if theirs is None else (b, marks.rows, theirs)


def joined(parent: Builder, parent_marks: list[_Mark], child: dict[str, Any]) -> Builder | None:
    """``merge``, or None where the file is one process's to parse."""
    try:
        return merge(parent, parent_marks, child)
    except _Unshared:
        return None


def _send(pipe: int, columns: _ColumnsFile, obj: Any) -> None:
    """``obj`` pickled down the pipe, its arrays (written to the shared columns file, which the
    parent maps instead of reading them through the pipe) named by place."""
    buf = io.BytesIO()
    _Sender(buf, columns).dump(obj)
    data = buf.getbuffer()
    with io.FileIO(pipe, "wb", closefd=True) as out:
        for part in (memoryview(_HEADER.pack(len(data))), data):
            _write_all(out, part)


def _write_all(out: io.FileIO, view: memoryview) -> int:
    n = view.nbytes
    while view.nbytes:
        view = view[out.write(view) or 0 :]
    return n


def _receive(pipe: int, columns: int) -> Any:
    """The child's state (None when it died before sending it all); its arrays are
    views of the ``columns`` file mapped copy-on-write (writable: the assembly repairs some)."""
    f = io.FileIO(pipe, "rb", closefd=False)

    def exactly(n: int) -> bytearray | None:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = f.readinto(view[got:])
            if not k:
                return None
            got += k
        return buf

    head = exactly(_HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    data = exactly(size)
    if data is None:
        return None
    total = os.fstat(columns).st_size
    mapped = memoryview(
        mmap.mmap(columns, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if total
        else bytearray()
    )
    try:
        return _Receiver(data, mapped).load()
    except _Truncated:
        return None


class _Renumber:
    """One builder's ids (names, string values or pid/tid labels) -> the merged builder's, in
    the order that builder met them, grown as its chunks arrive."""

    def __init__(self, keys: list[Any], intern: Callable[[Any], int], dtype: type[np.integer[Any]]) -> None:
        self.keys = keys
        self.intern = intern
        self.table = np.empty(0, dtype)

    def upto(self, n: int) -> np.ndarray:
        """Intern this builder's first ``n`` keys; its id -> merged id table."""
        have = len(self.table)
        if n > have:
            new = np.fromiter(map(self.intern, self.keys[have:n]), self.table.dtype, n - have)
            self.table = np.concatenate([self.table, new])
        return self.table


# The columns that hold a pid/tid label's id (``Builder.label``): pid and tid, a flow's id, and a GPU
# op's stream where it had none (``schema``: the stream falls back to the tid).
_LABELLED = frozenset({"pid", "tid", "id", "stream"})


def _relabel(col: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Label ids (-2, -3, ...: index 0, 1, ... of ``table``) through ``table``; other values kept."""
    at = np.flatnonzero(col <= -2)
    if not at.size:
        return col
    index = -2 - col[at]
    if int(index.max()) >= len(table):
        raise _Unshared  # a negative id that is no label of this builder's: parse alone
    out = col.copy()
    out[at] = table[index].astype(col.dtype)
    return out


class _Unshared(Exception):
    """The merge met something it cannot renumber for sure: the file is parsed by one process."""


def merge(parent: Builder, parent_marks: list[_Mark], child: dict[str, Any]) -> Builder | None:
    """The two builders' chunks in file order, as one builder that read them all would hold them.

    Names, string values and labels are renumbered as they first appear in file order: chunk by
    chunk, each builder's new ones (the difference between its marks) are interned in its order.
    """
    if parent.oom + child["oom"] > MAX_OOM_ROWS:
        return None  # each kept its first rows; the file's first ones are the serial parser's to pick
    out = Builder(parent.source)
    out.top = parent.top
    out.oom = parent.oom + child["oom"]
    for code in (*parent.codes, *child["codes"]):
        out.codes[code]  # interns the categories seen: the format check reads them
    sides = {
        "parent": ({name: getattr(parent, name) for name in _LISTS}, parent.sparse),
        "child": ({name: child[name] for name in _LISTS}, child["sparse"]),
    }
    keys = {
        "parent": (list(parent.ids), list(parent.values)[1:], list(parent.labels)),
        "child": (child["ids"], child["values"][1:], child["labels"]),
    }
    renumber = {
        who: (
            _Renumber(ids, out.ids.__getitem__, np.int32),
            _Renumber(values, out.values.__getitem__, np.int32),
            _Renumber(labels, out.label, np.int64),
        )
        for who, (ids, values, labels) in keys.items()
    }
    order = sorted([(m, "parent") for m in parent_marks] + [(m, "child") for m in child["marks"]])
    before = {"parent": _NO_MARK, "child": _NO_MARK}
    for mark, who in order:
        prev, (lists, sparse) = before[who], sides[who]
        names, values, labels = renumber[who]
        name_ids, value_ids = names.upto(mark.ids), values.upto(mark.values - 1)
        label_ids = labels.upto(mark.labels)
        same_labels = np.array_equal(label_ids, -2 - np.arange(len(label_ids)))
        for name in _LISTS:
            for cols in lists[name][getattr(prev, name) : getattr(mark, name)]:
                if name in ("host", "gpu"):
                    cols = {**cols, "name": name_ids[cols["name"]]}
                if not same_labels:
                    cols = {k: _relabel(v, label_ids) if k in _LABELLED else v for k, v in cols.items()}
                getattr(out, name).append(cols)
        for table in ("host", "gpu"):
            shift = out.rows[table] - getattr(prev, f"rows_{table}")
            done, upto = getattr(prev, f"sparse_{table}"), getattr(mark, f"sparse_{table}")
            for column, rows, got in sparse[table][done:upto]:
                got = renumbered(got, value_ids) if column in TEXT_COLUMNS[table] else got
                out.sparse[table].append((column, rows + shift, got))
            out.rows[table] += getattr(mark, f"rows_{table}") - getattr(prev, f"rows_{table}")
        before[who] = mark
    out.ids.account()
    out.values.account()
    return out
