"""One trace parsed by two processes: a forked child and the parent share its chunks.

Decoding events and folding them into columns is most of a load and runs under the GIL, so a second
core helps only from another process. Both processes read the whole file and cut it into the same
chunks (the cuts depend only on the text); each chunk is decoded by the process that reaches it
first (``_Claims``), and the other drops it undecoded.
The child sends its columns back pickled through a pipe, their arrays out of band in a shared
memory file that the parent maps (no copy through the pipe), and ``merge`` joins the two builders in chunk order, renumbering names
and string values as one builder reading the file front to back would have numbered them, so the
trace is the one ``loading.load_trace`` builds alone, column for column.

Anything out of the ordinary (a chunk one process cannot cut where the other did, more
``[OutOfMemory]`` rows than one process keeps, a refused trace, a child that dies) returns None,
and the caller parses the file alone: its errors, with their event numbers, are the serial parser's.
Only forked on Linux, from a process without other threads (a fork copies no thread, and a lock
another thread held would stay held in the child) but those marked ``FORK_SAFE``.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import signal
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceError
from ..model.trace import NONE
from .assembly import TEXT_COLUMNS
from .columns import MAX_OOM_ROWS, Builder
from .reading import decompressed_blocks
from .splitting import Diverged, StreamParser

if sys.platform == "linux":  # ``usable`` forks only there
    import fcntl

# Below this many bytes on disk the fork, the pipe and the merge cost more than the second core saves.
MIN_FILE_BYTES = 1 << 20
_LISTS = ("host", "gpu", "mem", "flows", "oom_mem")
_HEADER = struct.Struct("<QQ")  # pickle bytes, number of out-of-band buffers
_SPAN = struct.Struct("<QQ")  # an out-of-band buffer's offset and length in the columns file


# A thread whose holder sets this attribute on it holds no lock the child may need (it only waits
# and writes to a terminal): ``cli.analyze``'s progress line. Any other thread rules a fork out.
FORK_SAFE = "stepdoctor_fork_safe"


def usable(path: Path) -> bool:
    """Forking pays here: Linux, two cores for this process, no thread but fork-safe ones, a
    large enough file."""
    if sys.platform != "linux" or not hasattr(os, "memfd_create"):
        return False
    main = threading.current_thread()
    if any(t is not main and not getattr(t, FORK_SAFE, False) for t in threading.enumerate()):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2 and path.stat().st_size >= MIN_FILE_BYTES
    except OSError:
        return False


class _Marks:
    """After each chunk a builder absorbs: the chunk's number and the builder's sizes then."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        self.rows: list[tuple[int, ...]] = []

    def __call__(self, chunk: int) -> None:
        b = self.b
        self.rows.append(
            (
                chunk,
                *(len(getattr(b, name)) for name in _LISTS),
                len(b.sparse["host"]),
                len(b.sparse["gpu"]),
                b.rows["host"],
                b.rows["gpu"],
                len(b.ids),
                len(b.values),
                len(b.labels),
            )
        )


class _Claims:
    """Which process decodes chunk ``k``: the first to reach it. Both cut the same chunks in the
    same order, so one shared number, the next chunk nobody has claimed, decides; the process that
    is busy (importing the analysis, decoding a chunk) leaves the chunks it has not reached to the
    other, so the two stay balanced however their speeds differ. The number lives in shared memory,
    under a POSIX record lock (held per process: unlike ``flock``, it excludes across ``fork``)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("stepdoctor-chunk-claims")
        os.ftruncate(self.fd, 8)
        self.next = mmap.mmap(self.fd, 8)
        self.mine = -1  # the last chunk this process claimed (asked again after a failed cut)
        self.count = 0  # chunks this process claimed

    def claim(self, k: int) -> bool:
        if k == self.mine:
            return True
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            free = int.from_bytes(self.next[:8], "little")
            if k < free:
                return False
            self.next[:8] = (k + 1).to_bytes(8, "little")
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        self.mine, self.count = k, self.count + 1
        return True

    def close(self) -> None:
        self.next.close()
        os.close(self.fd)


class Started:
    """A forked child already parsing the file; ``finish`` parses with it, chunk by chunk, each
    chunk decoded by whichever of the two reaches it first (``_Claims``).

    Forked ahead of other work (``cli.analyze`` imports the analysis meanwhile), the child decodes
    the chunks the parent has not reached yet. ``shares``: the chunks each decoded (parent, child),
    the tail included in the parent's.
    """

    def __init__(self, path: Path, cap: int, label: str, source: str) -> None:
        self.path, self.cap, self.label, self.source = path, cap, label, source
        self.of = (path, cap, label, source)  # what ``loading.load_trace`` checks it was started for
        self.shares = (0, 0)
        self.claims = _Claims()
        self.columns = os.memfd_create("stepdoctor-child-columns")  # the child's arrays, shared
        read_end, write_end = os.pipe()
        # A 1 MiB pipe (Linux's default cap): the child's columns cross in fewer, larger writes.
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 20)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(read_end)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _child(path, cap, label, source, write_end, self.columns, self._theirs)
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        self.pid: int | None = pid
        self.read_end = read_end

    def _theirs(self, k: int) -> bool:
        """Chunk ``k`` is the other process's to decode (this one skips it)."""
        return not self.claims.claim(k)

    def finish(self) -> Builder | None:
        """The trace's builder with every chunk absorbed, or None: parse the file alone instead."""
        if self.pid is None:
            return None  # cancelled, or finished already
        try:
            b, marks = _share(self.path, self.cap, self.label, self.source, self._theirs, tail=True)
            theirs = _receive(self.read_end, self.columns)
        except (TraceError, Diverged):
            return None
        finally:
            self.cancel()
        if theirs is None:
            return None
        self.shares = (len(marks.rows), len(theirs["marks"]))
        try:
            return merge(b, marks.rows, theirs)
        except _Unshared:
            return None

    def cancel(self) -> None:
        """End the child (done or no longer wanted) and collect it; nothing once it is collected."""
        if self.pid is None:
            return
        os.close(self.read_end)
        os.close(self.columns)  # a mapping of it lives on while arrays use it
        self.claims.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = None


def start(path: Path, cap: int, label: str, source: str) -> Started | None:
    """A child parsing ``path`` from now on, where forking pays (``usable``)."""
    return Started(path, cap, label, source) if usable(path) else None


def load(path: Path, cap: int, label: str, source: str) -> Builder | None:
    """The trace's builder, parsed by two processes, or None: parse the file alone instead."""
    return Started(path, cap, label, source).finish()


def _share(
    path: Path, cap: int, label: str, source: str, skip: Callable[[int], bool], *, tail: bool
) -> tuple[Builder, _Marks]:
    """This process's chunks of the file (all but those ``skip`` names), and the tail's if ``tail``."""
    b = Builder(source)
    marks = _Marks(b)
    parser = StreamParser(b, label, skip=skip, on_chunk=marks)
    blocks = decompressed_blocks(path, cap, label)
    try:
        for block in blocks:
            parser.feed(block)
        if tail:
            parser.finish()
    finally:
        blocks.close()
    return b, marks


def _child(
    path: Path, cap: int, label: str, source: str, out: int, columns: int, skip: Callable[[int], bool]
) -> None:
    """Decode the child's chunks and send back its builder's state (None: it could not)."""
    state: dict[str, Any] | None = None
    try:
        b, marks = _share(path, cap, label, source, skip, tail=False)
        state = {
            # Contiguous, so pickle passes every array out of band (a strided record field would
            # be copied into the pickle, then out of it again in the parent).
            **{
                name: [{k: np.ascontiguousarray(v) for k, v in cols.items()} for cols in getattr(b, name)]
                for name in _LISTS
            },
            "sparse": b.sparse,
            "ids": list(b.ids),
            "values": list(b.values),
            "labels": list(b.labels),
            "codes": list(b.codes),
            "oom": b.oom,
            "marks": marks.rows,
        }
    except (TraceError, Diverged, MemoryError, RecursionError):
        state = None
    _send(out, columns, state)


def _send(pipe: int, columns: int, obj: Any) -> None:
    """``obj`` pickled down the pipe, its arrays' bytes written apart into the shared ``columns``
    file (64-byte aligned), which the parent maps instead of reading them through the pipe."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    spans, at = [], 0
    with io.FileIO(columns, "wb", closefd=False) as out:
        for buffer in buffers:
            at += _write_all(out, memoryview(bytes(-at % 64)))
            raw = buffer.raw()
            spans.append(_SPAN.pack(at, raw.nbytes))
            at += _write_all(out, raw)
    with io.FileIO(pipe, "wb", closefd=True) as out:
        for part in (_HEADER.pack(len(data), len(spans)), *spans, data):
            _write_all(out, memoryview(part))


def _write_all(out: io.FileIO, view: memoryview) -> int:
    n = view.nbytes
    while view.nbytes:
        view = view[out.write(view) or 0 :]
    return n


def _receive(pipe: int, columns: int) -> Any:
    """The child's state (None when it sent none, or died before sending it all); its arrays are
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
    size, count = _HEADER.unpack(head)
    spans = exactly(_SPAN.size * count)
    data = exactly(size)
    if spans is None or data is None:
        return None
    buffers: list[memoryview] = []
    if count:
        total = os.fstat(columns).st_size
        mapped = memoryview(
            mmap.mmap(columns, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        )
        for at, n in _SPAN.iter_unpack(spans):
            if at + n > total:
                return None
            buffers.append(mapped[at : at + n])
    return pickle.loads(data, buffers=buffers)


class _Renumber:
    """One builder's ids (names or string values) -> the merged builder's, grown as chunks arrive."""

    def __init__(self, keys: list[Any], into: dict[Any, int], reserved: int = 0) -> None:
        self.keys = keys[reserved:]
        self.into = into
        self.table = np.empty(0, np.int32)

    def upto(self, n: int) -> np.ndarray:
        """Intern this builder's first ``n`` keys (in its order) and give its id -> merged id table."""
        have = len(self.table)
        if n > have:
            new = np.fromiter(map(self.into.__getitem__, self.keys[have:n]), np.int32, n - have)
            self.table = np.concatenate([self.table, new])
        return self.table


def merge(parent: Builder, parent_marks: list[tuple[int, ...]], child: dict[str, Any]) -> Builder | None:
    """The two builders' chunks in file order, as one builder that read them all would hold them."""
    if None in parent.ids or None in child["ids"]:
        return None  # an event without a name: the serial parser refuses the trace
    if parent.oom + child["oom"] > MAX_OOM_ROWS:
        return None  # each kept its first rows; the file's first ones are the serial parser's to pick
    out = Builder(parent.source)
    out.top = parent.top
    out.oom = parent.oom + child["oom"]
    for code in (*parent.codes, *child["codes"]):
        out.codes[code]  # interns the categories seen: the format check reads them
    own = {
        "parent": (parent_marks, {name: getattr(parent, name) for name in _LISTS}, parent.sparse),
        "child": (child["marks"], {name: child[name] for name in _LISTS}, child["sparse"]),
    }
    names = {
        "parent": _Renumber(list(parent.ids), out.ids),
        "child": _Renumber(child["ids"], out.ids),
    }
    values = {
        "parent": _Renumber(list(parent.values), out.values, reserved=1),
        "child": _Renumber(child["values"], out.values, reserved=1),
    }
    labels = {"parent": _Labels(list(parent.labels), out), "child": _Labels(child["labels"], out)}
    order = sorted((m[0], who, i) for who, (marks, _, _) in own.items() for i, m in enumerate(marks))
    before = {who: (0,) * 13 for who in own}
    for _, who, i in order:
        marks, lists, sparse = own[who]
        mark = marks[i]
        prev = before[who]
        name_ids = names[who].upto(mark[10])
        value_ids = values[who].upto(mark[11] - 1)
        relabel = labels[who].upto(mark[12])
        for j, list_name in enumerate(_LISTS, start=1):
            for cols in lists[list_name][prev[j] : mark[j]]:
                if list_name in ("host", "gpu"):
                    cols = {**cols, "name": name_ids[cols["name"]]}
                if relabel is not None:
                    cols = {k: relabel(v) if k in _LABELLED else v for k, v in cols.items()}
                getattr(out, list_name).append(cols)
        for j, table in ((6, "host"), (7, "gpu")):
            shift = out.rows[table] - prev[j + 2]
            for column, rows, got in sparse[table][prev[j] : mark[j]]:
                if column in TEXT_COLUMNS[table]:
                    got = np.where(got != NONE, value_ids[np.maximum(got, 0)], NONE).astype(got.dtype)
                out.sparse[table].append((column, rows + shift, got))
        out.rows["host"] += mark[8] - prev[8]
        out.rows["gpu"] += mark[9] - prev[9]
        before[who] = mark
    out.ids.account()
    out.values.account()
    return out


# The columns that hold a pid/tid label's id (``Builder._label``): pid and tid, a flow's id, and a GPU
# op's stream where it had none (``schema``: the stream falls back to the tid).
_LABELLED = frozenset({"pid", "tid", "id", "stream"})


class _Labels:
    """One builder's string pid/tid labels -> the merged builder's ids (``Builder._label``)."""

    def __init__(self, keys: list[Any], into: Builder) -> None:
        self.keys = keys
        self.into = into
        self.table = np.empty(0, np.int64)

    def upto(self, n: int) -> Callable[[np.ndarray], np.ndarray] | None:
        """Label this builder's first ``n`` labels; a column renumbering, None where ids stay as they are."""
        have = len(self.table)
        if n > have:
            new = np.fromiter(map(self.into._label, self.keys[have:n]), np.int64, n - have)
            self.table = np.concatenate([self.table, new])
        if np.array_equal(self.table, -2 - np.arange(len(self.table))):
            return None
        return self._relabel

    def _relabel(self, col: np.ndarray) -> np.ndarray:
        at = np.flatnonzero(col <= -2)
        if not at.size:
            return col
        index = -2 - col[at]
        if int(index.max()) >= len(self.table):
            raise _Unshared  # a negative id that is no label of this builder's: parse alone
        out = col.copy()
        out[at] = self.table[index].astype(col.dtype)
        return out


class _Unshared(Exception):
    """The merge met something it cannot renumber for sure: the file is parsed by one process."""
