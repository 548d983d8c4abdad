"""Analysis workers: separate processes that turn pending traces into stored reports.

Analysis is CPU-heavy (seconds, hundreds of MB for big traces), so it never runs in the server's
event loop nor in its threadpool: ``start_pool`` spawns N processes (``spawn`` context: no
inherited locks, engine connections or threads) and a supervisor thread that restarts a worker
which died (e.g. killed by the OOM killer) and puts its job back in the queue. A job that kills
its worker ``queue.MAX_ATTEMPTS`` times is failed instead of retried forever.

Each worker loops: claim -> analyse the stored file -> store the analysis -> refresh the run
diagnosis. Waking up is by polling (``POLL_INTERVAL_S``): an idle claim is one indexed query,
and polling works identically on SQLite and PostgreSQL and across hosts.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select

from stepdoctor_server.db import Database
from stepdoctor_server.models import DeepAnalysis, Trace
from stepdoctor_server.queue import (
    AnalysisResult,
    JobQueue,
    SqlDeepQueue,
    diagnosis_due,
    make_queue,
    refresh_run_diagnosis,
    worker_identity,
)
from stepdoctor_server.settings import Settings, get_settings
from stepdoctor_server.storage import TraceStore

log = logging.getLogger("stepdoctor.worker")

POLL_INTERVAL_S = 0.2
SUPERVISE_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0
# Claims older than this on any host are presumed dead (covers workers on other machines).
STALE_CLAIM = timedelta(hours=6)


# -- one job -------------------------------------------------------------------------------------


def analyze_file(path: Path, metadata: dict[str, Any] | None, max_bytes: int | None) -> AnalysisResult:
    """Run the engine on one stored trace; TraceError propagates with its one-line message."""
    from stepdoctor_analysis import ENGINE_VERSION, SCHEMA_VERSION
    from stepdoctor_analysis.pipeline import analyze_path

    kwargs: dict[str, Any] = {"max_bytes": max_bytes}
    # The run metadata (loader settings, world size, ...) lets recommendations name exact values.
    if metadata and "metadata" in inspect.signature(analyze_path).parameters:
        kwargs["metadata"] = metadata
    start = time.perf_counter()
    report = analyze_path(path, **kwargs).to_dict()
    duration_ms = int((time.perf_counter() - start) * 1000)
    primary = report.get("primary") or {}
    share = primary.get("share")
    return AnalysisResult(
        engine_version=str(report.get("engine_version") or ENGINE_VERSION),
        schema_version=int(report.get("schema_version") or SCHEMA_VERSION),
        primary_kind=primary.get("kind"),
        primary_share=float(share) if isinstance(share, int | float) else None,
        report=report,
        duration_ms=duration_ms,
    )


def failure_reason(exc: BaseException) -> str:
    """The engine's own one-line message for bad traces; anything else is an internal error."""
    from stepdoctor_analysis.errors import TraceError

    if isinstance(exc, TraceError):
        return str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return "internal error: the trace file is missing from the store"
    if isinstance(exc, MemoryError):
        return "internal error: out of memory while analysing this trace"
    return f"internal error: {type(exc).__name__}: {exc}"


def process_one(db: Database, queue: JobQueue, store: TraceStore, settings: Settings, worker_id: str) -> bool:
    """Claim and handle one job; returns False when the queue was empty.

    Whatever goes wrong after the claim ends the job (done or failed): a claimed job is never
    left ``running`` by a worker that is still alive. Deep (HTA) jobs run only when no trace waits.
    """
    trace_id = queue.claim(worker_id)
    if trace_id is None:
        return process_one_deep(db, SqlDeepQueue(db), store, worker_id)
    run_id: int | None = None
    path: Path | None = None
    filename = ""
    try:
        with db.session() as session:
            trace = session.scalars(select(Trace).where(Trace.id == trace_id)).one()
            run_id, meta, filename = trace.run_id, dict(trace.meta or {}), trace.filename
            path = store.path(trace.storage_key)
        result = analyze_file(path, meta, settings.max_decompressed_bytes)
        queue.complete(trace_id, result)
        log.info("trace %s: %s in %d ms", trace_id, result.primary_kind, result.duration_ms)
    except Exception as exc:  # one bad trace fails its own job, never the worker
        queue.fail(trace_id, _logged_reason(exc, path, filename, f"trace {trace_id}"))
    if run_id is not None:
        _refresh_run(db, run_id)
    return True


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
    """Claim and handle one deep-analysis job; False when there was none. Never raises past the claim."""
    job_id = queue.claim(worker_id)
    if job_id is None:
        return False
    path: Path | None = None
    filename = ""
    try:
        with db.session() as session:
            job, trace = session.execute(
                select(DeepAnalysis, Trace)
                .join(Trace, Trace.id == DeepAnalysis.trace_id)
                .where(DeepAnalysis.id == job_id)
            ).one()
            kind, params, rank = job.kind, dict(job.params or {}), trace.rank
            path, filename = store.path(trace.storage_key), trace.filename
        start = time.perf_counter()
        result = run_deep(kind, params, path, rank)
        if result.get("source") == path.name:
            result["source"] = filename
        queue.complete(job_id, result)
        log.info("deep %s %s: done in %.1f s", kind, job_id, time.perf_counter() - start)
    except Exception as exc:  # one bad job fails itself, never the worker
        queue.fail(job_id, _logged_reason(exc, path, filename, f"deep job {job_id}"))
    return True


def _refresh_run(db: Database, run_id: int) -> None:
    try:
        with db.session() as session:
            if not diagnosis_due(session, run_id):
                return
            refresh_run_diagnosis(session, run_id)
    except Exception:  # the per-trace result is stored; the aggregate is redone on the next job
        log.exception("run %s: diagnosis refresh failed", run_id)


# -- worker process ------------------------------------------------------------------------------


def worker_loop(settings: Settings, index: int, stop: multiprocessing.synchronize.Event) -> None:
    """Body of one worker process: claim/analyse until ``stop`` is set."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which sets ``stop``
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import stepdoctor_analysis.pipeline  # noqa: F401 - pay the import once, not on the first job

    db = Database(settings)
    queue = make_queue(db)
    store = TraceStore(settings.traces_dir)
    worker_id = worker_identity(index)
    parent = os.getppid()
    try:
        # A parent killed with SIGKILL cannot stop us: once re-parented, exit instead of lingering.
        while not stop.is_set() and os.getppid() == parent:
            try:
                busy = process_one(db, queue, store, settings, worker_id)
            except Exception:  # database hiccup: back off, keep the worker alive
                log.exception("worker %s: queue error", worker_id)
                busy = False
            if not busy:
                stop.wait(POLL_INTERVAL_S)
    finally:
        db.dispose()


def _worker_main(settings_json: str, index: int, stop: multiprocessing.synchronize.Event) -> None:
    worker_loop(Settings.model_validate_json(settings_json), index, stop)


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

    def start(self) -> Pool:
        self._stop = self._ctx.Event()
        db = Database(self.settings)
        queue = make_queue(db)
        requeued = 0
        try:
            # Jobs left running by dead workers (previous server, killed process) resume.
            requeued = queue.requeue_dead_local() + queue.requeue_stale(STALE_CLAIM)
        except Exception:  # database not up yet: workers retry on their own; stale claims age out
            log.exception("could not requeue interrupted jobs at start")
        finally:
            db.dispose()
        if requeued:
            log.info("requeued %d interrupted analysis job(s)", requeued)
        self._procs = [self._spawn(i) for i in range(self.size)]
        self._supervisor = threading.Thread(target=self._supervise, name="stepdoctor-pool", daemon=True)
        self._supervisor.start()
        return self

    def _spawn(self, index: int) -> Any:
        proc = self._ctx.Process(
            target=_worker_main,
            args=(self.settings.model_dump_json(), index, self._stop),
            name=f"stepdoctor-worker-{index}",
            daemon=True,
        )
        proc.start()
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _supervise(self) -> None:
        """Restart dead workers and requeue what they held (a crash costs one attempt)."""
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            for index, proc in enumerate(self._procs):
                if proc.is_alive() or self._stopping.is_set():
                    continue
                log.warning(
                    "worker %s (pid %s) died with exit code %s; restarting", index, proc.pid, proc.exitcode
                )
                self._requeue(f"{worker_identity(index).rsplit(':', 2)[0]}:{proc.pid}:{index}")
                self._procs[index] = self._spawn(index)
                self.restarts += 1

    def _requeue(self, worker_id: str) -> None:
        db = Database(self.settings)
        try:
            make_queue(db).requeue_worker(worker_id)
        except Exception:
            log.exception("could not requeue the jobs of %s", worker_id)
        finally:
            db.dispose()

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        self._stopping.set()
        if self._stop is not None:
            self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=SUPERVISE_INTERVAL_S * 2)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():  # mid-analysis past the grace period: its job is requeued at next start
                proc.terminate()
                proc.join(2.0)


def start_pool(settings: Settings, size: int | None = None) -> Pool:
    """Start ``settings.workers`` analysis processes (used by the app lifespan and ``stepdoctor worker``)."""
    return Pool(settings=settings, size=settings.workers if size is None else size).start()


# -- ``stepdoctor worker`` -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, settings: Settings | None = None) -> int:
    """Run workers in the foreground until Ctrl-C/SIGTERM (no HTTP server)."""
    parser = argparse.ArgumentParser(prog="stepdoctor worker", description="run analysis workers only")
    parser.add_argument(
        "-n", "--workers", type=int, default=None, help="processes (default STEPDOCTOR_WORKERS)"
    )
    args = parser.parse_args(list(argv or []))
    settings = settings or get_settings()
    size = args.workers if args.workers is not None else max(1, settings.workers)
    if size < 1:
        parser.error("--workers must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    done = threading.Event()
    _on_signals(done.set)
    pool = start_pool(settings, size)
    print(
        f"stepdoctor worker: {size} analysis process(es) on {_safe_url(settings)}; Ctrl-C to stop", flush=True
    )
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


def _safe_url(settings: Settings) -> str:
    from sqlalchemy.engine import make_url

    return make_url(settings.database_url).render_as_string(hide_password=True)
