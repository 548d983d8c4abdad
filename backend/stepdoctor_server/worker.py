"""Analysis workers: processes that turn pending traces into stored reports, on any host.

Two engines behind the same job code (``handle_trace``: stream the trace from the store, analyse
it in a child process under the time and memory limits, store the outcome):

- Embedded (SQLite, one host): ``start_pool`` spawns N processes that claim pending rows of
  ``traces`` by polling, and a supervisor thread that restarts a worker which died and puts its
  job back; claims older than the job time limit are swept (a hung worker). A job that kills its
  worker ``queue.MAX_ATTEMPTS`` times is failed instead of retried forever.
- Procrastinate (PostgreSQL, any number of hosts): see ``jobs``; one process runs N jobs at a
  time with heartbeats, and a dead or hung worker's jobs run elsewhere.

The database going away mid-job is retried with backoff (``retry_db``), one log line per outage,
and never stored as the trace's failure. An analysis that failed because the trace store was
unreachable is tried again after ``retry_wait_s`` (the embedded pool waits in the job; procrastinate
schedules the job again), ``settings.analysis_tries`` times in all, before the trace fails.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import InterfaceError, OperationalError

from stepdoctor.cli import configure_logging
from stepdoctor_server.db import Database
from stepdoctor_server.errors import TransientError
from stepdoctor_server.limits import JobFailed, run_limited
from stepdoctor_server.models import DeepAnalysis, Trace
from stepdoctor_server.queue import (
    AnalysisResult,
    JobQueue,
    SqlDeepQueue,
    SqlJobQueue,
    diagnosis_due,
    make_queue,
    refresh_run_diagnosis,
    worker_identity,
)
from stepdoctor_server.settings import Settings, get_settings
from stepdoctor_server.storage import TraceStore, make_store

log = logging.getLogger("stepdoctor.worker")
T = TypeVar("T")

POLL_INTERVAL_S = 0.2
SUPERVISE_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0
# A claim older than the job time limit plus this margin is presumed dead (any host).
STALE_MARGIN_S = 120.0
STALE_SWEEP_S = 30.0


# -- one job -------------------------------------------------------------------------------------


class TransientJobError(Exception):
    """The database stayed unreachable mid-job: the job is retried later, never failed for it."""


def analyze_stored(
    settings_json: str,
    storage_key: str,
    filename: str,
    metadata: dict[str, Any],
    aws_env: dict[str, str] | None = None,
) -> AnalysisResult:
    """Stream one stored trace from the store and run the engine (in the job's child process).

    ``aws_env`` is the worker's ``AWS_*`` environment: the child descends from a forkserver
    started earlier, whose environment may predate the worker's.
    """
    from stepdoctor_analysis import contract, parse, pipeline

    if aws_env is not None:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(aws_env)
    settings = Settings.model_validate_json(settings_json)
    start = time.perf_counter()
    with make_store(settings).open(storage_key) as stream:
        trace = parse.load_trace(stream, max_bytes=settings.max_decompressed_bytes, name=filename)
    # The upload's run metadata (loader settings, CPU count, host RAM) lets recommendations name exact
    # values; the engine merges it with what the trace embeds, as ``stepdoctor analyze`` does.
    report = pipeline.analyze_trace(trace, metadata=metadata or None).to_dict()
    # Stored as the engine wrote it, once it decoded as the contract: readers decode it typed too.
    doc = contract.decode(report)
    duration_ms = int((time.perf_counter() - start) * 1000)
    return AnalysisResult(
        engine_version=doc.engine_version,
        schema_version=doc.schema_version,
        primary_kind=doc.primary.kind,
        primary_share=doc.primary.share,
        report=report,
        duration_ms=duration_ms,
    )


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


def analyze_limited(
    settings: Settings, storage_key: str, filename: str, metadata: dict[str, Any]
) -> AnalysisResult:
    """``analyze_stored`` in a child process under the job time and memory limits (JobFailed past them)."""
    result: AnalysisResult = run_limited(
        analyze_stored,
        (settings.model_dump_json(), storage_key, filename, metadata, _aws_env()),
        timeout_s=settings.job_timeout_s,
        memory_bytes=settings.job_memory_limit_bytes,
        describe_error=describe_error,
    )
    return result


def _aws_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("AWS_")}


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


@dataclass(frozen=True)
class _TraceJob:
    run_id: int
    storage_key: str
    filename: str
    meta: dict[str, Any]


def _load_job(db: Database, trace_id: int) -> _TraceJob | None:
    with db.session() as session:
        row = session.execute(
            select(Trace.run_id, Trace.storage_key, Trace.filename, Trace.meta).where(Trace.id == trace_id)
        ).first()
    return None if row is None else _TraceJob(row[0], row[1], row[2], dict(row[3] or {}))


def retry_wait_s(settings: Settings, tries: int) -> float:
    """How long to wait after the ``tries``-th try (1-based) failed on an unreachable store."""
    return float(min(300.0, settings.analysis_retry_wait_s * 2 ** (tries - 1)))


def _gave_up(tries: int, reason: str) -> str:
    return f"{reason} ({tries} tries with backoff); reanalyse the trace once it is back"


def handle_trace(
    db: Database,
    queue: SqlJobQueue,
    settings: Settings,
    trace_id: int,
    worker_id: str,
    metrics: Any = None,
    *,
    delivery: int | None = None,
) -> int | None:
    """Analyse a claimed trace and store the outcome; returns its run id (None if the row is gone).

    A bad trace, a time or memory limit fails the job with its reason; an unreachable database is
    retried (TransientJobError past the patience), never recorded as the trace's failure. An
    unreachable trace store is tried again ``settings.analysis_tries`` times in all, with backoff:
    in this process (``delivery`` None, the embedded pool), or, for the ``delivery``-th (0-based)
    delivery of a procrastinate job, by putting the trace back to pending and raising
    TransientJobError so procrastinate schedules the job again (``jobs``).
    """
    job = retry_db(lambda: _load_job(db, trace_id), what=f"trace {trace_id}")
    if job is None:
        return None
    started = time.perf_counter()
    tries = 0 if delivery is None else delivery
    try:
        while True:
            tries += 1
            try:
                result = analyze_limited(settings, job.storage_key, job.filename, job.meta)
                break
            except JobFailed as exc:
                if not exc.transient or tries >= settings.analysis_tries:
                    raise
                wait = retry_wait_s(settings, tries)
                log.warning(
                    "trace %s: %s (try %d of %d); again in %.0f s",
                    trace_id,
                    exc,
                    tries,
                    settings.analysis_tries,
                    wait,
                )
                note = f"waiting to retry: {exc} (try {tries} of {settings.analysis_tries})"
                if delivery is not None:
                    retry_db(partial(queue.release, trace_id, note, worker_id), what=f"trace {trace_id}")
                    raise TransientJobError(f"trace {trace_id}: {exc}") from None
                retry_db(partial(queue.note, trace_id, note, worker_id), what=f"trace {trace_id}")
                time.sleep(wait)
    except TransientJobError:
        raise
    except Exception as exc:  # JobFailed, or the child could not even start (fork failed, ...)
        reason = str(exc) if isinstance(exc, JobFailed) else describe_error(exc)[0]
        if isinstance(exc, JobFailed) and exc.transient:
            reason = _gave_up(tries, reason)
        if not isinstance(exc, JobFailed):
            log.exception("trace %s: %s", trace_id, reason)
        elif exc.internal:
            log.error("trace %s: %s\n%s", trace_id, reason, exc.details)
        else:
            log.info("trace %s: %s", trace_id, reason)
        ended = retry_db(lambda: queue.fail(trace_id, reason, worker_id), what=f"trace {trace_id}")
        _observe(metrics, "analyze", "failed" if ended else "superseded", started, reason)
        return job.run_id
    stored = retry_db(lambda: queue.complete(trace_id, result, worker_id), what=f"trace {trace_id}")
    if stored:
        log.info("trace %s: %s in %d ms", trace_id, result.primary_kind, result.duration_ms)
    else:
        log.warning("trace %s: job was taken over or reset meanwhile; this result is not stored", trace_id)
    _observe(metrics, "analyze", "done" if stored else "superseded", started)
    return job.run_id


def _observe(metrics: Any, task: str, outcome: str, started: float, reason: str = "") -> None:
    if metrics is not None:
        metrics.observe(task, outcome, time.perf_counter() - started, reason)


def process_one(db: Database, queue: JobQueue, store: TraceStore, settings: Settings, worker_id: str) -> bool:
    """Claim and handle one job (embedded engine); returns False when the queue was empty.

    Whatever goes wrong after the claim ends the job (done or failed): a claimed job is never
    left ``running`` by a worker that is still alive. Deep (HTA) jobs run only when no trace waits.
    """
    trace_id = queue.claim(worker_id)
    if trace_id is None:
        return process_one_deep(db, SqlDeepQueue(db), store, worker_id)
    sql_queue = queue if isinstance(queue, SqlJobQueue) else SqlJobQueue(db)
    run_id = handle_trace(db, sql_queue, settings, trace_id, worker_id)
    if run_id is not None:
        _refresh_run(db, run_id)
    return True


def run_delivered_trace(runtime: Any, trace_id: int, delivery: int = 0) -> None:
    """Body of procrastinate's ``analyze_trace`` job: claim that trace, analyse, store.

    A delivery finding the trace done or failed (a duplicate) does nothing. ``delivery``: how many
    times procrastinate ran this job before (its retries after an unreachable store).
    """
    queue = SqlJobQueue(runtime.db)
    if not retry_db(lambda: queue.claim_trace(trace_id, runtime.worker_id), what=f"trace {trace_id}"):
        log.info("trace %s: already analysed or gone; nothing to do", trace_id)
        return
    handle_trace(
        runtime.db, queue, runtime.settings, trace_id, runtime.worker_id, runtime.metrics, delivery=delivery
    )


def aggregate_when_finished(runtime: Any, run_id: int) -> None:
    """Body of procrastinate's ``aggregate_run`` job: aggregate once no trace of the run waits.

    The transaction that ends the run's last trace queues the final aggregation, so skipping
    while traces wait loses nothing; the inputs digest skips a repeat with nothing new.
    """
    started = time.perf_counter()

    def aggregate() -> bool:
        with runtime.db.session() as session:
            waiting = session.scalar(
                select(func.count(Trace.id)).where(
                    Trace.run_id == run_id, Trace.status.in_(("pending", "running"))
                )
            )
            if waiting:
                return False
            return refresh_run_diagnosis(session, run_id, force=False) is not None

    done = retry_db(aggregate, what=f"run {run_id} aggregation")
    if done:
        log.info("run %s: diagnosis aggregated", run_id)
        _observe(runtime.metrics, "aggregate", "done", started)


def _logged_reason(exc: BaseException, path: Path | None, filename: str, job: str) -> str:
    """The failure reason users see, logged: with the traceback only when it is our own bug."""
    reason = failure_reason(exc)
    if path is not None:  # users know the file by its download name, not by our storage key
        reason = reason.replace(str(path), filename).replace(path.name, filename)
    if reason.startswith("internal error"):
        log.exception("%s: failed", job)
    else:
        log.info("%s: %s", job, reason)
    return reason


def run_deep(kind: str, params: dict[str, Any], path: Path, rank: int | None) -> dict[str, Any]:
    """Run one deep analysis on a stored trace file (HTA missing: a one-line TraceError)."""
    from stepdoctor_analysis import deep

    if kind == "critical_path":
        step = params.get("step")
        return deep.critical_path(path, rank=rank, step=step if isinstance(step, int) else None)
    raise ValueError(f"unknown deep analysis kind {kind!r}")


def process_one_deep(db: Database, queue: SqlDeepQueue, store: TraceStore, worker_id: str) -> bool:
    """Claim and handle one deep-analysis job; False when there was none.

    A failing analysis fails its job; the database going away is waited out (``retry_db``), never
    recorded as the job's failure.

    HTA reads files by path, so a trace in object storage is copied to a temporary file first.
    """
    job_id = queue.claim(worker_id)
    if job_id is None:
        return False
    what = f"deep job {job_id}"

    def load() -> tuple[str, dict[str, Any], int | None, str, str]:
        with db.session() as session:
            job, trace = session.execute(
                select(DeepAnalysis, Trace)
                .join(Trace, Trace.id == DeepAnalysis.trace_id)
                .where(DeepAnalysis.id == job_id)
            ).one()
            return job.kind, dict(job.params or {}), trace.rank, trace.storage_key, trace.filename

    kind, params, rank, key, filename = retry_db(load, what=what)
    path: Path | None = None
    start = time.perf_counter()
    try:
        with store.local_copy(key) as path:
            result = run_deep(kind, params, path, rank)
            if result.get("source") == path.name:
                result["source"] = filename
    except Exception as exc:  # one bad job fails itself, never the worker
        reason = _logged_reason(exc, path, filename, what)
        retry_db(lambda: queue.fail(job_id, reason), what=what)
        return True
    retry_db(lambda: queue.complete(job_id, result), what=what)
    log.info("deep %s %s: done in %.1f s", kind, job_id, time.perf_counter() - start)
    return True


def _refresh_run(db: Database, run_id: int) -> None:
    try:
        with db.session() as session:
            if not diagnosis_due(session, run_id):
                return
            refresh_run_diagnosis(session, run_id, force=False)
    except Exception:  # the per-trace result is stored; the aggregate is redone on the next job
        log.exception("run %s: diagnosis refresh failed", run_id)


# -- worker process ------------------------------------------------------------------------------


def worker_loop(settings: Settings, index: int, stop: multiprocessing.synchronize.Event) -> None:
    """Body of one worker process: run jobs until ``stop`` is set.

    Embedded engine: claim/analyse by polling the ``traces`` table. Procrastinate: one
    procrastinate worker running ``settings.workers`` jobs at a time (each in its own child).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which sets ``stop``
    configure_logging()  # a fresh (spawned) process: the parent's logging setup is not inherited
    if settings.uses_procrastinate:
        from stepdoctor_server import jobs

        concurrency = max(1, settings.workers)
        jobs.run_worker(
            settings, concurrency=concurrency, name=worker_identity(index), stop=stop, watch_parent=True
        )
        return
    db = Database(settings)
    queue = make_queue(db)
    store = make_store(settings)
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


def _worker_main(settings_json: str, index: int, stop: multiprocessing.synchronize.Event) -> None:
    # Daemonic so a dying server never waits for us; but each job runs in a child of ours, which
    # multiprocessing refuses to daemons. We exit with our parent anyway (see worker_loop).
    multiprocessing.current_process().daemon = False
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
            return (queue.requeue_dead_local() if dead_local else 0) + queue.requeue_stale(
                stale_after(self.settings)
            )
        except Exception as exc:  # database not up yet: retried at the next sweep
            log.warning("could not requeue interrupted jobs: %s", _first_line(exc))
            return 0
        finally:
            db.dispose()

    def _spawn(self, index: int) -> Any:
        proc = self._ctx.Process(
            target=_worker_main,
            args=(self._settings_json, index, self._stop),
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


def start_pool(settings: Settings, size: int | None = None) -> Pool:
    """Start ``settings.workers`` analysis processes (used by the app lifespan and ``stepdoctor worker``)."""
    return Pool(settings=settings, size=settings.workers if size is None else size).start()


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
                    from stepdoctor_server import jobs

                    depth = jobs.queue_depth(session)
                else:
                    pending = session.scalar(select(func.count(Trace.id)).where(Trace.status == "pending"))
                    depth = {"analysis": int(pending or 0)}
        except Exception:  # the database is away: no sample rather than a failed scrape
            return
        for queue in ("analysis", "aggregation"):
            family.add_metric([queue], depth.get(queue, 0))
        yield family


# -- ``stepdoctor worker`` -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, settings: Settings | None = None) -> int:
    """Run workers in the foreground until Ctrl-C/SIGTERM (no HTTP server)."""
    parser = argparse.ArgumentParser(prog="stepdoctor worker", description="run analysis workers only")
    parser.add_argument(
        "-n", "--workers", type=int, default=None, help="jobs at a time (default STEPDOCTOR_WORKERS)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (default STEPDOCTOR_METRICS_PORT; 0 = off)",
    )
    args = parser.parse_args(list(argv or []))
    settings = settings or get_settings()
    size = args.workers if args.workers is not None else max(1, settings.workers)
    if size < 1:
        parser.error("--workers must be at least 1")
    configure_logging()
    metrics = WorkerMetrics(settings)
    port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if port:
        metrics.serve(settings.metrics_host, port)
    done = threading.Event()
    _on_signals(done.set)
    engine = "procrastinate" if settings.uses_procrastinate else "embedded pool"
    print(
        f"stepdoctor worker: {size} analysis process(es) at a time ({engine}) on {settings.database_url_shown}, "
        f"traces from {make_store(settings).description}; Ctrl-C to stop",
        flush=True,
    )
    if settings.uses_procrastinate:
        from stepdoctor_server import jobs

        # One process: procrastinate's loop, heartbeats and metrics here; each job in a child.
        jobs.run_worker(
            settings.model_copy(update={"workers": size}),
            concurrency=size,
            name=worker_identity(0),
            stop=done,
            metrics=metrics,
        )
        return 0
    pool = start_pool(settings, size)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        pool.stop()
    return 0


def _on_signals(handler: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: handler())
