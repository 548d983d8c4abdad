"""``stepdoctor analyze PATH [--format text|json] [--rank N] [--max-bytes N]``: offline diagnosis.

PATH is a trace, a directory of one job's traces (ranks and capture windows), or a TensorBoard log
directory with one folder per run: then each run is analysed and listed in one row (``logdir``).

``--deep critical-path`` (or ``--diff OTHER``) adds HTA's critical path (or trace diff against OTHER)
from the optional ``stepdoctor[hta]`` extra, after the report; JSON puts it under a ``deep`` key.

Bad input exits with status 2 and one line on stderr, never a traceback: users feed this
arbitrary files. A progress line appears on stderr only once the analysis has taken over a second.

A directory of more than two traces is analysed by a process pool over every core (``--jobs``),
each rank's summary streamed back (``rank_pool``); ``analysed 412/1000 ranks`` is shown while it
runs when stderr is a terminal or with ``--progress``. A single file of 1 MiB or more is parsed by
two processes where there are two cores (``parsing.forked``), the child forked first thing, before
numpy, the parser and the analysis are imported (``parsing.forking``): the same trace, sooner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..errors import TraceError
from ..parsing import logdir

if TYPE_CHECKING:
    from ..parsing.forking import Started
    from ..report.document import Report

PROGRESS_AFTER_S = 1.0


class _Progress:
    """Shows the current stage on stderr after ``PROGRESS_AFTER_S``; silent for quick runs."""

    def __init__(self, stream: TextIO, delay: float = PROGRESS_AFTER_S) -> None:
        self.stream, self.delay = stream, delay
        self.t0 = time.monotonic()
        self.stage = "starting"
        self.shown = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        from ..parsing.forking import FORK_SAFE  # imported before any progress line

        # It only waits and writes to stderr: the parser may still fork a second process.
        setattr(self._thread, FORK_SAFE, True)
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, stage: str) -> None:
        self.stage = stage

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            line = f"stepdoctor: {self.stage}… {time.monotonic() - self.t0:.0f}s"
            if self.tty:
                self.stream.write("\r" + line.ljust(len(self.shown)))
                self.stream.flush()
                self.shown = line
            elif self.stage != self.shown:  # logs and pipes: one line per stage
                self.stream.write(f"stepdoctor: {self.stage}…\n")
                self.stream.flush()
                self.shown = self.stage
            if self._stop.wait(0.5):
                return


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def byte_size(text: str) -> int:
    """A byte count as people write it: ``4000000000``, ``4e9``, ``500MB``, ``4GiB``."""
    raw = text.strip().upper()
    number = raw.rstrip("KMGIB")
    unit = raw[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4e9, 500MB, 4GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return int(value)


def byte_text(n: float) -> str:
    """Bytes as people read them: ``812 B``, ``23.6 KiB``, ``4.6 MiB``, ``1.21 GiB`` (the dashboard's
    ``size`` too), so a small file is never "0.0 MiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            x = n / scale
            return f"{x:.3g} {unit}" if x < 1000 else f"{x:,.0f} {unit}"
    return f"{n:.0f} B"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepdoctor analyze", description="Diagnose PyTorch profiler traces offline."
    )
    p.add_argument(
        "path",
        nargs="?",
        help="trace file (.json or .json.gz), a directory of per-rank traces, or a TensorBoard log "
        "directory (one folder per run: lists the runs)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument(
        "--schema",
        action="store_true",
        help="print the JSON Schema of --format json's report (docs/report.schema.json) and exit",
    )
    p.add_argument("--rank", type=int, default=None, help="analyze only this rank of a directory")
    p.add_argument(
        "--max-bytes",
        type=byte_size,
        default=None,
        help="refuse traces larger than this when decompressed (bytes; 4e9, 500MB and 4GiB work too)",
    )
    p.add_argument("--deep", choices=("critical-path",), default=None, help="add HTA's critical path")
    p.add_argument("--diff", metavar="OTHER", default=None, help="add HTA's kernel-level diff PATH → OTHER")
    p.add_argument("--step", type=int, default=None, help="ProfilerStep number for --deep/--diff")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="processes for a directory of many traces; from 2, one file of 1 MiB or more is parsed by "
        "two (default: every core; 1: all in this process)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="show 'analysed N/M ranks' on stderr even when it is not a terminal",
    )
    return p


def _deep(args: argparse.Namespace, progress: _Progress) -> dict[str, Any] | None:
    if args.diff is None and args.deep is None:
        return None  # a plain report: HTA's module is not imported
    from ..analyzers import deep

    if args.diff is not None:
        progress("diffing traces (HTA)")
        return deep.trace_diff(
            args.path,
            args.diff,
            base_rank=args.rank,
            other_rank=args.rank,
            base_step=args.step,
            other_step=args.step,
        )
    if args.deep == "critical-path":
        progress("critical path (HTA)")
        return deep.critical_path(args.path, rank=args.rank, step=args.step)
    return None


def _run_summary(name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a log dir, analysed: what ``analyze`` prints first, in one row."""
    from ..pipeline import analyze_path

    row: dict[str, Any] = {"run": name, "path": str(folder)}
    try:
        report = analyze_path(folder, rank=args.rank, max_bytes=args.max_bytes).to_dict()
    except TraceError as exc:
        return row | {"error": str(exc)}
    except OSError as exc:
        return row | {"error": str(exc.strerror or exc)}
    ranks = report.get("ranks") or {}
    first = (report.get("recommendations") or [None])[0]
    return row | {
        "traces": ranks.get("windows", 1),
        "ranks": ranks.get("count", 1),
        "workload": (report.get("workload") or {}).get("kind"),
        "step_time_us": report["step_time_us"],
        "primary": {"kind": report["primary"]["kind"], "share": report["primary"]["share"]},
        "stragglers": ranks.get("stragglers", []),
        "next": None
        if first is None
        else {"id": first["id"], "title": first["title"], "expected_speedup": first["expected_speedup"]},
    }


def _render_runs(path: str, rows: list[dict[str, Any]]) -> str:
    from ..run.ranks import named_ranks

    lines = [
        f"{path}: a log directory of {len(rows)} runs; analyze one with: stepdoctor analyze {path}/RUN",
        "",
        f"  {'run':<24}{'traces':>7}{'ranks':>6}  {'step time':>10}  {'limited by':<22}next optimization",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['run']:<24}  error: {r['error']}")
            continue
        us = r["step_time_us"]
        step = f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} µs"
        verdict = f"{r['primary']['kind']} {100 * r['primary']['share']:.0f}%"
        nxt = f"{r['next']['title']} (up to {r['next']['expected_speedup']:.2f}×)" if r["next"] else "none"
        if r["stragglers"]:
            nxt += f"; straggler rank(s) {named_ranks([str(x) for x in r['stragglers']])}"
        lines.append(f"  {r['run']:<24}{r['traces']:>7}{r['ranks']:>6}  {step:>10}  {verdict:<22}{nxt}")
    return "\n".join(lines) + "\n"


def _list_runs(args: argparse.Namespace, found: list[tuple[str, Path]]) -> int:
    """A TensorBoard log dir with several runs: one summary row per run, not a failure."""
    if args.deep or args.diff is not None:
        print(
            f"stepdoctor analyze: {args.path} holds {len(found)} runs; --deep/--diff need one: "
            f"stepdoctor analyze {args.path}/{found[0][0]} ...",
            file=sys.stderr,
        )
        return 2
    with _Progress(sys.stderr) as progress:
        rows = []
        for i, (name, folder) in enumerate(found):
            progress(f"analyzing run {name} ({i + 1}/{len(found)})")
            rows.append(_run_summary(name, folder, args))
    if all("error" in r for r in rows):
        print(
            f"stepdoctor analyze: {args.path}: no run could be analysed ({rows[0]['error']})", file=sys.stderr
        )
        return 2
    if args.format == "json":
        print(_dumps({"logdir": args.path, "runs": rows}))
    else:
        sys.stdout.write(_render_runs(args.path, rows))
    return 0


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """Import numpy without the OpenBLAS thread pool it starts on load: the analysis does no linear
    algebra, and the pool's start-up cost ~40 ms of CPU per run (``analyze`` on df_index_resolver:
    0.465 -> 0.423 s CPU). A user's own setting wins; the variable is not left behind (a process
    that called ``main`` spawns children with its own environment)."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


def _run_timeline(path: Path) -> dict[str, Any] | None:
    """The agent's step series beside the traces (``run_timeline``), when the run has one.

    Only a folder can hold one: a single trace file does not import the module (~3 ms of a
    ~0.45 s ``analyze``)."""
    if not path.is_dir():
        return None
    from ..run.timeline import read_run_timeline

    timeline = read_run_timeline(path)
    return None if timeline is None else timeline.to_dict()


def _dumps(value: Any) -> str:
    """``json.dumps(value, indent=2)``, the same text, from json's C encoder re-indented by msgspec:
    json indents in pure Python (6 ms of a ~0.45 s ``analyze`` on a 330 KB report, 1.8 ms this way).
    NaN/Infinity, which msgspec does not read, take json's own path."""
    import msgspec

    compact = json.dumps(value)
    try:
        return msgspec.json.format(compact, indent=2)
    except msgspec.DecodeError:
        return json.dumps(value, indent=2)


def _timeline_only(args: argparse.Namespace, timeline: dict[str, Any]) -> int:
    """A run folder with a step series and no trace yet (no window captured): the timeline alone."""
    if args.format == "json":
        print(_dumps({"run_timeline": timeline}))
    else:
        from ..run import timeline as run_timeline

        sys.stdout.write(
            f"{args.path}: no trace captured yet; the step series:\n" + run_timeline.render_text(timeline)
        )
    return 0


def _cores() -> int:
    count = getattr(os, "process_cpu_count", None)  # Python 3.13: the cores this process may use
    return (count() if count is not None else None) or os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.schema:
        from ..report.contract import schema_text

        sys.stdout.write(schema_text())
        return 0
    if args.path is None:
        parser.error("the following arguments are required: path")
    if args.jobs is None:
        args.jobs = _cores()
    started: Started | None = None
    try:
        with _one_blas_thread():
            started = _start_parsing(args)
            from ..pipeline import analyze_path  # imported while the forked child parses
        return _analyze(args, analyze_path, started)
    finally:
        if started is not None:
            started.cancel()  # collected already when the trace loaded; not when it failed early


def _start_parsing(args: argparse.Namespace) -> Started | None:
    """One trace file, more than one worker: fork its second parser before importing numpy, the
    parser and the analysis, which each process then imports on its own core (``parsing.start_trace``)."""
    if args.jobs < 2 or not Path(args.path).is_file():
        return None
    from ..parsing import start_trace

    return start_trace(args.path, max_bytes=args.max_bytes)


def _analyze(args: argparse.Namespace, analyze_path: Callable[..., Report], started: Started | None) -> int:
    folder = Path(args.path)
    if folder.is_dir() and not logdir.has_traces(folder) and (found := logdir.runs(folder)):
        if len(found) > 1:
            return _list_runs(args, found)
        args.path = str(found[0][1])  # one run below the log dir: analyze it as the job
    try:
        timeline = _run_timeline(Path(args.path))
        if timeline is not None and not logdir.has_traces(Path(args.path)):
            return _timeline_only(args, timeline)
        if args.deep or args.diff is not None:
            from ..analyzers.deep import require_hta

            require_hta()  # fail before the long part, not after it
        with _Progress(sys.stderr) as progress:
            counts = args.progress or progress.tty
            report = analyze_path(
                args.path,
                rank=args.rank,
                max_bytes=args.max_bytes,
                progress=progress,
                workers=args.jobs,
                done=(lambda n, total: progress(f"analysed {n}/{total} ranks")) if counts else None,
                started=started,
            )
            deep_result = _deep(args, progress)
    except TraceError as exc:
        print(f"stepdoctor analyze: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"stepdoctor analyze: {args.path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print(
            f"stepdoctor analyze: {args.path}: out of memory while analyzing; try --max-bytes",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:  # an engine bug: still one line, with a way to get the traceback
        if os.environ.get("STEPDOCTOR_DEBUG"):
            raise
        print(
            f"stepdoctor analyze: internal error on {args.path}: {type(exc).__name__}: {exc} "
            "(rerun with STEPDOCTOR_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
    extra = {"run_timeline": timeline} if timeline is not None else {}
    if args.format == "json":
        print(_dumps(report.to_dict() | extra | ({"deep": deep_result} if deep_result else {})))
    else:
        sys.stdout.write(report.render_text())
        if timeline is not None:
            from ..run import timeline as run_timeline

            sys.stdout.write("\n" + run_timeline.render_text(timeline))
        if deep_result:
            from ..analyzers.deep import render_text

            sys.stdout.write("\n" + render_text(deep_result))
    return 0
