"""``stepdoctor sync``: upload every trace left in the spool (server down during training, offline runs).

Each trace goes to ``--server`` (default ``$STEPDOCTOR_SERVER``) if set, else to the server recorded
in its sidecar; traces captured without a server need one of the two. ``--spool`` and ``--token``
default to ``$STEPDOCTOR_SPOOL`` and ``$STEPDOCTOR_TOKEN``, like the agent. Retries back off like the
agent, bounded by ``--timeout``; proxies, the CA bundle and the spool cap are the agent's too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stepdoctor.cli import configure_logging
from stepdoctor.config import Delivery, default_spool, default_spool_max_bytes
from stepdoctor.spool import Spool
from stepdoctor.worker import DeliveryWorker


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepdoctor sync", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spool", help="spool directory (default: $STEPDOCTOR_SPOOL or ~/.cache/stepdoctor/spool)"
    )
    parser.add_argument(
        "--server",
        help="upload everything here (default: $STEPDOCTOR_SERVER, else each trace's own server)",
    )
    parser.add_argument("--token", help="API token (default: $STEPDOCTOR_TOKEN)")
    parser.add_argument(
        "--retry-failed", action="store_true", help="also resend traces the server refused (failed/)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="give up retrying after this many seconds"
    )
    parser.add_argument("--http-timeout", type=float, default=60.0, help="per-request timeout in seconds")
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
        http_timeout=args.http_timeout,
        backoff_base=args.backoff_base,
        backoff_max=args.backoff_max,
        compresslevel=6,
    )
    worker = DeliveryWorker(spool, route, delivery)
    spool.cleanup_orphans()
    if args.retry_failed:
        spool.requeue_failed()
    deadline = time.monotonic() + args.timeout
    remaining = worker.run_pass()
    while remaining and time.monotonic() < deadline:
        time.sleep(max(0.05, min(worker.backoff_wait() or 0.5, deadline - time.monotonic())))
        remaining = worker.run_pass()
    stats = worker.stats
    unsent = sum(1 for sidecar in spool.sidecars() if _routable(sidecar, override))
    parts = [f"{stats.delivered} uploaded"]
    if stats.rejected:
        parts.append(f"{stats.rejected} rejected (moved to {spool.root / 'failed'})")
    parts.append(
        f"{remaining} left in {spool.root}"
        + (f" ({unsent} captured without a server: set STEPDOCTOR_SERVER or pass --server)" if unsent else "")
    )
    if remaining and stats.last_error:
        parts.append(f"last error: {stats.last_error}")
    print("stepdoctor sync: " + ", ".join(parts))
    return 1 if remaining or stats.rejected else 0


def _routable(sidecar: Any, override: str | None) -> bool:
    """Traces with no server of their own are skipped unless --server is given."""
    if override:
        return False
    import json

    try:
        return json.loads(sidecar.read_text()).get("server") is None
    except (OSError, ValueError):
        return False
