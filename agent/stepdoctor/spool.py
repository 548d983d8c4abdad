"""The on-disk spool: every captured trace lands here before anything touches the network.

Layout (TensorBoard profiler plugin compatible, so ``tensorboard --logdir SPOOL`` shows each run)::

    SPOOL/PROJECT/RUN/{host}_{pid}.{time_ns}.pt.trace.json.gz   compressed Chrome trace
    SPOOL/PROJECT/RUN/{host}_{pid}.{time_ns}.stepdoctor.meta     sidecar JSON (idempotency key, ...)
    SPOOL/PROJECT/RUN/memory_snapshots/{stem}.pickle              CUDA allocator snapshot (memory_snapshot=True)
    SPOOL/PROJECT/RUN/series-{stream}-{seq}.stepdoctor.series    step-series chunk (stepdoctor.series),
                                                                 shipped like a trace, to uploaded/ or failed/
    SPOOL/failed/PROJECT/RUN/...                                 rejected by the server, with .reason.txt
                                                                 and .failure.json (where it was sent, how)
    SPOOL/uploaded/PROJECT/RUN/...                               local copies of delivered traces

The spool has a size cap (``STEPDOCTOR_SPOOL_MAX_BYTES``): over it, the oldest uploaded copies are
deleted first; a trace not yet sent (pending or failed) is never deleted to make room, and when
those alone exceed the cap the agent says so once instead.

A capture moves through states, each entered by an atomic rename so a process killed at any
instant leaves either a complete file or a ``.partial`` that is never uploaded:

    .export.partial  (torch writing)  ->  .export  (complete raw JSON)  ->  sidecar .stepdoctor.meta
    -> .pt.trace.json.gz.partial (worker compressing)  ->  .pt.trace.json.gz  ->  moved to
    ``uploaded/`` (or deleted, with no room for copies) after the server acknowledged it (trace
    first, sidecar last).

The sidecar is the commit point: nothing without one is compressed or uploaded. Several processes
(ranks, the next run's agent, ``stepdoctor sync``) may share a spool; an ``flock`` on the
sidecar makes exactly one of them handle a trace at a time, and dies with its holder.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no cross-process claim, in-process only
    fcntl = None  # type: ignore[assignment]

TRACE_SUFFIX = ".pt.trace.json.gz"
META_SUFFIX = ".stepdoctor.meta"
EXPORT_SUFFIX = ".export"
PARTIAL = ".partial"
REASON_SUFFIX = ".reason.txt"
FAILURE_SUFFIX = ".failure.json"
FAILED_DIR = "failed"
UPLOADED_DIR = "uploaded"
SIDECAR_FORMAT = 1
#: Step-series chunks (``stepdoctor.series.SUFFIX``): shipped like traces, without a sidecar (each
#: chunk's header says which process and steps it holds; the folder says project and run).
SERIES_SUFFIX = ".stepdoctor.series"
SNAPSHOT_DIR = "memory_snapshots"  # CUDA allocator snapshots (``stepdoctor.memory_snapshot``), shipped
SNAPSHOT_SUFFIX = ".pickle"  # after their trace, named after it
_SERIES_MAGIC = b"SDSERIES\x01"

_STEM_RE = re.compile(r"^(?P<host>.+)_(?P<pid>\d+)\.(?P<ns>\d+)")
_HOST_BAD = re.compile(r"[^A-Za-z0-9.-]+")

_claimed: set[str] = set()
_claimed_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _claimed_lock
    _claimed_lock = threading.Lock()
    _claimed.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def host_name() -> str:
    return _HOST_BAD.sub("-", socket.gethostname()) or "host"


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp name in the same directory and rename, so readers see all or nothing."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL}")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Entry:
    """One captured trace, identified by its directory and stem; ``meta`` is the sidecar content."""

    directory: Path
    stem: str
    meta: dict[str, Any]

    @property
    def trace(self) -> Path:
        return self.directory / f"{self.stem}{TRACE_SUFFIX}"

    @property
    def sidecar(self) -> Path:
        return self.directory / f"{self.stem}{META_SUFFIX}"

    @property
    def export(self) -> Path:
        return self.directory / f"{self.stem}{EXPORT_SUFFIX}"

    @property
    def key(self) -> str:
        return str(self.meta.get("idempotency_key", ""))

    @property
    def memory_snapshot(self) -> Path:
        """The window's CUDA allocator snapshot (``memory_snapshot=True``), shipped after the trace."""
        return snapshot_path(self.directory, self.stem)


def snapshot_path(directory: Path, stem: str) -> Path:
    return directory / SNAPSHOT_DIR / f"{stem}{SNAPSHOT_SUFFIX}"


def _move_snapshot(source_dir: Path, stem: str, dest_dir: Path) -> None:
    """A trace's snapshot follows it (uploaded/, failed/, back), when it has one."""
    source = snapshot_path(source_dir, stem)
    if source.exists():
        target = snapshot_path(dest_dir, stem)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)


class Spool:
    """File operations on one spool root; stateless apart from the path, so any process can use it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # --- capture side (training thread) -------------------------------------------------------

    def run_dir(self, project: str, run: str) -> Path:
        path = self.root / project / run
        path.mkdir(parents=True, exist_ok=True)
        return path

    @staticmethod
    def new_stem() -> str:
        """TensorBoard's worker naming: ``{host}_{pid}.{time_ns}``."""
        return f"{host_name()}_{os.getpid()}.{time.time_ns()}"

    @staticmethod
    def export_partial(directory: Path, stem: str) -> Path:
        return directory / f"{stem}{EXPORT_SUFFIX}{PARTIAL}"

    @staticmethod
    def commit_capture(directory: Path, stem: str, sidecar: dict[str, Any]) -> Entry:
        """Mark a finished export complete, then write its sidecar: from here on it is deliverable."""
        os.replace(Spool.export_partial(directory, stem), directory / f"{stem}{EXPORT_SUFFIX}")
        entry = Entry(directory, stem, sidecar)
        write_atomic(entry.sidecar, json.dumps(sidecar, separators=(",", ":")).encode())
        return entry

    # --- delivery side (worker thread / sync) -------------------------------------------------

    def sidecars(self) -> list[Path]:
        """Pending sidecars, oldest capture first (``failed/`` lives one level deeper)."""
        found = list(self.root.glob(f"*/*/*{META_SUFFIX}"))
        return sorted(found, key=lambda p: (_stem_time(p.name), p.name))

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[BinaryIO | None]:
        """Exclusive handling of one file across threads and processes; yields its open handle, or
        None when busy or gone.

        An ``flock`` on this descriptor, which dies with its holder: a POSIX record lock (``lockf``)
        is the process's and goes when *any* of its descriptors of the file closes, so reading the
        chunk to upload it let another rank claim it mid-upload and both sent it."""
        key = str(path)
        with _claimed_lock:
            if key in _claimed:
                yield None
                return
            _claimed.add(key)
        try:
            try:
                fh = open(path, "r+b")  # noqa: SIM115 - the lock must live on this very descriptor
            except FileNotFoundError:
                yield None
                return
            with fh:
                if fcntl is not None:
                    try:
                        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        yield None
                        return
                if not path.exists():  # delivered by the previous holder while we waited
                    yield None
                    return
                yield fh
        finally:
            with _claimed_lock:
                _claimed.discard(key)

    @contextlib.contextmanager
    def claim(self, sidecar: Path) -> Iterator[Entry | None]:
        """Exclusive handling of one trace across threads and processes; yields None when busy or gone."""
        with self._locked(sidecar) as fh:
            if fh is None:
                yield None
                return
            try:
                meta = json.loads(fh.read().decode())
                if not isinstance(meta, dict):
                    raise ValueError("sidecar is not a JSON object")
            except ValueError as exc:
                meta = {"_unreadable": str(exc)}
            stem = sidecar.name[: -len(META_SUFFIX)]
            yield Entry(sidecar.parent, stem, meta)

    @staticmethod
    def compress(entry: Entry, level: int, deadline: float | None = None) -> None:
        """Raw export -> gzip, atomically; the raw file goes only once the gzip is durable.

        Past ``deadline`` (``time.monotonic()``) it stops with ``TimeoutError``: a multi-GB export
        takes a minute, and ``sync --timeout`` bounds the whole command. The export stays."""
        if entry.trace.exists():
            entry.export.unlink(missing_ok=True)  # crashed after the rename last time
            return
        tmp = entry.directory / f"{entry.stem}{TRACE_SUFFIX}{PARTIAL}"
        try:
            with open(entry.export, "rb") as src, open(tmp, "wb") as raw:
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=level, mtime=0) as gz:
                    while chunk := src.read(1 << 20):
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError(f"compressing {entry.export.name} did not finish in time")
                        gz.write(chunk)
                raw.flush()
                os.fsync(raw.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk or the deadline: give the half gzip's space back
            raise
        os.replace(tmp, entry.trace)
        entry.export.unlink(missing_ok=True)

    @staticmethod
    def remove(entry: Entry) -> None:
        """Forget a delivered trace: trace first, sidecar last, so a crash in between leaves only a
        sidecar with nothing to send (cleaned up as an orphan), never a trace without its key."""
        entry.trace.unlink(missing_ok=True)
        entry.export.unlink(missing_ok=True)
        entry.memory_snapshot.unlink(missing_ok=True)
        entry.sidecar.unlink(missing_ok=True)

    def keep_uploaded(self, entry: Entry) -> Path:
        """Keep a delivered trace as a local copy under ``uploaded/`` (same layout, so
        ``tensorboard --logdir SPOOL/uploaded`` and ``stepdoctor analyze`` still read it).
        The trace moves first: a crash before the sidecar follows leaves a pending sidecar with
        no trace, which the next pass treats as delivered."""
        dest = self.root / UPLOADED_DIR / entry.directory.relative_to(self.root)
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(entry.trace, dest / entry.trace.name)
        entry.export.unlink(missing_ok=True)
        _move_snapshot(entry.directory, entry.stem, dest)
        os.replace(entry.sidecar, dest / entry.sidecar.name)
        return dest

    def uploaded_copies(self) -> list[Path]:
        """Local copies of delivered traces, oldest capture first."""
        found = list(self.root.glob(f"{UPLOADED_DIR}/*/*/*{TRACE_SUFFIX}"))
        return sorted(found, key=lambda p: (_stem_time(p.name), p.name))

    def usage(self) -> tuple[int, int]:
        """(bytes of traces not yet delivered, pending or failed; bytes of uploaded copies)."""
        unsent = copies = 0
        for path in self.root.rglob("*"):
            try:
                if not path.is_file():
                    continue
                size = path.stat().st_size
            except OSError:  # delivered or moved by another process meanwhile
                continue
            if path.relative_to(self.root).parts[0] == UPLOADED_DIR:
                copies += size
            else:
                unsent += size
        return unsent, copies

    def enforce_cap(self, max_bytes: int) -> tuple[int, int]:
        """Delete the oldest uploaded copies until the spool fits ``max_bytes``; never an unsent trace.

        Returns (copies deleted, bytes by which unsent traces alone still exceed the cap).
        """
        unsent, copies = self.usage()
        deleted = 0
        for trace in self.uploaded_copies():
            if unsent + copies <= max_bytes:
                break
            with contextlib.suppress(OSError):
                copies -= trace.stat().st_size
            stem = trace.name[: -len(TRACE_SUFFIX)]
            trace.unlink(missing_ok=True)
            copy = snapshot_path(trace.parent, stem)
            with contextlib.suppress(OSError):
                copies -= copy.stat().st_size
            copy.unlink(missing_ok=True)
            trace.with_name(stem + META_SUFFIX).unlink(missing_ok=True)
            deleted += 1
        for chunk in self.series_copies() if unsent + copies > max_bytes else []:
            if unsent + copies <= max_bytes:
                break
            with contextlib.suppress(OSError):
                copies -= chunk.stat().st_size
            chunk.unlink(missing_ok=True)
            deleted += 1
        return deleted, max(0, unsent - max_bytes)

    def move_failed(
        self, entry: Entry, reason: str, *, server: str | None = None, token: str | None = None
    ) -> Path:
        """Park a trace the server refused for good, with the reason next to it.

        ``server`` and a fingerprint of ``token`` (never the token) are recorded, so ``stepdoctor
        sync`` can tell whether the cause may be gone: another server, token or team (a token
        belongs to one team) deserves another try, the same ones would only be refused again.
        ``server=None`` marks a local problem (an unreadable sidecar) no credential can fix.
        """
        rel = entry.directory.relative_to(self.root)
        dest = self.root / FAILED_DIR / rel
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"{entry.stem}{REASON_SUFFIX}").write_text(reason.rstrip() + "\n")
        record = {"reason": reason, "server": server, "token": token_fingerprint(token), "at": time.time()}
        (dest / f"{entry.stem}{FAILURE_SUFFIX}").write_text(json.dumps(record) + "\n")
        for path in (entry.trace, entry.export):
            if path.exists():
                os.replace(path, dest / path.name)
        _move_snapshot(entry.directory, entry.stem, dest)
        os.replace(entry.sidecar, dest / entry.sidecar.name)
        return dest

    def park_snapshot(self, entry: Entry, reason: str) -> Path:
        """A snapshot the server refused while it took the trace: kept under ``failed/`` with the
        reason beside it (``<stem>.pickle.reason.txt``), the trace delivered as usual."""
        dest = self.root / FAILED_DIR / entry.directory.relative_to(self.root)
        _move_snapshot(entry.directory, entry.stem, dest)
        parked = snapshot_path(dest, entry.stem)
        parked.with_name(parked.name + REASON_SUFFIX).write_text(reason.rstrip() + "\n")
        return parked

    def failed(self) -> list[Failed]:
        """Traces parked in ``failed/``, oldest capture first, each with why and where it was refused."""
        found = []
        for sidecar in self.root.glob(f"{FAILED_DIR}/*/*/*{META_SUFFIX}"):
            stem = sidecar.name[: -len(META_SUFFIX)]
            meta = _read_json(sidecar)
            record = _read_json(sidecar.with_name(stem + FAILURE_SUFFIX))
            reason = str(record.get("reason") or "")
            if not reason:
                with contextlib.suppress(OSError):
                    reason = sidecar.with_name(stem + REASON_SUFFIX).read_text().strip()
            found.append(Failed(sidecar, meta, reason or "no reason recorded", record or None))
        return sorted(found, key=lambda f: (_stem_time(f.sidecar.name), f.sidecar.name))

    def requeue(self, failed: Failed) -> None:
        """Move one trace parked in ``failed/`` back into the spool, to be sent again."""
        sidecar = failed.sidecar
        dest = self.root / sidecar.parent.relative_to(self.root / FAILED_DIR)
        dest.mkdir(parents=True, exist_ok=True)
        if sidecar.name.endswith(SERIES_SUFFIX):  # a step-series chunk: no sidecar of its own
            os.replace(sidecar, dest / sidecar.name)
            for suffix in (REASON_SUFFIX, FAILURE_SUFFIX):
                sidecar.with_name(sidecar.name + suffix).unlink(missing_ok=True)
            return
        stem = sidecar.name[: -len(META_SUFFIX)]
        for suffix in (TRACE_SUFFIX, EXPORT_SUFFIX):
            source = sidecar.with_name(stem + suffix)
            if source.exists():
                os.replace(source, dest / source.name)
        _move_snapshot(sidecar.parent, stem, dest)
        os.replace(sidecar, dest / sidecar.name)  # the sidecar last: it commits the trace again
        for suffix in (REASON_SUFFIX, FAILURE_SUFFIX):
            sidecar.with_name(stem + suffix).unlink(missing_ok=True)

    def requeue_failed(self) -> int:
        """Move every trace parked in ``failed/`` back into the spool (``sync --retry-failed``)."""
        parked = self.failed() + self.failed_series()
        for failed in parked:
            self.requeue(failed)
        return len(parked)

    def cleanup_orphans(self) -> int:
        """Delete leftovers of captures whose process died before the commit point (this host only),
        memory snapshots of windows that never got their sidecar included."""
        removed = 0
        me = host_name()
        committed = {p.name[: -len(META_SUFFIX)] for p in self.root.glob(f"*/*/*{META_SUFFIX}")}
        for path in itertools.chain(self.root.glob("*/*/*"), self.root.glob(f"*/*/{SNAPSHOT_DIR}/*")):
            match = _STEM_RE.match(path.name)
            if not match or match.group("host") != me or not path.is_file():
                continue
            stem = f"{match.group('host')}_{match.group('pid')}.{match.group('ns')}"
            pid = int(match.group("pid"))
            # A committed stem's stray .partial is overwritten by the next compress; leave it.
            if stem not in committed and pid != os.getpid() and not pid_alive(pid):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    # --- step series ----------------------------------------------------------------------------

    def series_chunks(self) -> list[Path]:
        """Step-series chunks not yet delivered, by folder, process and sequence (their names)."""
        return sorted(self.root.glob(f"*/*/*{SERIES_SUFFIX}"))

    @contextlib.contextmanager
    def claim_series(self, chunk: Path) -> Iterator[bool]:
        """Exclusive handling of one chunk (another rank's agent or ``sync`` may share the spool)."""
        with self._locked(chunk) as fh:
            yield fh is not None

    @staticmethod
    def series_meta(chunk: Path) -> dict[str, Any]:
        """What routing a chunk needs: project and run (its folder), and the server and rank its
        header names (read without decompressing; absent when the header cannot be read)."""
        meta: dict[str, Any] = {"project": chunk.parent.parent.name, "run": chunk.parent.name}
        try:
            with open(chunk, "rb") as fh:
                start = fh.read(len(_SERIES_MAGIC) + 4)
                if start[: len(_SERIES_MAGIC)] == _SERIES_MAGIC and len(start) == len(_SERIES_MAGIC) + 4:
                    length = int.from_bytes(start[len(_SERIES_MAGIC) :], "little")
                    header = json.loads(fh.read(min(length, 1 << 20)))
                    if isinstance(header, dict):
                        meta.update({k: header.get(k) for k in ("server", "rank", "stream", "seq")})
        except (OSError, ValueError):
            pass
        return meta

    def keep_uploaded_series(self, chunk: Path) -> None:
        """Keep a delivered chunk under ``uploaded/`` beside the run's trace copies, so
        ``stepdoctor analyze SPOOL/uploaded/PROJECT/RUN`` still reads the whole series."""
        dest = self.root / UPLOADED_DIR / chunk.parent.relative_to(self.root)
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(chunk, dest / chunk.name)

    def move_failed_series(
        self, chunk: Path, reason: str, *, server: str | None = None, token: str | None = None
    ) -> Path:
        """Park a chunk the server refused for good, with the reason next to it (as a trace's)."""
        dest = self.root / FAILED_DIR / chunk.parent.relative_to(self.root)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"{chunk.name}{REASON_SUFFIX}").write_text(reason.rstrip() + "\n")
        record = {"reason": reason, "server": server, "token": token_fingerprint(token), "at": time.time()}
        (dest / f"{chunk.name}{FAILURE_SUFFIX}").write_text(json.dumps(record) + "\n")
        os.replace(chunk, dest / chunk.name)
        return dest

    def failed_series(self) -> list[Failed]:
        """Chunks parked in ``failed/``, each with why and where it was refused."""
        found = []
        for chunk in sorted(self.root.glob(f"{FAILED_DIR}/*/*/*{SERIES_SUFFIX}")):
            record = _read_json(chunk.with_name(chunk.name + FAILURE_SUFFIX))
            found.append(
                Failed(
                    chunk,
                    self.series_meta(chunk),
                    str(record.get("reason") or "no reason recorded"),
                    record or None,
                )
            )
        return found

    def series_copies(self) -> list[Path]:
        """Local copies of delivered chunks, oldest first."""
        found = list(self.root.glob(f"{UPLOADED_DIR}/*/*/*{SERIES_SUFFIX}"))
        return sorted(found, key=_mtime)

    def pending(self) -> tuple[int, int]:
        """(traces, bytes) waiting in the spool."""
        count = size = 0
        for sidecar in self.sidecars():
            count += 1
            stem = sidecar.name[: -len(META_SUFFIX)]
            for suffix in (TRACE_SUFFIX, EXPORT_SUFFIX):
                with contextlib.suppress(OSError):
                    size += (sidecar.parent / f"{stem}{suffix}").stat().st_size
                    break
        return count, size


@dataclass
class Failed:
    """A trace parked in ``failed/``: its sidecar, content, the reason, and the failure record
    (None for traces parked before records were kept)."""

    sidecar: Path
    meta: dict[str, Any]
    reason: str
    record: dict[str, Any] | None

    @property
    def name(self) -> str:
        """``PROJECT/RUN/STEM``, as a user finds it under ``failed/``."""
        name = self.sidecar.name
        stem = name if name.endswith(SERIES_SUFFIX) else name[: -len(META_SUFFIX)]
        return f"{self.sidecar.parent.parent.name}/{self.sidecar.parent.name}/{stem}"


def token_fingerprint(token: str | None) -> str | None:
    """A short digest telling tokens apart without keeping one on disk."""
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _stem_time(name: str) -> int:
    match = _STEM_RE.match(name)
    return int(match.group("ns")) if match else 0
