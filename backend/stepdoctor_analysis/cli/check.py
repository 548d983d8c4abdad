"""``stepdoctor check CANDIDATE --baseline BASELINE [--max-regression 5%] [--format json]``: a CI gate.

Each argument is a trace file or a run directory (the agent's spool folder, or a TensorBoard log
folder holding one run), or, with ``--server URL``, a run on a stepdoctor server named
``project/run`` (an existing local path wins; mixed forms are fine). A server run is read from
``GET /api/v1/projects/{project}/runs/{run}/check`` (read scope, ``--token`` or
``$STEPDOCTOR_TOKEN``): its full-resolution steady step time, profiled step time and verdict,
the same :class:`~stepdoctor_analysis.run.timeline.Side` a local run gives. The step times compared are the unprofiled steady-state medians when both
runs have the agent's step series, else the profiled step times of their traces; the line says
which (:func:`stepdoctor_analysis.run.timeline.compare` decides, for every surface).

Exit status: 0 within the threshold, 1 on a regression, 2 on bad input or nothing comparable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import msgspec

from ..errors import TraceError
from ..parsing import logdir
from ..run.timeline import Comparison, Side, compare, read_run_timeline, series_files


def regression_fraction(text: str) -> float:
    """``5%``, ``5``, ``0.5%`` -> 0.05, 0.05, 0.005 (a percentage either way)."""
    raw = text.strip().removesuffix("%").strip()
    try:
        value = float(raw) / 100.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a percentage: {text!r} (e.g. 5%)") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"--max-regression must be a finite percentage >= 0, not {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepdoctor check",
        description="Fail (exit 1) when CANDIDATE's step time regressed against BASELINE's.",
    )
    p.add_argument(
        "candidate", help="trace file or run directory of the run under test (or project/run with --server)"
    )
    p.add_argument(
        "--baseline",
        required=True,
        help="trace file or run directory to compare against (or project/run with --server)",
    )
    p.add_argument(
        "--max-regression",
        type=regression_fraction,
        default=0.05,
        help="largest slowdown allowed, in percent (default 5%%)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument(
        "--server",
        default=None,
        help="stepdoctor server URL: arguments of the form project/run are read there",
    )
    p.add_argument(
        "--token", default=None, help="API token with read scope for --server (default $STEPDOCTOR_TOKEN)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _run_folder(path: Path) -> Path:
    """A TensorBoard log folder with exactly one run below it stands for that run."""
    if path.is_dir() and not logdir.has_traces(path) and not series_files(path):
        found = logdir.runs(path)
        if len(found) == 1:
            return found[0][1]
        if len(found) > 1:
            names = ", ".join(name for name, _ in found[:5])
            raise TraceError(f"{path} holds {len(found)} runs ({names}...); name one")
    return path


def side(path_text: str, *, max_bytes: int | None = None) -> Side:
    """What ``compare`` needs from one argument: its series median, its traces' step time and verdict."""
    from ..pipeline import analyze_path

    path = Path(path_text)
    if not path.exists():
        raise TraceError(f"{path_text}: no such trace file or run directory")
    path = _run_folder(path)
    timeline = read_run_timeline(path) if path.is_dir() else None
    has_traces = path.is_file() or logdir.has_traces(path)
    profiled_ms = verdict = None
    if has_traces:
        report = analyze_path(path, max_bytes=max_bytes)
        profiled_ms = report.step_time_us / 1e3
        verdict = str(report.primary.kind)
    if timeline is None and not has_traces:
        raise TraceError(f"{path_text}: no trace files and no step series in this directory")
    return Side(
        source=path_text,
        unprofiled_median_ms=None if timeline is None else timeline.unprofiled_median_ms,
        profiled_ms=None if profiled_ms is None else round(profiled_ms, 3),
        verdict=verdict,
        steps=None if timeline is None else timeline.steps,
    )


_NAME = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"
SERVER_RUN_RE = re.compile(rf"({_NAME})/({_NAME})")


def server_run_name(text: str) -> tuple[str, str] | None:
    """(project, run) when ``text`` reads ``project/run`` (the server's name alphabet), else None."""
    match = SERVER_RUN_RE.fullmatch(text)
    return (match.group(1), match.group(2)) if match else None


def server_side(server: str, token: str | None, project: str, run: str, *, timeout: float = 60.0) -> Side:
    """What ``compare`` needs from a run on a stepdoctor server (the server builds it with the
    same :class:`Side`); stdlib HTTP, TLS verified. Failures raise :class:`TraceError` (one line)."""
    base = server.rstrip("/")
    if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
        raise TraceError(f"--server must be an http:// or https:// URL, not {server!r}")
    quote = urllib.parse.quote
    url = f"{base}/api/v1/projects/{quote(project, safe='')}/runs/{quote(run, safe='')}/check"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    where = f"{project}/{run} on {base}"
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read(16 * 2**20)
    except urllib.error.HTTPError as exc:
        raise TraceError(f"{where}: HTTP {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise TraceError(f"{where}: cannot reach the server: {reason}") from None
    try:
        return msgspec.json.decode(body, type=Side)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{where}: the server's answer is not a run to compare: {exc}") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The API's one-line ``{"error": {"message"}}``, or the status text."""
    try:
        message = json.loads(exc.read(65536) or b"{}")["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return str(exc.reason)
    return str(message)[:300]


def resolve_side(text: str, args: argparse.Namespace) -> Side:
    """One argument as a :class:`Side`: a local path, else (with ``--server``) ``project/run`` there."""
    named = server_run_name(text) if args.server else None
    if named is not None and not Path(text).exists():
        token = args.token or os.environ.get("STEPDOCTOR_TOKEN") or None
        return server_side(args.server, token, *named, timeout=args.timeout)
    return side(text, max_bytes=args.max_bytes)


def render_line(c: Comparison) -> str:
    """The one line CI logs show."""
    basis = (
        "unprofiled steady-state median step time"
        if c.basis == "unprofiled"
        else "profiled step time (capture windows; no step series on both sides)"
    )
    outcome = "REGRESSION" if c.regression else "ok"
    verdicts = f"verdict {c.candidate_verdict or 'n/a'} (baseline {c.baseline_verdict or 'n/a'}"
    verdicts += ", changed)" if c.verdict_changed else ")"
    return (
        f"stepdoctor check: {outcome}: {basis} {c.candidate_ms:.2f} ms vs baseline {c.baseline_ms:.2f} ms "
        f"({100 * c.change:+.1f}%, limit +{100 * c.max_regression:.1f}%); {verdicts}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        candidate = resolve_side(args.candidate, args)
        baseline = resolve_side(args.baseline, args)
        result = compare(candidate, baseline, max_regression=args.max_regression)
    except TraceError as exc:
        print(f"stepdoctor check: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"stepdoctor check: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # an engine bug: one line, the traceback on request
        if os.environ.get("STEPDOCTOR_DEBUG"):
            raise
        print(
            f"stepdoctor check: internal error: {type(exc).__name__}: {exc} "
            "(rerun with STEPDOCTOR_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 2
    code = 1 if result.regression else 0
    if args.format == "json":
        print(json.dumps(result.to_dict() | {"exit_code": code}, indent=2))
    else:
        print(render_line(result))
    return code
