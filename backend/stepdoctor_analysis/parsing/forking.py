"""The second parser's process, forked before the parser is imported (``forked`` parses).

Standard library only: ``start_trace`` forks at once, and each process then imports numpy and the
parser itself, the parent with the analysis after them, so the child's imports run beside the
parent's instead of before the fork (``cli.analyze`` forks first thing).
Only forked on Linux, from a process without other threads (a fork copies no thread, and a lock
another thread held would stay held in the child) but those marked ``FORK_SAFE``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .reading import DEFAULT_MAX_BYTES

if TYPE_CHECKING:
    from .columns import Builder

if sys.platform == "linux":  # ``usable`` forks only there
    import fcntl

# Below this many bytes on disk the fork, the pipe and the merge cost more than the second core saves.
MIN_FILE_BYTES = 1 << 20
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
        self.mine = k
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
        self.of = (path, cap, label, source)  # what ``loading.load_trace`` checks it was started for
        self.shares = (0, 0)
        self.pid: int | None = None
        self.claims = _Claims()
        self.columns = os.memfd_create("stepdoctor-child-columns")  # the child's arrays, shared
        self.read_end, write_end = os.pipe()
        try:
            # A 1 MiB pipe (Linux's default cap): the child's state crosses in fewer writes.
            with contextlib.suppress(OSError):
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 20)
            pid = os.fork()
            if pid == 0:  # the child: never returns; an error is an empty pipe, and the parent
                code = 1  # then parses the file alone
                try:
                    os.close(self.read_end)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    from .forked import run_child  # the parser's imports, beside the parent's

                    run_child(self.of, write_end, self.columns, self._theirs)
                    code = 0
                finally:
                    os._exit(code)
        except BaseException:
            self._close()
            raise
        finally:
            os.close(write_end)
        self.pid = pid

    def _theirs(self, k: int) -> bool:
        """Chunk ``k`` is the other process's to decode (this one skips it)."""
        return not self.claims.claim(k)

    def finish(self) -> Builder | None:
        """The trace's builder with every chunk absorbed, or None: parse the file alone instead."""
        if self.pid is None:
            return None  # cancelled, or finished already
        from .forked import collect, joined

        try:
            got = collect(self.of, self._theirs, self.read_end, self.columns)
        finally:
            self.cancel()
        if got is None:
            return None
        b, marks, theirs = got
        self.shares = (len(marks), len(theirs["marks"]))
        return joined(b, marks, theirs)

    def cancel(self) -> None:
        """End the child (done or no longer wanted) and collect it; nothing once it is collected."""
        if self.pid is None:
            return
        self._close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = None

    def _close(self) -> None:
        os.close(self.read_end)
        os.close(self.columns)  # a mapping of it lives on while arrays use it
        self.claims.close()


def start(path: Path, cap: int, label: str, source: str) -> Started | None:
    """A child parsing ``path`` from now on, where forking pays (``usable``) and works: a fork
    refused (no memory, too many processes) leaves the file to one process, not an error."""
    if not usable(path):
        return None
    try:
        return Started(path, cap, label, source)
    except OSError:
        return None


def start_trace(path: str | Path, *, max_bytes: int | None = None) -> Started | None:
    """Fork the second parser of a trace file now, where that pays (``start``), so that
    what the caller does before ``load_trace(path, started=...)`` overlaps the child's parse
    (``cli.analyze`` imports the analysis meanwhile). The caller cancels it if it never loads."""
    p = Path(path)
    if not p.is_file():
        return None
    cap = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    return start(p, cap, p.name, str(p))
