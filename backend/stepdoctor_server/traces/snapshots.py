"""Memory snapshots beside their traces: torch's CUDA allocator history, stored and served, never unpickled.

The agent's ``memory_snapshot=True`` pickles ``torch.cuda.memory._snapshot()`` (a dict of allocator
segments and per-device allocation events) for each window; it is uploaded after its trace, kept in
the trace store under its own key and downloaded for https://pytorch.org/memory_viz, which reads it
in the browser with its own unpickler.

Why the server never parses it: a pickle is a program for Python's unpickler, and loading one runs
whatever callables it names (``os.system`` included). The server needs none of its content, only to
keep and serve the bytes, so it checks them without loading anything:

- size: at least ``MIN_BYTES`` and at most ``STEPDOCTOR_MAX_UPLOAD_BYTES`` (413);
- ``Content-Type: application/octet-stream`` and no ``Content-Encoding`` (415);
- the header: the PROTO opcode with protocol 2 to 5 (what ``pickle.dump`` writes; older protocols
  are text), then an empty dict being filled, torch's top level (422);
- every opcode is one of the data-only opcodes (dicts, lists, tuples, sets, str, bytes, ints,
  floats, None, booleans, the memo), walked by their argument sizes without building a value: none
  of the opcodes that import or call (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ,
  EXT, PERSID), so a downloaded snapshot is also safe for ``pickle.load``; and STOP ends it, at
  the last byte (422).

The walk is pure Python over a memory map: about 0.2 s per MB on one core (9.6 MB: 1.9 s), off the event loop.
Anything refused leaves nothing behind; a snapshot sent again with the same bytes is a replay (200),
with other bytes a conflict (409).
"""

from __future__ import annotations

import mmap
from pathlib import Path

from fastapi import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from stepdoctor_server.auth.tokens import Principal
from stepdoctor_server.core.database import on_rollback
from stepdoctor_server.core.errors import ApiError, not_found
from stepdoctor_server.core.models import MemorySnapshot, Trace
from stepdoctor_server.traces.service import load_trace
from stepdoctor_server.traces.storage import StagedFile, TraceStore

CONTENT_TYPE = "application/octet-stream"
SUFFIX = ".memory_snapshot.pickle"
MIN_BYTES = 8  # PROTO, an empty dict and STOP take 4; torch's smallest snapshot is far larger
PROTOCOLS = range(2, 6)
VIEWER = "https://pytorch.org/memory_viz"

_PROTO, _FRAME, _STOP, _EMPTY_DICT = 0x80, 0x95, ord("."), ord("}")
# Data-only opcodes -> bytes of their fixed argument (pickletools' names in the comments).
_FIXED: dict[int, int] = {
    **dict.fromkeys(b"(.}])t\x85\x86\x87aesu\x94N\x88\x890", 0),  # MARK STOP EMPTY_* TUPLE* APPEND(S)
    # SETITEM(S) MEMOIZE NONE NEWTRUE NEWFALSE POP
    **dict.fromkeys(b"12\x8f\x90\x91", 0),  # POP_MARK DUP EMPTY_SET ADDITEMS FROZENSET
    ord("q"): 1,  # BINPUT
    ord("r"): 4,  # LONG_BINPUT
    ord("h"): 1,  # BINGET
    ord("j"): 4,  # LONG_BINGET
    ord("J"): 4,  # BININT
    ord("K"): 1,  # BININT1
    ord("M"): 2,  # BININT2
    ord("G"): 8,  # BINFLOAT
    _PROTO: 1,
    _FRAME: 8,
}
# Data-only opcodes with a length-prefixed argument -> bytes of the length.
_SIZED: dict[int, int] = {
    0x8A: 1,  # LONG1
    0x8B: 4,  # LONG4
    0x8C: 1,  # SHORT_BINUNICODE
    ord("X"): 4,  # BINUNICODE
    0x8D: 8,  # BINUNICODE8
    ord("C"): 1,  # SHORT_BINBYTES
    ord("B"): 4,  # BINBYTES
    0x8E: 8,  # BINBYTES8
}


def refused(detail: str) -> ApiError:
    return ApiError(422, "invalid_memory_snapshot", f"not a memory snapshot: {detail}")


def check_content_type(content_type: str | None, content_encoding: str | None) -> None:
    if (content_type or "").split(";")[0].strip().lower() != CONTENT_TYPE:
        raise ApiError(415, "unsupported_media_type", f"a memory snapshot is sent as {CONTENT_TYPE}")
    if (content_encoding or "identity").strip().lower() != "identity":
        raise ApiError(415, "unsupported_media_type", "a memory snapshot is sent without Content-Encoding")


def check_header(first: bytes) -> None:
    """The first bytes of an upload (at least 2), so a body that is no pickle stops at its first chunk."""
    if first[0] != _PROTO or first[1] not in PROTOCOLS:
        raise refused("it does not start with a pickle header of protocol 2 to 5 (torch's pickle.dump)")


def check_pickle(data: memoryview | bytes) -> int:
    """The pickle's protocol, when ``data`` is one made only of data opcodes, top level a dict, ending
    with STOP at its last byte (module docstring); else ``ApiError`` 422. Builds nothing."""
    n = len(data)
    if n < MIN_BYTES:
        raise refused(f"{n} bytes is too short")
    check_header(bytes(data[:2]))
    protocol = data[1]
    i = 2
    if data[i] == _FRAME:
        i += 9
    if i >= n or data[i] != _EMPTY_DICT:
        raise refused("its top level is not a dict (torch's snapshot is)")
    fixed, sized, little = _FIXED, _SIZED, int.from_bytes
    while i < n:
        op = data[i]
        i += 1
        width = fixed.get(op)
        if width is not None:
            if op == _STOP:
                if i != n:
                    raise refused(f"{n - i} bytes follow its end")
                return protocol
            i += width
            continue
        width = sized.get(op)
        if width is None:
            raise refused(
                f"opcode {op:#04x} at byte {i - 1} is not plain data (it could import or call code)"
            )
        i += width + little(data[i : i + width], "little")
    raise refused("it is cut short (no STOP opcode at its end)")


def check_file(path: Path) -> int:
    """``check_pickle`` over a staged upload through a memory map (no copy in memory)."""
    with path.open("rb") as fh:
        if path.stat().st_size < MIN_BYTES:
            return check_pickle(fh.read())
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            return check_pickle(view)


class HeaderCheck:
    """``TraceStore.receive``'s inspector: refuses a body whose first two bytes are no pickle header."""

    def __init__(self) -> None:
        self.head = b""

    def feed(self, data: bytes) -> None:
        if len(self.head) < 2:
            self.head += data[: 2 - len(self.head)]
            if len(self.head) == 2:
                check_header(self.head)


def snapshot_filename(trace: Trace) -> str:
    """The trace's download name with ``.memory_snapshot.pickle`` for its ``.pt.trace.json[.gz]``."""
    stem = trace.filename.removesuffix(".gz").removesuffix(".json").removesuffix(".pt.trace")
    return f"{stem}{SUFFIX}"


def snapshot_of(session: Session, trace_id: int) -> MemorySnapshot | None:
    return session.scalar(select(MemorySnapshot).where(MemorySnapshot.trace_id == trace_id))


def store_snapshot(
    session: Session,
    store: TraceStore,
    principal: Principal,
    trace_id: int,
    staged: StagedFile,
    protocol: int,
) -> tuple[MemorySnapshot, bool]:
    """Record a checked snapshot for the caller's trace and move it into the store; returns it and
    whether it replays one already stored (same bytes). Services flush; the request commits, and
    deletes the moved file again if that commit fails."""
    trace, _, _ = load_trace(session, principal, trace_id)
    known = snapshot_of(session, trace.id)
    if known is not None:
        if known.sha256 != staged.sha256:
            raise ApiError(
                409, "snapshot_exists", f"trace {trace.id} already has a different memory snapshot"
            )
        return known, True
    snapshot = MemorySnapshot(
        trace_id=trace.id,
        size_bytes=staged.size_bytes,
        sha256=staged.sha256,
        protocol=protocol,
        storage_key=TraceStore.new_key(principal.team_id, ".snapshot.pickle"),
        filename=snapshot_filename(trace),
    )
    session.add(snapshot)
    session.flush()
    store.commit(staged, snapshot.storage_key)
    key = snapshot.storage_key
    on_rollback(session, lambda: store.delete(key))
    return snapshot, False


def download_snapshot(session: Session, principal: Principal, store: TraceStore, trace_id: int) -> Response:
    """The snapshot's bytes as an attachment (``application/octet-stream``); 404 without one, 410 when
    the store lost the file."""
    trace, _, _ = load_trace(session, principal, trace_id)
    snapshot = snapshot_of(session, trace.id)
    if snapshot is None:
        raise not_found("memory snapshot of trace", trace_id)
    if not store.exists(snapshot.storage_key):
        raise ApiError(410, "gone", f"the memory snapshot of trace {trace_id} is missing from the store")
    return store.download(
        snapshot.storage_key,
        filename=snapshot.filename,
        media_type=CONTENT_TYPE,
        headers={
            "X-Content-SHA256": snapshot.sha256,
            "Cache-Control": "private, max-age=3600",
            "X-Content-Type-Options": "nosniff",
        },
    )
