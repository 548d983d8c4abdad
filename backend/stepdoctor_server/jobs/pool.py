"""Worker processes: they run the jobs the domains registered (``defer``), on any host.

Two engines behind the same job code (e.g. ``traces.analysis_job.handle_trace``: stream the trace
from the store, analyse it in a child process under the time and memory limits, store the outcome):

- Embedded (SQLite, one host): ``start_pool`` spawns N processes that claim pending rows of
  ``traces`` by polling, and a supervisor thread that restarts a worker which died and puts its
  job back; claims older than the job time limit are swept (a hung worker). A job that kills its
  worker ``claims.MAX_ATTEMPTS`` times is failed instead of retried forever.
- Procrastinate (PostgreSQL, any number of hosts): see ``procrastinate_app``; one process runs N
  jobs at a time with heartbeats, and a dead or hung worker's jobs run elsewhere.

The database going away mid-job is retried with backoff (``retry_db``), one log line per outage,
and never stored as the trace's failure. An analysis that failed because the trace store was
unreachable is tried again after ``retry_wait_s`` (the embedded pool waits in the job; procrastinate
schedules the job again), ``settings.analysis_tries`` times in all, before the trace fails.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import InterfaceError, OperationalError

from stepdoctor.cli import configure_logging
from stepdoctor_server.core.database import Database
from stepdoctor_server.core.errors import TransientError
from stepdoctor_server.core.models import Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.jobs import procrastinate_app as jobs
from stepdoctor_server.jobs.claims import (
    JobQueue,
    make_queue,
    worker_identity,
)
from stepdoctor_server.jobs.defer import CLAIMERS, JobContext, TransientJobError, run_sweeps

log = logging.getLogger("stepdoctor.worker")
T = TypeVar("T")

POLL_INTERVAL_S = 0.2
SUPERVISE_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0
# A claim older than the job time limit plus this margin is presumed dead (any host).
STALE_MARGIN_S = 120.0
STALE_SWEEP_S = 30.0


# -- one job -------------------------------------------------------------------------------------


def describe_error(exc: BaseException) -> tuple[str, bool]:
    """(reason users see, whether it is our own bug) for an exception raised by a job."""
    from stepdoctor_analysis.errors import TraceError

    if isinstance(exc, TraceError | TransientError):  # one line written for users
        return str(exc) or type(exc).__name__, False
    if isinstance(exc, FileNotFoundError):
        return "internal error: the trace file is missing from the store", True
    if isinstance(exc, MemoryError):
        return "internal error: out of memory while analysing this trace", True
    # An exception's text may hold paths, keys or endpoints: it goes to the log with the traceback.
    return f"internal error: {type(exc).__name__} (details in the server log)", True


def failure_reason(exc: BaseException) -> str:
    """The engine's own one-line message for bad traces; anything else is an internal error."""
    return describe_error(exc)[0]


_TRANSIENT = (OperationalError, InterfaceError)


def retry_db(fn: Callable[[], T], *, what: str, give_up_after_s: float = 300.0) -> T:
    """``fn()``, retried with exponential backoff while the database is unreachable.

    One warning when the outage starts and one when it ends (no traceback per attempt). Past
    ``give_up_after_s`` it raises TransientJobError: the job engine retries the job later, and the
    trace is never marked failed for the database's sake.
    """
    delay = 0.25
    first_failure: float | None = None
    while True:
        try:
            result = fn()
        except _TRANSIENT as exc:
            now = time.monotonic()
            if first_failure is None:
                first_failure = now
                log.warning("%s: database unreachable (%s); retrying with backoff", what, _first_line(exc))
            if now - first_failure > give_up_after_s:
                raise TransientJobError(f"{what}: database unreachable for {give_up_after_s:.0f} s") from exc
            time.sleep(delay)
            delay = min(30.0, delay * 2)
            continue
        if first_failure is not None:
            log.warning("%s: database reachable again after %.1f s", what, time.monotonic() - first_failure)
        return result


def _first_line(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def process_one(db: Database, queue: JobQueue, store: Any, settings: Settings, worker_id: str) -> bool:
    """Run one claimed job of any domain (embedded engine); False when none was waiting.

    The claimers the domains registered (``defer.CLAIMERS``) are asked in order: traces first,
    the optional deep analyses only when no trace waits.
    """
    job = JobContext(db=db, queue=queue, store=store, settings=settings, worker_id=worker_id)
    return any(claim(job) for claim in CLAIMERS)


def _observe(metrics: Any, task: str, outcome: str, started: float, reason: str = "") -> None:
    if metrics is not None:
        metrics.observe(task, outcome, time.perf_counter() - started, reason)


# -- worker process ------------------------------------------------------------------------------


def worker_loop(settings: Settings, index: int, stop: multiprocessing.synchronize.Event) -> None:
    """Body of one worker process: run jobs until ``stop`` is set.

    Embedded engine: claim/analyse by polling the ``traces`` table. Procrastinate: one
    procrastinate worker running ``settings.workers`` jobs at a time (each in its own child).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which sets ``stop``
    configure_logging()  # a fresh (spawned) process: the parent's logging setup is not inherited
    if settings.uses_procrastinate:
        concurrency = max(1, settings.workers)
        jobs.run_worker(
            settings, concurrency=concurrency, name=worker_identity(index), stop=stop, watch_parent=True
        )
        return
    db = Database(settings)
    queue = make_queue(db)
    store = None  # each claimer opens the store it needs (``JobContext.store``)
    worker_id = worker_identity(index)
    parent = os.getppid()
    down_since: float | None = None
    backoff = POLL_INTERVAL_S
    try:
        # A parent killed with SIGKILL cannot stop us: once re-parented, exit instead of lingering.
        while not stop.is_set() and os.getppid() == parent:
            try:
                busy = process_one(db, queue, store, settings, worker_id)
            except (*_TRANSIENT, TransientJobError) as exc:  # database away: back off, one line per outage
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning(
                        "worker %s: database unreachable (%s); backing off", worker_id, _first_line(exc)
                    )
                stop.wait(backoff)
                backoff = min(30.0, backoff * 2)
                continue
            except Exception:  # our own bug outside a job: log it, keep the worker alive
                log.exception("worker %s: queue error", worker_id)
                busy = False
            if down_since is not None:
                log.warning(
                    "worker %s: database reachable again after %.0f s",
                    worker_id,
                    time.monotonic() - down_since,
                )
                down_since, backoff = None, POLL_INTERVAL_S
            if not busy:
                stop.wait(POLL_INTERVAL_S)
    finally:
        db.dispose()


def _worker_main(
    settings_json: str, index: int, stop: multiprocessing.synchronize.Event, setup: str = ""
) -> None:
    # Daemonic so a dying server never waits for us; but each job runs in a child of ours, which
    # multiprocessing refuses to daemons. We exit with our parent anyway (see worker_loop).
    multiprocessing.current_process().daemon = False
    if setup:  # a spawned process: the module that registers the domains' handlers, by name
        importlib.import_module(setup)
    worker_loop(Settings.model_validate_json(settings_json), index, stop)


def stale_after(settings: Settings) -> timedelta:
    """A claim older than the job time limit plus a margin cannot belong to a live worker (it would
    have killed the job at the limit), on this host or any other."""
    return timedelta(seconds=settings.job_timeout_s + STALE_MARGIN_S)


@dataclass
class Pool:
    """Handle on the worker processes; ``stop()`` finishes current jobs (bounded) and joins."""

    settings: Settings
    size: int
    _ctx: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    _procs: list[Any] = field(default_factory=list)
    _stop: Any = None
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0
    _settings_json: str = ""
    setup: str = ""  # module that registers the domains' job handlers in each worker process

    def start(self) -> Pool:
        self._stop = self._ctx.Event()
        if not self.settings.uses_procrastinate:  # procrastinate has its own heartbeats and retries
            requeued = self._requeue_interrupted(dead_local=True)
            if requeued:
                log.info("requeued %d interrupted analysis job(s)", requeued)
        # Procrastinate runs all ``size`` jobs from one process (each job in its own child).
        processes = 1 if self.settings.uses_procrastinate else self.size
        settings = self.settings.model_copy(update={"workers": self.size})
        self._settings_json = settings.model_dump_json()
        self._procs = [self._spawn(i) for i in range(processes)]
        self._supervisor = threading.Thread(target=self._supervise, name="stepdoctor-pool", daemon=True)
        self._supervisor.start()
        return self

    def _requeue_interrupted(self, *, dead_local: bool) -> int:
        db = Database(self.settings)
        try:
            queue = make_queue(db)
            # Jobs left running by dead workers (previous server, killed process) resume.
            # Reports another engine wrote are redone here, never by the GET that reads them.
            outdated = run_sweeps(db)
            return (
                (queue.requeue_dead_local() if dead_local else 0)
                + queue.requeue_stale(stale_after(self.settings))
                + outdated
            )
        except Exception as exc:  # database not up yet: retried at the next sweep
            log.warning("could not requeue interrupted jobs: %s", _first_line(exc))
            return 0
        finally:
            db.dispose()

    def _spawn(self, index: int) -> Any:
        proc = self._ctx.Process(
            target=_worker_main,
            args=(self._settings_json, index, self._stop, self.setup),
            name=f"stepdoctor-worker-{index}",
            daemon=True,
        )
        proc.start()
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _supervise(self) -> None:
        """Restart dead workers and requeue what they held (a crash costs one attempt); sweep
        claims older than the job time limit (a hung worker, or one on a vanished host)."""
        last_sweep = time.monotonic()
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            for index, proc in enumerate(self._procs):
                if proc.is_alive() or self._stopping.is_set():
                    continue
                log.warning(
                    "worker %s (pid %s) died with exit code %s; restarting", index, proc.pid, proc.exitcode
                )
                if not self.settings.uses_procrastinate:
                    self._requeue(f"{worker_identity(index).rsplit(':', 2)[0]}:{proc.pid}:{index}")
                self._procs[index] = self._spawn(index)
                self.restarts += 1
            if not self.settings.uses_procrastinate and time.monotonic() - last_sweep > STALE_SWEEP_S:
                last_sweep = time.monotonic()
                self._requeue_interrupted(dead_local=False)

    def _requeue(self, worker_id: str) -> None:
        db = Database(self.settings)
        try:
            make_queue(db).requeue_worker(worker_id)
        except Exception:
            log.exception("could not requeue the jobs of %s", worker_id)
        finally:
            db.dispose()

    def request_stop(self) -> None:
        """Tell every worker to stop after its current job (returns at once; ``stop`` waits)."""
        self._stopping.set()
        if self._stop is not None:
            self._stop.set()

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop the workers: ``timeout`` for running jobs to end, then they are terminated (their
        jobs are requeued at the next start, or by the stale-claim sweep of another host)."""
        self.request_stop()
        if self._supervisor is not None:
            self._supervisor.join(timeout=SUPERVISE_INTERVAL_S * 2)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():  # mid-analysis past the grace period: its job is requeued later
                proc.terminate()
                proc.join(2.0)


def start_pool(settings: Settings, size: int | None = None, *, setup: str = "") -> Pool:
    """Start ``settings.workers`` analysis processes (used by the app lifespan and ``stepdoctor worker``);
    ``setup``: the module each imports to register the domains' handlers (``job_handlers``)."""
    return Pool(settings=settings, size=settings.workers if size is None else size, setup=setup).start()


# -- metrics -------------------------------------------------------------------------------------


class WorkerMetrics:
    """Prometheus metrics of one ``stepdoctor worker``: job durations, failures, queue depth."""

    def __init__(self, settings: Settings) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.duration = Histogram(
            "stepdoctor_job_duration_seconds",
            "Wall time of jobs by task and outcome",
            ["task", "outcome"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800),
            registry=self.registry,
        )
        self.failures = Counter(
            "stepdoctor_job_failures",
            "Failed jobs by task and cause",
            ["task", "cause"],
            registry=self.registry,
        )
        self.registry.register(_QueueDepth(settings))

    def observe(self, task: str, outcome: str, seconds: float, reason: str = "") -> None:
        self.duration.labels(task, outcome).observe(seconds)
        if outcome == "failed":
            self.failures.labels(task, _cause(reason)).inc()

    def serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)


def _cause(reason: str) -> str:
    """A bounded label for a failure reason."""
    if "time limit" in reason:
        return "time_limit"
    if "memory limit" in reason or "out of memory" in reason:
        return "memory_limit"
    if reason.startswith("the trace store is unreachable"):  # tries exhausted in an outage
        return "store_unreachable"
    return "internal" if reason.startswith("internal error") else "bad_trace"


class _QueueDepth:
    """Jobs waiting, read from the database at scrape time (every worker reports the shared queue)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db: Database | None = None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "stepdoctor_queue_depth", "Jobs waiting to run, by queue", labels=["queue"]
        )
        try:
            self.db = self.db or Database(self.settings)
            with self.db.session(read_only=True) as session:
                if self.settings.uses_procrastinate:
                    depth = jobs.queue_depth(session)
                else:
                    pending = session.scalar(select(func.count(Trace.id)).where(Trace.status == "pending"))
                    depth = {"analysis": int(pending or 0)}
        except Exception:  # the database is away: no sample rather than a failed scrape
            return
        for queue in ("analysis", "aggregation"):
            family.add_metric([queue], depth.get(queue, 0))
        yield family


def _on_signals(handler: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: handler())
