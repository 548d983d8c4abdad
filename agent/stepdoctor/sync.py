"""``stepdoctor sync``: upload every trace left in the spool (server down during training, offline runs),
and the runs' step series (``stepdoctor.series`` chunks) with them, routed the same way.

Each trace goes to ``--server`` (default ``$STEPDOCTOR_SERVER``) if set, else to the server recorded
in its sidecar; traces captured without a server need one of the two. ``--spool`` and ``--token``
default to ``$STEPDOCTOR_SPOOL`` and ``$STEPDOCTOR_TOKEN``, like the agent. Retries back off like the
agent; ``--timeout`` bounds the whole command (a request in flight is cut at it) and every
connection gets ``--connect-timeout``. Proxies, the CA bundle and the spool cap are the agent's too.

Nothing is silent: each trace parked in ``failed/`` is named with the server's reason, and sent
again when the server or token it would go to now differs from the ones that refused it (a token
belongs to one team, so a new team means a new token), or with ``--retry-failed``. While the server
cannot be reached, a line says so before every wait, and the last line says what is left where.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stepdoctor.cli import configure_logging
from stepdoctor.config import Delivery, default_spool, default_spool_max_bytes
from stepdoctor.spool import FAILED_DIR, Failed, Spool, token_fingerprint
from stepdoctor.worker import DeliveryWorker, Router

DESCRIPTION = (
    "Upload every trace left in the spool (server down during training, offline runs). Traces the "
    "server refused (in SPOOL/failed) are listed with the reason and sent again when the server or "
    "token changed since, or with --retry-failed."
)
#: How many parked traces are named one per line before the rest are counted.
FAILED_LINES = 20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepdoctor sync", description=DESCRIPTION)
    parser.add_argument(
        "--spool", help="spool directory (default: $STEPDOCTOR_SPOOL or ~/.cache/stepdoctor/spool)"
    )
    parser.add_argument(
        "--server",
        help="upload everything here (default: $STEPDOCTOR_SERVER, else each trace's own server)",
    )
    parser.add_argument("--token", help="API token (default: $STEPDOCTOR_TOKEN)")
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="resend every trace the server refused (failed/), even to the same server with the same token",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds the whole command may take, retries and uploads in flight included (default 60)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for each connection to the server (default 5)",
    )
    parser.add_argument(
        "--http-timeout",
        type=float,
        default=60.0,
        help="seconds to wait on each read or write of a request (default 60; --timeout still bounds it)",
    )
    parser.add_argument("--backoff-base", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--backoff-max", type=float, default=30.0, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(logging.WARNING, bare=True)
    root = args.spool or os.environ.get("STEPDOCTOR_SPOOL") or default_spool()
    spool = Spool(Path(root))
    if not spool.root.is_dir():
        print(f"stepdoctor sync: spool {spool.root} does not exist", file=sys.stderr)
        return 2
    for name in ("timeout", "connect_timeout", "http_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            print(
                f"stepdoctor sync: --{name.replace('_', '-')} must be a finite number of seconds above 0",
                file=sys.stderr,
            )
            return 2
    deadline = time.monotonic() + args.timeout
    server = args.server or os.environ.get("STEPDOCTOR_SERVER", "").strip()
    override = server.rstrip("/") if server else None
    token = args.token or os.environ.get("STEPDOCTOR_TOKEN") or None

    def route(meta: dict[str, Any]) -> tuple[str, str | None] | None:
        server = override or meta.get("server")
        return (str(server), token) if server else None

    try:
        spool_max_bytes = default_spool_max_bytes()
    except ValueError as exc:
        print(f"stepdoctor sync: STEPDOCTOR_SPOOL_MAX_BYTES: {exc}", file=sys.stderr)
        return 2
    delivery = Delivery(
        spool_max_bytes=spool_max_bytes,
        connect_timeout=args.connect_timeout,
        http_timeout=args.http_timeout,
        backoff_base=args.backoff_base,
        backoff_max=args.backoff_max,
        compresslevel=6,
    )
    worker = DeliveryWorker(spool, route, delivery)
    spool.cleanup_orphans()
    retried = _review_failed(spool, route, retry_all=args.retry_failed)
    remaining = _send_until(worker, deadline, args.timeout)
    return _report(spool, worker, remaining, retried, override)


def _send_until(worker: DeliveryWorker, deadline: float, timeout: float) -> int:
    """Passes over the spool, backing off between them, until all went or ``deadline``; returns
    how many are left. A line says what is sent first (a hung server may hold that first request
    until the deadline) and what the trouble is before every wait."""
    waiting, size = worker.spool.pending()
    chunks = len(worker.spool.series_chunks())
    if waiting or chunks:
        series = f" and {chunks} step-series chunk{'' if chunks == 1 else 's'}" if chunks else ""
        print(
            f"stepdoctor sync: {waiting} trace{'' if waiting == 1 else 's'} ({size / 1e6:.1f} MB){series} waiting in "
            f"{worker.spool.root}; sending (giving up after {timeout:g} s, --timeout)",
            file=sys.stderr,
            flush=True,
        )
    remaining = worker.run_pass(deadline)
    while remaining and time.monotonic() < deadline:
        wait = max(0.05, min(worker.backoff_wait() or 0.5, deadline - time.monotonic()))
        _say_waiting(worker, remaining, wait, deadline)
        time.sleep(wait)
        remaining = worker.run_pass(deadline)
    return remaining


def _review_failed(spool: Spool, route: Router, *, retry_all: bool) -> int:
    """Name every trace in ``failed/`` with its reason; requeue those worth another try."""
    parked = spool.failed() + spool.failed_series()
    retried = 0
    for index, failed in enumerate(parked):
        retry, why = _worth_retrying(failed, route(failed.meta), retry_all)
        if index < FAILED_LINES:
            action = "sending again" if retry else "kept"
            print(f"stepdoctor sync: {FAILED_DIR}/{failed.name}: {failed.reason} ({action}: {why})")
        if not retry:
            continue
        try:
            spool.requeue(failed)
        except OSError as exc:  # a read-only or full spool: it stays parked, said in one line
            print(
                f"stepdoctor sync: cannot move {FAILED_DIR}/{failed.name} back to send it: {exc.strerror or exc}"
            )
            continue
        retried += 1
    if len(parked) > FAILED_LINES:
        print(f"stepdoctor sync: ... and {len(parked) - FAILED_LINES} more in {spool.root / FAILED_DIR}")
    return retried


def _worth_retrying(
    failed: Failed, route: tuple[str, str | None] | None, retry_all: bool
) -> tuple[bool, str]:
    """(send again?, why): a refusal is final for the server and token that got it, not for others."""
    if retry_all:
        return True, "--retry-failed"
    record = failed.record
    if record is not None and record.get("server") is None:
        return False, "a problem with the file itself; --retry-failed sends it anyway"
    if route is None:
        return False, "no server to send it to: set STEPDOCTOR_SERVER or pass --server"
    server, token = route
    if record is None:
        return True, "refused before stepdoctor recorded by which server and token"
    if record.get("server") != server:
        return True, f"the server is now {server}"
    if record.get("token") != token_fingerprint(token):
        return True, "the token (and so perhaps the team) changed since"
    return False, "same server and token as when refused; fix the cause, then pass --retry-failed"


def _say_waiting(worker: DeliveryWorker, remaining: int, wait: float, deadline: float) -> None:
    """Before each wait: the server's trouble, what waits, and when the command gives up."""
    stats = worker.stats
    trouble = "server not reachable" if stats.unreachable else "not sent yet"
    left = max(0.0, deadline - time.monotonic())
    when = f"next try in {wait:.1f} s, " if wait < left else ""
    print(
        f"stepdoctor sync: {trouble} ({stats.last_error}); {remaining} left, "
        f"{when}giving up in {left:.1f} s (--timeout)",
        file=sys.stderr,
        flush=True,
    )


def _report(spool: Spool, worker: DeliveryWorker, remaining: int, retried: int, override: str | None) -> int:
    """The last line: what went, what is left in the spool and in ``failed/``; exit 1 unless all went."""
    stats = worker.stats
    unsent = sum(1 for sidecar in spool.sidecars() if _routable(sidecar, override))
    parked = len(spool.failed()) + len(spool.failed_series())
    parts = [f"{stats.delivered} uploaded"]
    if stats.series_delivered or stats.series_rejected:
        parts.append(f"{stats.series_delivered} step-series chunk(s) uploaded")
    if retried:
        parts.append(f"{retried} sent again from {FAILED_DIR}/")
    if stats.rejected or stats.series_rejected:
        parts.append(f"{stats.rejected + stats.series_rejected} refused (moved to {spool.root / FAILED_DIR})")
    parts.append(
        f"{remaining} left in {spool.root}"
        + (f" ({unsent} captured without a server: set STEPDOCTOR_SERVER or pass --server)" if unsent else "")
    )
    parts.append(f"{parked} in {spool.root / FAILED_DIR}")
    if remaining and stats.last_error:
        parts.append(f"last error: {stats.last_error}")
    print("stepdoctor sync: " + ", ".join(parts))
    return 1 if remaining or stats.rejected or stats.series_rejected or parked else 0


def _routable(sidecar: Any, override: str | None) -> bool:
    """Traces with no server of their own are skipped unless --server is given."""
    if override:
        return False
    try:
        return json.loads(sidecar.read_text()).get("server") is None
    except (OSError, ValueError):
        return False
