"""The trace store: original uploaded bytes on the local filesystem, keyed by a storage key.

An upload is streamed to ``<root>/tmp/<random>.part`` while it is hashed and counted, then renamed
atomically to its final key just before the database row is committed; if the commit fails the
file is deleted again. So the store never holds a half-written trace under a final key, and a
rejected upload leaves nothing at all.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import anyio.to_thread

from stepdoctor_server.errors import ApiError

# Blocking work (write, hash, inspect) runs in a worker thread once per batch, not per ASGI chunk.
WRITE_BATCH_BYTES = 1 << 20
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*\.[a-z.]+$")


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


class TraceStore:
    """Files under ``root``; ``path(storage_key)`` is where a committed trace lives."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.temp_dir = self.root / "tmp"

    def path(self, storage_key: str) -> Path:
        if not _KEY_RE.match(storage_key):
            raise ValueError(f"invalid storage key {storage_key!r}")
        return self.root / storage_key

    @staticmethod
    def new_key(team_id: int, suffix: str) -> str:
        """A fresh key, partitioned by team and month so directories stay small."""
        now = datetime.now(timezone.utc)
        return f"team{team_id}/{now:%Y-%m}/{uuid.uuid4().hex}{suffix}"

    async def receive(
        self,
        chunks: AsyncIterator[bytes],
        *,
        max_bytes: int,
        inspect: Callable[[bytes], None] | None = None,
    ) -> StagedFile:
        """Stream ``chunks`` to a temp file while hashing; over ``max_bytes`` -> 413, nothing kept.

        ``inspect`` sees every byte in order (body validation) and may raise ApiError to abort.
        """
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        path = self.temp_dir / f"{uuid.uuid4().hex}.part"
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

    def commit(self, staged: StagedFile, storage_key: str) -> Path:
        """Atomically move a staged upload to its final key (same filesystem, so rename is atomic)."""
        final = self.path(storage_key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.temp_path, final)
        return final

    def discard(self, staged: StagedFile) -> None:
        staged.temp_path.unlink(missing_ok=True)

    def delete(self, storage_key: str) -> None:
        self.path(storage_key).unlink(missing_ok=True)

    def list_files(self) -> list[Path]:
        """Every file under the root, temp files included (used by checks that nothing leaked)."""
        if not self.root.exists():
            return []
        return sorted(p.relative_to(self.root) for p in self.root.rglob("*") if p.is_file())


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
