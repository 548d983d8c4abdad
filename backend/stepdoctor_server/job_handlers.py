"""Every domain's jobs, registered with the job engine: what each process that runs jobs imports.

The job engine (``jobs``) imports no domain; each domain's job module registers its handlers with
it when imported (``jobs.defer``). This module imports them all, so the app (its embedded pool),
``stepdoctor worker`` and each spawned worker process run the same handlers.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Sequence

from stepdoctor.cli import configure_logging
from stepdoctor_server.core.settings import Settings, get_settings
from stepdoctor_server.deep import job as deep_job
from stepdoctor_server.jobs import pool, procrastinate_app
from stepdoctor_server.runs import diagnosis_job, series, webhook
from stepdoctor_server.traces import analysis_job
from stepdoctor_server.traces.storage import make_store

REGISTERED = (analysis_job, diagnosis_job, deep_job, series, webhook)


def start_pool(settings: Settings, size: int | None = None) -> pool.Pool:
    """``jobs.pool.start_pool`` with every domain's handlers loaded in each worker process."""
    return pool.start_pool(settings, size, setup=__name__)


def main(argv: Sequence[str] | None = None, *, settings: Settings | None = None) -> int:
    """``stepdoctor worker``: run workers with every domain's handlers in the foreground until
    Ctrl-C/SIGTERM (no HTTP server)."""
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
    metrics = pool.WorkerMetrics(settings)
    port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if port:
        metrics.serve(settings.metrics_host, port)
    done = threading.Event()
    pool._on_signals(done.set)
    engine = "procrastinate" if settings.uses_procrastinate else "embedded pool"
    print(
        f"stepdoctor worker: {size} analysis process(es) at a time ({engine}) on {settings.database_url_shown}, "
        f"traces from {make_store(settings).description}; Ctrl-C to stop",
        flush=True,
    )
    if settings.uses_procrastinate:
        # One process: procrastinate's loop, heartbeats and metrics here; each job in a child.
        procrastinate_app.run_worker(
            settings.model_copy(update={"workers": size}),
            concurrency=size,
            name=pool.worker_identity(0),
            stop=done,
            metrics=metrics,
        )
        return 0
    workers = start_pool(settings, size)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        workers.stop()
    return 0
