"""Background delivery: compress and upload spooled traces off the training thread.

One daemon thread per process sleeps on an event; the training thread only sets that event after
committing a capture, so ``prof.step()`` never waits on gzip or the network. The thread walks the
spool on each wake-up, so leftovers of earlier runs (same server) are delivered too. Failures back
off exponentially with jitter under one shared clock (a down server is down for every trace),
``Retry-After`` is honoured, and a final rejection parks the trace in ``failed/``. The step
series' chunks (``stepdoctor.series``, woken by its writer) go the same way after the traces.

A flush (leaving ``profile()``) is a time budget, never a wait for the network: it ends as soon as
the server cannot be reached (a refused connection is known at once) or its next try would fall
after the budget, and any request still running is cut at the budget's end.

Shaped after sentry-python's BackgroundWorker (pid-checked lazy thread, flush with a time budget)
and OpenTelemetry's BatchProcessor (event-woken daemon, re-initialised after fork), but unlike
either it never drops work: the spool is the queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import stepdoctor.transport as transport
from stepdoctor.config import Delivery
from stepdoctor.guard import guarded, log_once, logger, say
from stepdoctor.spool import Entry, Spool

#: A pass without a trace to handle checks the spool cap at most this often (seconds).
CAP_EVERY_S = 30.0
#: Maps a trace's sidecar to (server, token) to send it to, or None to leave it in the spool.
Router = Callable[[dict[str, Any]], tuple[str, str | None] | None]


@dataclass
class Stats:
    delivered: int = 0
    rejected: int = 0
    retries: int = 0
    last_error: str = ""
    pruned: int = 0  # uploaded copies deleted to keep the spool under its cap
    unreachable: bool = False  # the last try got no connection at all (refused, unreachable, DNS)
    sending: bool = False  # a request is in flight (at exit: cut off by the flush budget)
    delivered_keys: list[str] = field(default_factory=list)
    series_delivered: int = 0  # step-series chunks (stepdoctor.series) the server stored
    series_rejected: int = 0
    series_unsupported: bool = False  # a server without the series endpoint (older): chunks stay
    snapshots: int = 0  # memory snapshots (stepdoctor.memory_snapshot) sent after their traces


class Backoff:
    """Exponential backoff with jitter; a server's Retry-After overrides the computed delay."""

    def __init__(self, base: float, cap: float, retry_after_cap: float) -> None:
        self.base, self.cap, self.retry_after_cap = base, cap, retry_after_cap
        self.failures = 0
        self.not_before = 0.0

    def failed(self, retry_after: float | None, now: float) -> float:
        self.failures += 1
        computed = min(self.cap, self.base * 2 ** (self.failures - 1)) * random.uniform(0.5, 1.0)
        delay = computed if retry_after is None else min(retry_after, self.retry_after_cap)
        self.not_before = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.not_before = 0.0


class DeliveryWorker:
    """Owns the delivery thread of one process for one spool."""

    def __init__(
        self, spool: Spool, router: Router | None, delivery: Delivery, *, cleanup: bool = False
    ) -> None:
        self.spool = spool
        self.cleanup = cleanup
        self.router = router
        self.delivery = delivery
        self.stats = Stats()
        self._backoff = Backoff(delivery.backoff_base, delivery.backoff_max, delivery.retry_after_max)
        self._cap_checked = -float("inf")
        self._no_series: set[str] = set()  # servers without the series endpoint (older ones): chunks stay
        self._init_state()

    def _init_state(self) -> None:
        """Thread state, bound to the creating process: in a forked child (a DataLoader worker)
        ``notify``/``flush`` see another pid and do nothing, so a child never uploads or blocks."""
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._requested = 0  # bumped by notify(); a pass started after bump n covers it
        self._covered = -1
        self._remaining = 1
        self._flush_deadline: float | None = None
        self._pass_deadline: float | None = None

    # --- called from the training thread -----------------------------------------------------

    @guarded()
    def notify(self) -> None:
        """A capture was committed (or a flush wants a pass): wake the thread, never block."""
        if os.getpid() != self._pid:
            return
        self._ensure_thread()
        with self._cond:
            self._requested += 1
        self._wake.set()

    @guarded(default=False)
    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until everything deliverable is delivered; True if it was."""
        if os.getpid() != self._pid:
            return False
        self._ensure_thread()
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._requested += 1
            wanted = self._requested
            self._flush_deadline = deadline
            if self.stats.unreachable:
                # The last chance to send: a server that was down may be back, and trying costs
                # nothing when it is not (refused at once, or cut at the deadline).
                self._backoff.not_before = 0.0
        self._wake.set()
        try:
            with self._cond:
                while True:
                    if self._covered >= wanted:
                        if self._remaining == 0:
                            return True
                        if self._out_of_reach(deadline):
                            return False
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._alive():
                        return False
                    self._cond.wait(min(left, 0.5))
        finally:
            with self._cond:
                self._flush_deadline = None

    def close(self, timeout: float) -> bool:
        """Flush within ``timeout``, then stop the thread (a daemon, so exit never hangs on it)."""
        done = self.flush(timeout)
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(0.2)
        return bool(done)

    # --- the thread ---------------------------------------------------------------------------

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _ensure_thread(self) -> None:
        if self._alive() or self._stopping:
            return
        with self._cond:
            if self._alive():
                return
            self._thread = threading.Thread(target=self._run, name="stepdoctor-delivery", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        _lower_thread_priority()
        if self.cleanup:
            self._cleanup()
        while not self._stopping:
            self._wake.clear()  # before reading the request count: a notify from now on wakes us again
            with self._cond:
                wanted = self._requested
            remaining = self._pass_safely()
            with self._cond:
                self._covered = max(self._covered, wanted)
                self._remaining = remaining
                self._cond.notify_all()
            if self._stopping:
                break
            self._wake.wait(self._sleep_for(remaining))

    def _out_of_reach(self, deadline: float) -> bool:
        """After a pass, whether waiting longer cannot help: the server was not reachable at all, or
        the next try (backoff, ``Retry-After``) comes after ``deadline``."""
        if not self._backoff.failures:
            return False
        return self.stats.unreachable or self._backoff.not_before >= deadline

    def backoff_wait(self) -> float:
        """Seconds until the next attempt is allowed (0 when not backing off)."""
        return max(0.0, self._backoff.not_before - time.monotonic())

    def _sleep_for(self, remaining: int) -> float | None:
        if remaining == 0:
            return None
        return max(0.05, self._backoff.not_before - time.monotonic()) if self._backoff.failures else 1.0

    @guarded()
    def _cleanup(self) -> None:
        self.spool.cleanup_orphans()

    @guarded(default=1)
    def _pass_safely(self) -> int:
        return self.run_pass()

    def run_pass(self, deadline: float | None = None) -> int:
        """Compress and send everything claimable; returns how many traces still await delivery.

        With ``deadline`` (``time.monotonic()``, ``stepdoctor sync --timeout``), no request runs past it
        and none starts after it."""
        self._pass_deadline = deadline
        remaining = handled = 0
        for sidecar in self.spool.sidecars():
            if self._stopping and self._flush_deadline is None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                remaining += 1
                continue
            with self.spool.claim(sidecar) as entry:
                if entry is None:
                    continue  # another process (rank, sync) is handling it
                handled += 1
                remaining += int(not self._handle_safely(entry))
        remaining += self._series_pass(deadline)
        # Walking the spool costs a stat per file: a pass woken only by a series chunk (every few
        # seconds, all run long) checks the cap at most every CAP_EVERY_S.
        if handled or time.monotonic() - self._cap_checked >= CAP_EVERY_S:
            self._cap_checked = time.monotonic()
            self._enforce_cap()
        return remaining

    def _series_pass(self, deadline: float | None) -> int:
        """Ship the step-series chunks like the traces (same route, backoff and ``failed/``); returns
        how many still await delivery. After the traces: a chunk is small and can wait a pass."""
        remaining = 0
        for chunk in self.spool.series_chunks():
            if self._stopping and self._flush_deadline is None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                remaining += 1
                continue
            with self.spool.claim_series(chunk) as mine:
                if mine:
                    remaining += int(not self._ship_series_safely(chunk))
        return remaining

    @guarded(default=False)
    def _ship_series_safely(self, chunk: Path) -> bool:
        return self._ship_series(chunk)

    def _ship_series(self, chunk: Path) -> bool:
        """Send one chunk if it has a route; True when it needs nothing more from us."""
        meta = self.spool.series_meta(chunk)
        route = self.router(meta) if self.router is not None else None
        if route is None or route[0] in self._no_series:
            return True  # stays in the spool: local-only, another server's, or a server without series
        server, token = route
        deadline = self._deadline()
        now = time.monotonic()
        if now < self._backoff.not_before or (deadline is not None and now >= deadline):
            return False
        result = self._attempt(
            lambda limits: transport.upload_series(
                server, token, chunk, meta["project"], meta["run"], **limits
            )
        )
        if result.outcome == "delivered":
            self._delivered(
                lambda: self.spool.keep_uploaded_series(chunk), lambda: chunk.unlink(missing_ok=True)
            )
            self.stats.series_delivered += 1
            return True
        if result.outcome == "rejected" and result.status == 404:
            self._no_series.add(server)
            self.stats.series_unsupported = True  # the exit line says so: one line, not two
            log_once(
                f"no-series:{server}",
                logging.INFO,
                "stepdoctor: %s has no step-series endpoint (an older server); the series stays in %s",
                server,
                self.spool.root,
            )
            return True
        if result.outcome == "rejected":
            dest = self.spool.move_failed_series(
                chunk, f"{server} refused the step series: {result.detail}", server=server, token=token
            )
            self.stats.series_rejected += 1
            logger.warning(
                "stepdoctor: step-series chunk %s not uploaded, moved to %s: %s",
                chunk.name,
                dest,
                result.detail,
            )
            return True
        self._retry_later(server, result)
        return False

    @guarded()
    def _enforce_cap(self) -> None:
        """Keep the spool under its cap with uploaded copies only; say once when unsent traces alone
        exceed it (they are the user's data: never deleted to make room)."""
        cap = self.delivery.spool_max_bytes
        deleted, excess = self.spool.enforce_cap(cap)
        self.stats.pruned += deleted
        if excess:
            say(
                f"stepdoctor: traces not yet uploaded take {(cap + excess) / 1e6:.1f} MB in {self.spool.root}, over "
                f"the spool cap of {cap / 1e6:.1f} MB (STEPDOCTOR_SPOOL_MAX_BYTES); none are deleted: "
                "start the server or run `stepdoctor sync`, or raise the cap",
                key=f"spool-cap:{self.spool.root}",
            )

    @guarded(default=False)
    def _handle_safely(self, entry: Entry) -> bool:
        """One trace's trouble (unreadable file, full disk) must not hold up the others."""
        return self._handle(entry)

    def _handle(self, entry: Entry) -> bool:
        """Advance one trace as far as possible; True when it needs nothing more from us."""
        problem = _sidecar_problem(entry.meta)
        if problem:
            self._reject(entry, f"unusable sidecar: {problem}")
            return True
        if not entry.trace.exists():
            if not entry.export.exists():
                Spool.remove(entry)  # delivered earlier, crash before the sidecar went
                return True
            try:
                Spool.compress(entry, self.delivery.compresslevel, self._deadline())
            except TimeoutError as exc:  # out of time (sync --timeout, the exit budget): next time
                self.stats.last_error = str(exc)
                return False
            except OSError as exc:  # a full or read-only disk: the export is kept, tried again later
                self._backoff.failed(None, time.monotonic())
                self.stats.last_error = f"cannot compress in {entry.directory}: {exc.strerror or exc}"
                say(
                    f"stepdoctor: cannot write the compressed trace in {entry.directory} ({exc.strerror or exc}); "
                    "the trace stays there uncompressed and is tried again later",
                    key=f"compress:{entry.directory}:{exc.errno}",
                )
                return False
        route = self.router(entry.meta) if self.router is not None else None
        if route is None:
            return True  # stays in the spool: local-only, or another server's trace
        now = time.monotonic()
        if now < self._backoff.not_before:
            return False
        return self._send(entry, *route)

    def _deadline(self) -> float | None:
        """The nearer of the flush budget's end and the pass's deadline, if any."""
        deadlines = [d for d in (self._flush_deadline, self._pass_deadline) if d is not None]
        return min(deadlines) if deadlines else None

    def _send(self, entry: Entry, server: str, token: str | None) -> bool:
        deadline = self._deadline()
        if deadline is not None and time.monotonic() >= deadline:
            return False  # out of time: not a failure of the server's, so no backoff and no verdict
        result = self._attempt(
            lambda limits: transport.upload(server, token, entry.trace, entry.meta, **limits)
        )
        if result.outcome == "delivered":
            if not self._send_snapshot(entry, server, token, result.created_id()):
                return False  # next pass: the trace again (a replay, answered with its id), then this
            # a local copy, pruned oldest first under the cap
            self._delivered(lambda: self.spool.keep_uploaded(entry), lambda: Spool.remove(entry))
            self.stats.delivered += 1
            self.stats.delivered_keys.append(entry.key)
            return True
        if result.outcome == "rejected":
            self._reject(entry, f"{server} refused the upload: {result.detail}", server, token)
            return True
        self._retry_later(server, result)
        return False

    def _send_snapshot(self, entry: Entry, server: str, token: str | None, trace_id: int | None) -> bool:
        """The window's memory snapshot (``memory_snapshot=True``), right after its trace; True when
        nothing more is to be done for it (sent, or refused and parked in ``failed/``)."""
        snapshot = entry.memory_snapshot
        if not snapshot.exists():
            return True
        if trace_id is None:
            self.spool.park_snapshot(
                entry, f"{server} took the trace without naming its id: snapshot not sent"
            )
            return True
        deadline = self._deadline()
        if deadline is not None and time.monotonic() >= deadline:
            return False
        result = self._attempt(
            lambda limits: transport.upload_snapshot(server, token, trace_id, snapshot, **limits)
        )
        if result.outcome == "delivered":
            self.stats.snapshots += 1
            return True
        if result.outcome == "rejected":
            parked = self.spool.park_snapshot(entry, f"{server} refused the memory snapshot: {result.detail}")
            logger.warning(
                "stepdoctor: memory snapshot of %s not uploaded, moved to %s: %s",
                entry.stem,
                parked,
                result.detail,
            )
            return True
        self._retry_later(server, result)
        return False

    def _attempt(self, send: Callable[[dict[str, Any]], transport.Result]) -> transport.Result:
        """One request under this worker's timeouts and deadline, marked in flight while it runs."""
        limits = {
            "timeout": self.delivery.http_timeout,
            "connect_timeout": self.delivery.connect_timeout,
            "deadline": self._deadline(),
        }
        self.stats.sending = True
        try:
            result = send(limits)
        finally:
            self.stats.sending = False
        self.stats.unreachable = not result.connected
        return result

    def _delivered(self, keep: Callable[[], object], remove: Callable[[], object]) -> None:
        """The server has it: keep a local copy when the spool has room for copies, else remove it."""
        (keep if self.delivery.spool_max_bytes > 0 else remove)()
        self._backoff.succeeded()

    def _retry_later(self, server: str, result: transport.Result) -> None:
        """A try that may work later (no connection, 5xx, 429): back off, say so once."""
        delay = self._backoff.failed(result.retry_after, time.monotonic())
        self.stats.retries += 1
        if not (result.cut_short and self.stats.last_error):  # keep the cause, not the exit budget's cut
            self.stats.last_error = result.detail
        log_once(
            f"retry:{server}",
            logging.WARNING,
            "stepdoctor: upload to %s failed (%s); traces stay in the spool, retrying in %.1fs with backoff",
            server,
            result.detail,
            delay,
        )

    def _reject(self, entry: Entry, reason: str, server: str | None = None, token: str | None = None) -> None:
        dest = self.spool.move_failed(entry, reason, server=server, token=token)
        self.stats.rejected += 1
        logger.warning("stepdoctor: trace %s not uploaded, moved to %s: %s", entry.stem, dest, reason)


def _sidecar_problem(meta: dict[str, Any]) -> str | None:
    """Why a sidecar cannot be delivered (hand-edited, truncated by a full disk...), or None."""
    if "_unreadable" in meta:
        return str(meta["_unreadable"])
    missing = [
        k for k in ("idempotency_key", "project", "run") if not isinstance(meta.get(k), str) or not meta[k]
    ]
    return f"missing {', '.join(missing)}" if missing else None


@guarded()
def _lower_thread_priority() -> None:
    """On Linux a thread is a task with its own nice value: let training threads win the CPU."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
