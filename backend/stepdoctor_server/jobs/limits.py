"""Run one analysis in a child process under a time limit and a memory limit.

A trace can make the engine run for an hour or allocate more than the machine has; neither may
take its worker down nor hang it. The child is forked from a forkserver that imported the engine
once (so a job pays milliseconds, not an import), sets ``RLIMIT_DATA`` on itself, and sends back
either the result or a one-line reason. The parent kills it at the deadline. Every way a child
can end maps to a reason users read, e.g. "analysis exceeded the time limit of 600 s".

``RLIMIT_DATA`` (heap and private anonymous mappings, Linux >= 4.7) rather than ``RLIMIT_AS``:
address space counts what malloc arenas and thread stacks merely reserve, so the same limit
failed or passed a trace depending on the process's history; data is what the job really uses.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from stepdoctor_server.core.errors import TransientError

log = logging.getLogger("stepdoctor.limits")

# Imported once in the forkserver, so each job's child starts with the engine loaded (and the module
# of the first job's function: ``_ctx(fn)``).
_PRELOAD = ["stepdoctor_analysis.pipeline", "stepdoctor_analysis.parsing"]
_context: Any = None


class JobFailed(Exception):
    """The job failed; ``str(exc)`` is the one-line reason to store. ``transient``: it failed
    because something it needs (the trace store) was unreachable, so it is worth trying again."""

    def __init__(
        self, reason: str, *, internal: bool = False, details: str = "", transient: bool = False
    ) -> None:
        super().__init__(reason)
        self.internal = internal
        self.details = details
        self.transient = transient


def _ctx(fn: Callable[..., Any] | None = None) -> Any:
    global _context
    if _context is None:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        _context = multiprocessing.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload([*([fn.__module__] if fn is not None else []), *_PRELOAD])
    return _context


def run_limited(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    timeout_s: float,
    memory_bytes: int,
    describe_error: Callable[[BaseException], tuple[str, bool]],
) -> Any:
    """``fn(*args)`` in a child; its return value, or JobFailed with the reason.

    ``describe_error(exc)`` turns an exception raised in the child into (reason, internal).
    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    ctx = _ctx(fn)
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_child_main, args=(sender, fn, args, memory_bytes, describe_error), name="stepdoctor-job"
    )
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise JobFailed(f"analysis exceeded the time limit of {timeout_s:g} s (STEPDOCTOR_JOB_TIMEOUT_S)")
        try:
            outcome = receiver.recv()
        except EOFError:  # the child died without a word: killed (OOM killer) or crashed
            child.join(5)
            raise JobFailed(_death_reason(child.exitcode), internal=True) from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        receiver.close()
    kind, payload, details = outcome
    if kind == "ok":
        return payload
    raise JobFailed(payload, internal=kind == "internal", details=details, transient=kind == "transient")


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (ours counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        hint = " (out of memory?)" if -exitcode == signal.SIGKILL else ""
        return f"internal error: the analysis process was killed by {name}{hint}"
    return f"internal error: the analysis process exited with status {exitcode} without a result"


def memory_reason(memory_bytes: int) -> str:
    return (
        f"analysis exceeded the memory limit of {memory_bytes / 2**20:,.0f} MiB "
        "(STEPDOCTOR_JOB_MEMORY_LIMIT_BYTES)"
    )


def _child_main(
    sender: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    memory_bytes: int,
    describe_error: Callable[[BaseException], tuple[str, bool]],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when a job stops
    if memory_bytes > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        outcome: tuple[str, Any, str] = ("ok", fn(*args), "")
    except MemoryError:
        outcome = ("failed", memory_reason(memory_bytes), "")
    except BaseException as exc:
        reason, internal = describe_error(exc)
        kind = "transient" if isinstance(exc, TransientError) else "internal" if internal else "failed"
        outcome = (kind, reason, traceback.format_exc() if internal else "")
    try:
        sender.send(outcome)
    except MemoryError:  # the result itself did not fit: say so in a few bytes
        sender.send(("failed", memory_reason(memory_bytes), ""))
    finally:
        sender.close()
    os._exit(0)  # skip interpreter teardown (atexit hooks of libraries inherited from the server)
