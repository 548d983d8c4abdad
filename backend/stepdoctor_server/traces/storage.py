"""The trace store: original uploaded bytes behind one interface, on a local directory or S3.

``TraceStore`` is what the API and the workers see: ``receive`` (stage an upload), ``commit`` (make
it durable under its storage key), ``open`` (a streaming binary reader), ``delete``, ``exists`` and
``download`` (an HTTP response: the file, a stream, or a presigned redirect). Two backends:

- ``LocalStore`` (the embedded default, ``STEPDOCTOR_DATA_DIR/traces``): only the hosts that mount
  that directory can read traces.
- ``S3Store`` (``STEPDOCTOR_STORAGE_URL=s3://bucket/prefix`` plus the standard ``AWS_*`` variables,
  ``AWS_ENDPOINT_URL`` included): any worker on any machine streams traces from the bucket.
  The client is obstore (Rust ``object_store``), chosen by ``bench/storage_clients.py`` against
  SeaweedFS: it streamed a 35 MB trace 1.6x faster than boto3 and s3fs, did small puts and gets
  2.8-4x faster, and imports in 9 ms (boto3 245 ms, s3fs 765 ms); large puts were on par.

An upload is always staged first to ``<temp_dir>/<pid>-<random>.part`` while it is hashed, counted
and inspected; ``commit`` then renames it (local) or uploads it (S3) just before the database row
commits, and the rollback hook deletes it again if that commit fails. So the store never holds a
half-written trace under a final key, and a rejected upload leaves nothing at all. Stage files of
a crashed process are removed by ``cleanup_partials`` (at start and periodically).
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any, BinaryIO

import anyio.to_thread
from starlette.responses import FileResponse, RedirectResponse, Response, StreamingResponse

from stepdoctor_server.core.errors import ApiError, TransientError
from stepdoctor_server.jobs.limits import process_alive

log = logging.getLogger("stepdoctor.storage")

# Blocking work (write, hash, inspect) runs in a worker thread once per batch, not per ASGI chunk.
WRITE_BATCH_BYTES = 1 << 20
READ_CHUNK = 1 << 20
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*\.[a-z.]+$")
_PART_RE = re.compile(r"^(?:(\d+)-)?[0-9a-f]{32}\.part$")
# A stage file nobody wrote to for this long belongs to a dead upload (a live one writes every MiB).
PARTIAL_MAX_IDLE_S = 15 * 60
# obstore retries a failed request 10 times for up to 3 min by default: an upload would hang that
# long on a store that is down. A few quick retries ride out a blip; an outage is reported (503,
# or the analysis retried later with backoff) within seconds.
S3_RETRY = {"max_retries": 3, "retry_timeout": timedelta(seconds=10)}
S3_CLIENT_TIMEOUTS = {"connect_timeout": "3s", "timeout": "120s"}
_PROBE_KEY = "stepdoctor-readiness-probe"  # never written: a 404 for it means the store answers
# Errors that mean the directory store itself is unreachable (a network mount gone), not a bad key.
_UNREACHABLE_ERRNOS = frozenset(
    {errno.EIO, errno.ENOTCONN, errno.ESTALE, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ETIMEDOUT}
)


class StoreUnavailable(TransientError):
    """The trace store cannot be reached now (S3 down, a network mount gone)."""

    def __init__(self) -> None:
        super().__init__("the trace store is unreachable")


@contextmanager
def _reachable(what: str, where: str, unreachable: Callable[[BaseException], bool]) -> Iterator[None]:
    """Turn an error that means the store cannot be reached into StoreUnavailable (a missing key
    stays FileNotFoundError), logging the details (endpoint, bucket, key: for operators only)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as exc:
        if not unreachable(exc):
            raise
        log.warning(
            "trace store unreachable: %s %s: %s", what, where, (str(exc).splitlines() or [""])[0][:500]
        )
        raise StoreUnavailable() from exc


def _unreachable_directory(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS


def _unreachable_s3(exc: BaseException) -> bool:
    """Any obstore error but a missing key: connection refused or timed out, 5xx after retries,
    refused credentials. Each is the store's (or its configuration's) trouble, never the trace's."""
    from obstore.exceptions import BaseError, NotFoundError

    return isinstance(exc, BaseError) and not isinstance(exc, NotFoundError)


@dataclass
class StagedFile:
    """A fully received upload under a temporary name, not yet part of the store."""

    temp_path: Path
    size_bytes: int
    sha256: str


@dataclass
class _Sink:
    """Accumulates one upload: the open temp file, the running hash and byte count."""

    handle: IO[bytes]
    path: Path
    inspect: Callable[[bytes], None] | None
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    size: int = 0

    def write(self, data: bytes) -> None:
        self.digest.update(data)
        self.handle.write(data)
        if self.inspect is not None:
            self.inspect(data)


def check_key(storage_key: str) -> str:
    if not _KEY_RE.match(storage_key):
        raise ValueError(f"invalid storage key {storage_key!r}")
    return storage_key


class TraceStore(ABC):
    """Where committed traces live; uploads are staged under ``temp_dir`` on this host first."""

    temp_dir: Path

    @staticmethod
    def new_key(team_id: int, suffix: str) -> str:
        """A fresh key, partitioned by team and month so directories stay small."""
        now = datetime.now(timezone.utc)
        return f"team{team_id}/{now:%Y-%m}/{uuid.uuid4().hex}{suffix}"

    @property
    @abstractmethod
    def description(self) -> str:
        """Where traces go, for start-up messages."""

    @abstractmethod
    def commit(self, staged: StagedFile, storage_key: str) -> None:
        """Make a staged upload durable under ``storage_key`` (the stage file is consumed)."""

    @abstractmethod
    def open(self, storage_key: str) -> BinaryIO:
        """A streaming reader of a committed trace; FileNotFoundError if it is missing."""

    @abstractmethod
    def delete(self, storage_key: str) -> None:
        """Remove a trace; a missing one is not an error."""

    @abstractmethod
    def exists(self, storage_key: str) -> bool: ...

    @abstractmethod
    def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers now (``/readyz``)."""

    @abstractmethod
    def download(
        self, storage_key: str, *, filename: str, media_type: str, headers: dict[str, str]
    ) -> Response:
        """An HTTP response carrying the original bytes (the caller checked ``exists``)."""

    async def receive(
        self,
        chunks: AsyncIterator[bytes],
        *,
        max_bytes: int,
        inspect: Callable[[bytes], None] | None = None,
    ) -> StagedFile:
        """Stream ``chunks`` to a stage file while hashing; over ``max_bytes`` -> 413, nothing kept.

        ``inspect`` sees every byte in order (body validation) and may raise ApiError to abort.
        """
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        path = self.temp_dir / f"{os.getpid()}-{uuid.uuid4().hex}.part"
        handle = await anyio.to_thread.run_sync(path.open, "wb")
        sink = _Sink(handle=handle, path=path, inspect=inspect)
        try:
            pending: list[bytes] = []
            pending_size = 0
            async for chunk in chunks:
                if not chunk:
                    continue
                sink.size += len(chunk)
                if sink.size > max_bytes:
                    raise too_large(max_bytes)
                pending.append(chunk)
                pending_size += len(chunk)
                if pending_size >= WRITE_BATCH_BYTES:
                    await anyio.to_thread.run_sync(sink.write, b"".join(pending))
                    pending, pending_size = [], 0
            if pending:
                await anyio.to_thread.run_sync(sink.write, b"".join(pending))
            await anyio.to_thread.run_sync(_close, handle)
        except BaseException as exc:
            handle.close()
            path.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ApiError(507, "insufficient_storage", "the trace store is out of disk space") from None
            raise
        return StagedFile(temp_path=path, size_bytes=sink.size, sha256=sink.digest.hexdigest())

    def discard(self, staged: StagedFile) -> None:
        staged.temp_path.unlink(missing_ok=True)

    def source(self, storage_key: str) -> Path | StoredObject:
        """Something with ``open("rb")`` for a committed trace (the zip export reads it lazily)."""
        return StoredObject(self, check_key(storage_key))

    @contextmanager
    def local_copy(self, storage_key: str) -> Iterator[Path]:
        """The trace as a local file, for code that needs a path (HTA, trimming): a temporary copy
        here, the file itself in ``LocalStore``."""
        suffix = ".json.gz" if storage_key.endswith(".gz") else ".json"
        with tempfile.TemporaryDirectory(prefix="stepdoctor-copy-") as tmp:
            path = Path(tmp) / f"trace{suffix}"
            with self.open(storage_key) as src, path.open("wb") as dst:
                shutil.copyfileobj(src, dst, READ_CHUNK)
            yield path

    def cleanup_partials(self, *, max_idle_s: float = PARTIAL_MAX_IDLE_S) -> int:
        """Delete stage files left by crashed uploads; returns how many.

        A file is abandoned when the process that wrote it (pid in its name) no longer exists on
        this host, or when nothing wrote to it for ``max_idle_s`` (a live upload writes every MiB).
        """
        if not self.temp_dir.is_dir():
            return 0
        removed = 0
        now = time.time()
        for path in self.temp_dir.iterdir():
            match = _PART_RE.match(path.name)
            if match is None:
                continue
            try:
                idle = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
            writer = int(match.group(1)) if match.group(1) else None
            if idle > max_idle_s or (writer is not None and not process_alive(writer)):
                path.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("removed %d partial upload(s) left by crashed uploads in %s", removed, self.temp_dir)
        return removed


class LocalStore(TraceStore):
    """Files under ``root``; ``path(storage_key)`` is where a committed trace lives."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.temp_dir = self.root / "tmp"

    @property
    def description(self) -> str:
        return str(self.root)

    def path(self, storage_key: str) -> Path:
        return self.root / check_key(storage_key)

    def commit(self, staged: StagedFile, storage_key: str) -> None:
        """Atomically move a staged upload to its final key (same filesystem, so rename is atomic)."""
        final = self.path(storage_key)
        with _reachable("commit", str(final), _unreachable_directory):
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged.temp_path, final)

    def open(self, storage_key: str) -> BinaryIO:
        path = self.path(storage_key)
        with _reachable("open", str(path), _unreachable_directory):
            return path.open("rb")

    def delete(self, storage_key: str) -> None:
        self.path(storage_key).unlink(missing_ok=True)

    def exists(self, storage_key: str) -> bool:
        path = self.path(storage_key)
        with _reachable("stat", str(path), _unreachable_directory):
            return path.is_file()

    def ping(self) -> None:
        with _reachable("stat", str(self.root), lambda exc: isinstance(exc, OSError)):
            if self.root.exists() and not self.root.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.root))

    def source(self, storage_key: str) -> Path | StoredObject:
        return self.path(storage_key)

    @contextmanager
    def local_copy(self, storage_key: str) -> Iterator[Path]:
        yield self.path(storage_key)

    def download(
        self, storage_key: str, *, filename: str, media_type: str, headers: dict[str, str]
    ) -> Response:
        return FileResponse(self.path(storage_key), media_type=media_type, filename=filename, headers=headers)

    def list_files(self) -> list[Path]:
        """Every file under the root, temp files included (used by checks that nothing leaked)."""
        if not self.root.exists():
            return []
        return sorted(p.relative_to(self.root) for p in self.root.rglob("*") if p.is_file())


class S3Store(TraceStore):
    """Objects under ``s3://bucket/prefix`` through obstore; stage files stay on this host.

    Credentials, region and endpoint come from the standard ``AWS_*`` environment variables
    (``AWS_ENDPOINT_URL`` for S3-compatible servers; plain ``http://`` endpoints are allowed).
    ``presign`` makes downloads a 307 redirect to a presigned URL instead of a stream through
    the API: less load on the API, but the browser must reach the object store's endpoint.
    """

    def __init__(self, url: str, temp_dir: Path, *, presign: bool = False) -> None:
        from obstore.store import S3Store as _Client

        if not url.startswith("s3://") or len(url) <= len("s3://"):
            raise ValueError(f"storage URL must look like s3://bucket/prefix, not {url!r}")
        self.url = url.rstrip("/")
        self.temp_dir = Path(temp_dir)
        self.presign = presign
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
        if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
            config["region"] = "us-east-1"
        client_options = {"allow_http": endpoint.startswith("http://"), **S3_CLIENT_TIMEOUTS}
        self.client = _Client.from_url(
            self.url,
            config=config,  # type: ignore[arg-type]
            client_options=client_options,  # type: ignore[arg-type]
            retry_config=S3_RETRY,  # type: ignore[arg-type]
        )

    @property
    def description(self) -> str:
        return self.url

    def _reachable(self, what: str, storage_key: str) -> Any:
        return _reachable(what, f"{self.url}/{storage_key}", _unreachable_s3)

    def commit(self, staged: StagedFile, storage_key: str) -> None:
        import obstore

        with self._reachable("put", storage_key):  # a failed multipart upload leaves no object
            obstore.put(self.client, check_key(storage_key), staged.temp_path)  # multipart when large
        staged.temp_path.unlink(missing_ok=True)

    def open(self, storage_key: str) -> BinaryIO:
        import obstore

        # One GET streamed in >= 1 MiB chunks: 2.7x faster than obstore's ranged reader, which
        # issues a request per buffer (bench/storage_clients.py).
        with self._reachable("get", storage_key):
            result = obstore.get(self.client, check_key(storage_key))
            stream = result.stream(min_chunk_size=READ_CHUNK)
        reader = _ObjectReader(stream, result.meta["size"], lambda: self._reachable("read", storage_key))
        return io.BufferedReader(reader, buffer_size=READ_CHUNK)

    def delete(self, storage_key: str) -> None:
        import obstore

        with suppress(FileNotFoundError), self._reachable("delete", storage_key):
            obstore.delete(self.client, check_key(storage_key))

    def exists(self, storage_key: str) -> bool:
        import obstore

        try:
            with self._reachable("head", storage_key):
                obstore.head(self.client, check_key(storage_key))
        except FileNotFoundError:
            return False
        return True

    def ping(self) -> None:
        import obstore

        with suppress(FileNotFoundError), self._reachable("head", _PROBE_KEY):
            obstore.head(self.client, _PROBE_KEY)  # a missing object: the store answered

    def download(
        self, storage_key: str, *, filename: str, media_type: str, headers: dict[str, str]
    ) -> Response:
        import obstore

        if self.presign:
            url = obstore.sign(self.client, "GET", check_key(storage_key), timedelta(minutes=15))
            return RedirectResponse(url, status_code=307, headers=headers)
        reader = self.open(storage_key)
        size = reader.raw.size  # type: ignore[attr-defined]
        return StreamingResponse(
            _chunks(reader),
            media_type=media_type,
            headers={
                **headers,
                "Content-Length": str(size),
                "Content-Disposition": f'attachment; filename="{filename}"',
            },
        )

    def list_keys(self) -> list[str]:
        """Every committed key (tests check that nothing leaked)."""
        import obstore

        return sorted(meta["path"] for batch in obstore.list(self.client) for meta in batch)


@dataclass(frozen=True)
class StoredObject:
    """A committed trace opened on demand, like a ``Path`` (``open("rb")``, ``name``)."""

    store: TraceStore
    key: str

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def open(self, mode: str = "rb") -> BinaryIO:
        if mode != "rb":
            raise ValueError("stored traces are read-only")
        return self.store.open(self.key)


class _ObjectReader(io.RawIOBase):
    """obstore's chunk stream of one GET (its own buffer type) as standard raw binary I/O.

    ``guard()`` wraps each chunk fetched: a connection lost mid-stream is StoreUnavailable too.
    """

    def __init__(self, chunks: Any, size: int, guard: Callable[[], Any]) -> None:
        self._chunks = iter(chunks)
        self._current = memoryview(b"")
        self.size = size  # the parser sizes its buffers by it
        self._guard = guard

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._current:
            with self._guard():
                chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._current = memoryview(chunk).cast("B")
        n = min(len(buffer), len(self._current))
        buffer[:n] = self._current[:n]
        self._current = self._current[n:]
        return n

    def close(self) -> None:
        self._chunks = iter(())  # drop the connection's remaining body
        self._current = memoryview(b"")
        super().close()


def _chunks(reader: BinaryIO) -> Iterator[bytes]:
    """Yield a reader's bytes (Starlette iterates a sync iterator in its threadpool); close at the end."""
    with reader:
        while chunk := reader.read(READ_CHUNK):
            yield chunk


def make_store(settings: Any) -> TraceStore:
    """The store ``settings.storage_url`` names: empty for the local directory, ``s3://`` for S3."""
    url = (settings.storage_url or "").strip()
    if not url:
        return LocalStore(settings.traces_dir)
    return S3Store(url, settings.traces_dir / "tmp", presign=settings.storage_presign_downloads)


def _close(handle: IO[bytes]) -> None:
    """Flush to disk before the rename so a crash cannot leave a committed row over a short file."""
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()


def too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        "payload_too_large",
        f"upload exceeds the size limit of {max_bytes} bytes (STEPDOCTOR_MAX_UPLOAD_BYTES)",
    )
