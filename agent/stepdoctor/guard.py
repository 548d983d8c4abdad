"""Keep the agent's own failures out of the training loop.

Every entry point the training thread (or the worker thread) calls goes through :func:`guarded`:
an agent bug is logged once per call site and swallowed, because a profiler must never be the
reason a week-long training job dies. Tests set ``STEPDOCTOR_RAISE_ERRORS=1`` (or
:data:`RAISE_ERRORS`) so the same bugs fail loudly instead of hiding.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

logger = logging.getLogger("stepdoctor")

F = TypeVar("F", bound=Callable[..., Any])

#: Set to True (or export STEPDOCTOR_RAISE_ERRORS=1) to re-raise agent errors instead of swallowing them.
RAISE_ERRORS: bool = False

_reported: set[str] = set()
_reported_lock = threading.Lock()


def raise_errors() -> bool:
    """Whether agent errors should propagate (tests), read live so a test can flip it."""
    return RAISE_ERRORS or os.environ.get("STEPDOCTOR_RAISE_ERRORS", "") not in ("", "0", "false", "False")


def log_once(key: str, level: int, message: str, *args: object, exc_info: bool = False) -> None:
    """Log ``message`` the first time ``key`` is seen in this process, so a failure repeated every
    step does not flood the training log."""
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
    logger.log(level, message, *args, exc_info=exc_info)


def say(message: str, key: str | None = None) -> None:
    """One line on stderr, whatever the logging setup: what a user must see (where the traces
    went, a spool over its cap) should not depend on the script configuring ``logging``.
    With ``key``, only the first call per process prints."""
    if key is not None:
        with _reported_lock:
            if key in _reported:
                return
            _reported.add(key)
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # closed or missing stderr (daemons, pythonw)
        logger.warning("%s", message)


def reset_reported() -> None:
    """Forget which errors were reported (after fork, and for tests)."""
    with _reported_lock:
        _reported.clear()


def guarded(default: Any = None) -> Callable[[F], F]:
    """Decorate an agent internal so any exception is logged once and ``default`` is returned."""

    def decorate(fn: F) -> F:
        where = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if raise_errors():
                    raise
                log_once(
                    f"error:{where}:{type(exc).__name__}",
                    logging.WARNING,
                    "stepdoctor: internal error in %s (training continues): %s: %s",
                    where,
                    type(exc).__name__,
                    exc,
                    exc_info=True,
                )
                return default

        return cast(F, wrapper)

    return decorate


def _after_fork_in_child() -> None:
    """A lock held by another thread at fork time stays locked forever in the child: replace it."""
    global _reported_lock
    _reported_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
