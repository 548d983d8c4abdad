"""Analysis speed and memory: stepdoctor vs HTA 0.5.0 vs the decode floor, side by side in one run.

For every GPU fixture and one large trace (≥ 800 MB decompressed, built in a temp dir by repeating
``df_index_resolver``'s events shifted in time), each contender runs in a fresh subprocess; we report
its wall time (imports excluded), the whole process's wall time, its peak RSS (``VmHWM``,
imports included) and how far that peak rose above what the imports alone reached:
- ours: ``load_trace`` + steps + breakdown + GPU metrics + HTA-style temporal/idle/launch metrics;
- pipeline: the full ``pipeline.analyze_path`` report, when that module exists, parsed in one process;
- cli: ``stepdoctor analyze --format json PATH`` as a user runs it, every import and its exit counted (its
  ``proc s`` against HTA's whole process is the "whole process" figure); on Linux with two cores it
  forks a second parser (``parsing.forked``), whose CPU time is counted with the process's;
- hta: ``TraceAnalysis`` load + temporal breakdown + idle-time breakdown (the rank passed);
- floor: gzip decompression + one typed msgspec decode of the whole file (the naive lower bound);
- stream: our own streaming decompress + chunked typed decode with the column building switched off
  (the lower bound of our design: ours/stream is what the columnar model costs).
Targets: ≥ 10× faster than HTA at ≤ 1/4 of its memory; the large trace in ≤ 15 s under 1.5 GB.
Memory of the whole ``stepdoctor analyze``, forked parser included, is sampled from outside in one
more untimed run (``sampled_peak_mb``: peak PSS over the process tree), for the large trace always.
Times are medians over ``--repeat`` fresh runs; ours whole (cli) and HTA run alternately, round by
round, and their ratio is the median of the per-round ratios (the machine's load drifts).

``--baseline REV`` adds our own engine at git revision REV (default ``86a9f11``, the engine before the
verdict work of issue #9) as a contender: its ``pipeline`` runs alternate with ours in fresh processes,
and the table gains the ratio of our time to its, for the analysis and for the whole process (imports
included: what ``stepdoctor analyze`` makes a user wait). Issue #9 allows at most 10% slower.

Run: ``.venv/bin/python bench/analysis_speed.py [--skip-large] [--only NAME] [--min-mb MB] [--baseline [REV]]``.
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.fixtures import GPU_FIXTURES  # noqa: E402  (the tests' list: every GPU fixture, one place)
from support.fixtures import HTA_TRACES as FIXTURES  # noqa: E402

LARGE_SOURCE = "df_index_resolver/df_index_resolver.json.gz"
LARGE_TARGET_BYTES = 820 * 2**20
HTA_MAX_SECONDS = 180
BASELINE = "86a9f11"  # the engine before issue #9's verdict work; the slowdown it allows is 10%

# Each child prints one JSON line: {"seconds": ..., "rss_mb": ...}.
CHILD = r"""
import json, sys, time
mode, path, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
def status_mb(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) / 1024
if mode == "ours":
    from stepdoctor_analysis.analyzers import breakdown, gpu_metrics, hta_metrics
    from stepdoctor_analysis import parsing as parse
    from stepdoctor_analysis.model import steps
    imported_mb = status_mb("VmHWM")
    t = time.perf_counter()
    tr = parse.load_trace(path)
    st = steps.find_steps(tr)
    breakdown.compute_breakdown(tr, st)
    gpu_metrics.compute_gpu_metrics(tr, st)
    hta_metrics.temporal_breakdown(tr)
    hta_metrics.idle_time_breakdown(tr)
    hta_metrics.kernel_launch_stats(tr)
elif mode == "pipeline":
    from stepdoctor_analysis import pipeline
    imported_mb = status_mb("VmHWM")
    t = time.perf_counter()
    pipeline.analyze_path(path).to_dict()
    print(json.dumps({"engine": pipeline.__file__}))
elif mode == "cli":
    import contextlib, io
    imported_mb = status_mb("VmHWM")  # the interpreter only: the command's imports are its work
    t = time.perf_counter()
    from stepdoctor.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["analyze", "--format", "json", path]) == 0
elif mode == "floor":
    import zlib, msgspec
    from stepdoctor_analysis.parsing.schema import Event as _Event
    class Top(msgspec.Struct):
        traceEvents: list[_Event]
    imported_mb = status_mb("VmHWM")
    t = time.perf_counter()
    with open(path, "rb") as fh:
        raw = fh.read()
    data = zlib.decompress(raw, zlib.MAX_WBITS | 16) if raw[:2] == b"\x1f\x8b" else raw
    del raw
    msgspec.json.decode(data, type=Top)
elif mode == "stream":
    from stepdoctor_analysis import parsing as parse
    from stepdoctor_analysis.errors import TraceError
    from stepdoctor_analysis.parsing import columns
    columns.Builder.absorb = lambda self, events: None  # decode every chunk, build nothing
    imported_mb = status_mb("VmHWM")
    t = time.perf_counter()
    try:
        parse.load_trace(path)
    except TraceError:
        pass  # "contains no events": expected, nothing was kept
elif mode == "hta":
    import logging, warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis
    imported_mb = status_mb("VmHWM")
    t = time.perf_counter()
    ta = TraceAnalysis(trace_dir=path)
    r = next(iter(ta.t.traces))
    ta.get_temporal_breakdown(visualize=False)
    ta.get_idle_time_breakdown(ranks=[r], visualize=False)
seconds = time.perf_counter() - t
# CPU time, imports included (steadier than wall time under load), with that of the processes it
# forked and reaped: ``parsing.forked``'s second parser is work done for this trace.
import os, resource
cpu = time.process_time() + sum(os.times()[2:4])
# VmHWM: this process's peak RSS (ru_maxrss would report the parent's, inherited across fork+exec);
# child_mb: the largest forked child's (its pages shared with this one included).
child_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "cpu_s": cpu, "rss_mb": status_mb("VmHWM"), "import_mb": imported_mb,
                  "child_mb": child_mb}))
if mode == "cli":  # and the console script's own exit (``stepdoctor.cli.finish``), timed with the process
    from stepdoctor.cli import finish
    finish(0, "analyze")
"""


def run_child(
    mode: str, path: Path, rank: int = 0, timeout: float = 900, engine: Path | None = None
) -> dict[str, float] | None:
    """One fresh process; ``engine``: a checkout's ``backend`` folder imported instead of ours."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if engine is not None:
        env["PYTHONPATH"] = str(engine)
    started = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(path), str(rank)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    timings = [d for d in lines if "seconds" in d]
    if out.returncode != 0 or not timings:
        print(f"  [{mode} failed on {path.name}: {out.stderr.strip().splitlines()[-1:]}]", file=sys.stderr)
        return None
    for d in lines:  # the pipeline says which engine it imported: a baseline must not measure ours
        if "engine" in d and engine is not None and not Path(d["engine"]).is_relative_to(engine):
            raise SystemExit(f"baseline run imported {d['engine']}, not the checkout in {engine}")
    result: dict[str, float] = timings[-1]
    result["process_s"] = time.perf_counter() - started
    return result


def sampled_peak_mb(mode: str, path: Path, timeout: float = 900) -> float | None:
    """One more fresh run, its memory watched from outside: the largest sum of the proportional set
    sizes (PSS: a page two processes share counts half in each) of the process and every process it
    forked, read every 10 ms. Its own run, so the sampling never touches a timed one: with
    ``parsing.forked`` the analysis is two processes, and their two peak RSS counted apart would
    count the pages they share twice, and their peaks, which come at different times, as one."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        return None  # no way to find the processes it forks: a figure would leave them out
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(path), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    peak, deadline = 0.0, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        peak = max(peak, sum(_pss_kb(pid) for pid in _tree(proc.pid)) / 1024)
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        return None
    return peak if proc.returncode == 0 else None


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, as /proc lists them now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("Pss:")), 0)
    except OSError:
        return 0  # it ended between the listing and the read


def run_best(mode: str, path: Path, repeat: int, timeout: float = 900) -> dict[str, float] | None:
    """Median of ``repeat`` fresh runs (and the fastest), with the largest peak RSS seen: sub-second
    timings on a shared 2-core machine vary by tens of percent from one run to the next."""
    return _summary([run_child(mode, path, timeout=timeout) for _ in range(repeat)])


def run_alternating(
    contenders: list[tuple[str, Path, Path | None, float]], repeat: int
) -> list[dict[str, float] | None]:
    """Each contender ``(mode, path, engine, timeout)`` once per round, ``repeat`` rounds, so that all
    see the same machine: on a shared machine the load drifts within minutes, and contenders run in
    blocks one after the other would each see a different one. Their ``pair_ratios`` (against the
    first contender, round by round) let a ratio's median be taken over rounds."""
    runs: list[list[dict[str, float] | None]] = [[] for _ in contenders]
    for _ in range(repeat):
        for got, (mode, path, engine, timeout) in zip(runs, contenders, strict=True):
            got.append(run_child(mode, path, timeout=timeout, engine=engine))
    out = [_summary(got) for got in runs]
    for got, summary in zip(runs[1:], out[1:], strict=True):
        if summary is not None:
            pairs = [(a, b) for a, b in zip(runs[0], got, strict=True) if a is not None and b is not None]
            summary["pair_process"] = _median([b["process_s"] / a["process_s"] for a, b in pairs])
            summary["pair_seconds"] = _median([b["seconds"] / a["seconds"] for a, b in pairs])
            summary["pair_cpu"] = _median([b["cpu_s"] / a["cpu_s"] for a, b in pairs])
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summary(runs: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Median times (``best_*``: the fastest) and the largest peak RSS of the runs that finished."""
    results = [r for r in runs if r is not None]
    if not results:
        return None
    return {
        "seconds": _median([r["seconds"] for r in results]),
        "process_s": _median([r["process_s"] for r in results]),
        "cpu_s": _median([r["cpu_s"] for r in results]),
        "best_seconds": min(r["seconds"] for r in results),
        "best_process_s": min(r["process_s"] for r in results),
        "rss_mb": max(r["rss_mb"] for r in results),
        "import_mb": max(r["import_mb"] for r in results),
        "child_mb": max(r.get("child_mb", 0.0) for r in results),
        "runs": len(results),
    }


def checkout_engine(rev: str, dest: Path) -> Path:
    """The analysis engine at git revision ``rev``, exported to ``dest``; its ``backend`` folder."""
    got = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "backend"], capture_output=True, check=False
    )
    if got.returncode != 0:  # e.g. a shallow clone without that commit
        raise SystemExit(f"--baseline {rev}: git archive failed: {got.stderr.decode().strip()}")
    data = got.stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=data, check=True)
    compileall.compile_dir(str(dest / "backend"), quiet=1)
    return dest / "backend"


def decompressed_size(path: Path) -> int:
    with gzip.open(path, "rb") as fh:
        size = 0
        while chunk := fh.read(16 << 20):
            size += len(chunk)
    return size


def build_large(dest: Path) -> Path:
    """Repeat the source trace's events, shifted past the previous copy, until ≥ LARGE_TARGET_BYTES.

    Correlation/external ids and step numbers are offset per copy so joins and steps stay unique;
    the file is written one event per line, like Kineto does.
    """
    with gzip.open(FIXTURES / LARGE_SOURCE) as fh:
        top = json.load(fh)
    every = top.pop("traceEvents")
    events = [e for e in every if e.get("ph") != "M"]
    meta = [e for e in every if e.get("ph") == "M"]
    t0 = min(e["ts"] for e in events if "ts" in e)
    t1 = max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e)
    span = int(t1 - t0) + 1000
    out = dest / "large.json.gz"
    written = 0
    with gzip.open(out, "wb", compresslevel=1) as gz:
        head = json.dumps(top)[:-1].encode() + b', "traceEvents": [\n'
        gz.write(head)
        written += len(head)
        copy = 0
        first = True
        while written < LARGE_TARGET_BYTES:
            shift = copy * span
            lines = []
            for e in events + (meta if copy == 0 else []):
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = e2["ts"] + shift
                args = e2.get("args")
                if isinstance(args, dict):
                    args = dict(args)
                    for key in ("correlation", "External id", "external id"):
                        if isinstance(args.get(key), int) and args[key] > 0:
                            args[key] += copy * 10_000_000
                    e2["args"] = args
                if e2.get("ph") in ("s", "f") and isinstance(e2.get("id"), int):
                    e2["id"] += copy * 10_000_000
                name = e2.get("name", "")
                if isinstance(name, str) and name.startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{int(name.split('#')[1]) + copy * 100}"
                lines.append(json.dumps(e2))
            block = (b"" if first else b",\n") + ",\n".join(lines).encode()
            first = False
            gz.write(block)
            written += len(block)
            copy += 1
        gz.write(b"\n]}\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--only", help="substring of a fixture name")
    ap.add_argument("--repeat", type=int, default=3, help="runs per contender on the fixtures (median taken)")
    ap.add_argument(
        "--large-repeat", type=int, default=1, help="runs of cli, HTA and pipelines on the large trace"
    )
    ap.add_argument(
        "--sample-memory",
        action="store_true",
        help="also sample every trace's whole-process-tree peak PSS in one more run (always for the large one)",
    )
    ap.add_argument(
        "--min-mb", type=float, default=0.0, help="only traces of at least this many MB decompressed"
    )
    ap.add_argument(
        "--baseline",
        nargs="?",
        const=BASELINE,
        metavar="REV",
        help=f"also time our engine at git revision REV (default {BASELINE}) against this one",
    )
    args = ap.parse_args(argv)
    have_pipeline = (REPO / "backend" / "stepdoctor_analysis" / "pipeline.py").exists()
    cases: list[tuple[str, Path, bool]] = [
        (rel.removesuffix(".json.gz"), FIXTURES / rel, False)
        for rel in GPU_FIXTURES
        if (FIXTURES / rel).exists()
    ]
    compile_bytecode()
    tmp = Path(tempfile.mkdtemp(prefix="stepdoctor-bench-"))
    try:
        engine = None
        if args.baseline:
            (tmp / "baseline").mkdir()
            engine = checkout_engine(args.baseline, tmp / "baseline")
        if not args.skip_large:
            t = time.perf_counter()
            large = build_large(tmp)
            print(
                f"built {large.name}: {large.stat().st_size / 2**20:.0f} MB gz in {time.perf_counter() - t:.0f} s"
            )
            cases.append(("large (df_index x N)", large, True))
        if args.only:
            cases = [c for c in cases if args.only in c[0]]
        rows: list[tuple[Any, ...]] = []
        against: list[tuple[str, float, dict[str, float] | None, dict[str, float] | None]] = []
        hta_rate = None  # seconds per decompressed MB, to decide whether HTA can finish the large one
        for label, path, is_large in cases:
            mb = decompressed_size(path) / 2**20
            if mb < args.min_mb:
                continue
            repeat = max(1, args.large_repeat if is_large else args.repeat)
            ours = run_best("ours", path, 1 if is_large else repeat)
            base = None
            if engine is not None:
                pipe, base = run_alternating(
                    [("pipeline", path, None, 900), ("pipeline", path, engine, 900)], repeat
                )
            else:
                pipe = run_best("pipeline", path, repeat) if have_pipeline else None
            floor = run_best("floor", path, 1 if is_large else repeat)
            stream = run_best("stream", path, 1 if is_large else repeat)
            cli: dict[str, float] | None = None
            hta: dict[str, float] | None = None
            note = ""
            if is_large and hta_rate is not None and hta_rate * mb > HTA_MAX_SECONDS:
                note = f"HTA skipped: ~{hta_rate * mb:.0f} s expected (> {HTA_MAX_SECONDS} s)"
                cli = run_best("cli", path, repeat) if have_pipeline else None
            else:
                hdir = tmp / f"hta-{len(rows)}"
                hdir.mkdir()
                os.symlink(path, hdir / path.name)
                # ours whole (cli) and HTA's, alternately: the "whole process" ratio is taken per round
                cli, hta = run_alternating(
                    [("cli", path, None, 900), ("hta", hdir, None, HTA_MAX_SECONDS * 2)], repeat
                )
                if hta is None:
                    note = "HTA failed or timed out"
                elif label.startswith("df_index"):
                    hta_rate = hta["seconds"] / mb
            if is_large or args.sample_memory:
                ours_pss = sampled_peak_mb("cli", path)
                hta_pss = sampled_peak_mb("hta", tmp / f"hta-{len(rows)}") if hta is not None else None
                print(
                    f"  {label}: peak PSS, every process together (sampled, untimed run): "
                    f"stepdoctor analyze {_mb(ours_pss)}, HTA {_mb(hta_pss)}, ratio {_ratio(ours_pss, hta_pss)}",
                    flush=True,
                )
            rows.append((label, mb, ours, pipe, hta, floor, stream, note, cli))
            print_row(rows[-1])
            if engine is not None:
                against.append((label, mb, pipe, base))
        print_table(rows)
        if engine is not None:
            print_against(against, args.baseline)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def print_row(row: tuple[Any, ...]) -> None:
    label, mb, ours, pipe, hta, floor, stream, note, cli = row

    def sec(r: dict[str, float] | None) -> str:
        if r is None:
            return "-"
        child = f"+child {r['child_mb']:.0f}MB" if r.get("child_mb") else ""
        return f"{r['seconds']:.3f}s/{r['rss_mb']:.0f}MB{child}"

    print(
        f"  {label}: {mb:.0f} MB ours={sec(ours)} pipeline={sec(pipe)} hta={sec(hta)} floor={sec(floor)} "
        f"stream={sec(stream)} cli={sec(cli)} {note}",
        flush=True,
    )


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} MB"


def _ratio(a: float | None, b: float | None, unit: str = "") -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}{unit}"


def _cli_ratio(cli: dict[str, float] | None, hta: dict[str, float] | None, of: str = "process") -> str:
    """HTA's whole process over ours (wall time, or ``of="cpu"``: CPU time, which other sessions' load
    disturbs less; HTA's counts every thread it runs): the median of the per-round ratios."""
    if hta is not None and f"pair_{of}" in hta:
        return f"{hta[f'pair_{of}']:.2f}x"
    key = "process_s" if of == "process" else "cpu_s"
    return _ratio(None if hta is None else hta[key], None if cli is None else cli[key], "x")


def print_table(rows: list[tuple[Any, ...]]) -> None:
    """One line per trace. Speed: the analysis itself (imports excluded), then whole processes.

    Memory: the peak RSS of each process (imports included), and the peak *above* what the
    imports alone reached (``+MB``): on sub-MB traces both contenders sit at their import floor.
    """
    head = (
        f"{'trace':<34} {'MB':>5} | {'pipe s':>7} {'HTA s':>7} {'HTA/pipe':>8} | {'ours s':>7} {'HTA/ours':>8} | "
        f"{'pipe MB':>7} {'HTA MB':>7} {'ratio':>5} | {'+pipe':>6} {'+HTA':>6} {'ratio':>5} | "
        f"{'proc s':>6} {'HTA':>6} {'ratio':>6} | {'cli s':>6} {'ratio':>6} {'cliCPU':>6} {'HTACPU':>6} {'ratio':>6} | "
        f"{'floor s':>7} {'MB':>5} | "
        f"{'strm s':>6}"
    )
    print()
    print(head)
    print("-" * len(head))
    for label, mb, ours, pipe, hta, floor, stream, note, cli in rows:

        def g(r: dict[str, float] | None, key: str) -> float | None:
            return None if r is None else r[key]

        def num(x: float | None, width: int, digits: int = 3) -> str:
            return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"

        extra = [None if r is None else r["rss_mb"] - r["import_mb"] for r in (pipe, hta)]
        print(
            f"{label[-34:]:<34} {mb:>5.0f} | {num(g(pipe, 'seconds'), 7)} {num(g(hta, 'seconds'), 7)} "
            f"{_ratio(g(hta, 'seconds'), g(pipe, 'seconds'), 'x'):>8} | {num(g(ours, 'seconds'), 7)} "
            f"{_ratio(g(hta, 'seconds'), g(ours, 'seconds'), 'x'):>8} | "
            f"{num(g(pipe, 'rss_mb'), 7, 0)} {num(g(hta, 'rss_mb'), 7, 0)} {_ratio(g(pipe, 'rss_mb'), g(hta, 'rss_mb')):>5} | "
            f"{num(extra[0], 6, 0)} {num(extra[1], 6, 0)} {_ratio(extra[0], extra[1]):>5} | "
            f"{num(g(pipe, 'process_s'), 6, 2)} {num(g(hta, 'process_s'), 6, 2)} "
            f"{_ratio(g(hta, 'process_s'), g(pipe, 'process_s'), 'x'):>6} | "
            f"{num(g(cli, 'process_s'), 6, 2)} {_cli_ratio(cli, hta):>6} "
            f"{num(g(cli, 'cpu_s'), 6, 2)} {num(g(hta, 'cpu_s'), 6, 2)} {_cli_ratio(cli, hta, 'cpu'):>6} | "
            f"{num(g(floor, 'seconds'), 7)} {num(g(floor, 'rss_mb'), 5, 0)} | {num(g(stream, 'seconds'), 6)}"
            + (f"  ({note})" if note else "")
        )


def print_against(
    rows: list[tuple[str, float, dict[str, float] | None, dict[str, float] | None]], rev: str
) -> None:
    """Our pipeline vs the engine at ``rev``: the analysis alone, the whole process, and its CPU time
    (user + system, imports included), which other sessions' load disturbs less than wall time."""
    head = (
        f"{'trace':<34} {'MB':>5} | {'pipe s':>8} {rev + ' s':>12} {'ratio':>6} | "
        f"{'proc s':>6} {rev + ' s':>12} {'ratio':>6} | {'CPU s':>6} {rev + ' s':>12} {'ratio':>6}"
    )
    print(
        f"\nThis engine vs {rev} (median times of fresh processes run alternately; ratio: median of the "
        "per-round ratios, > 1: slower now)"
    )
    print(head)
    print("-" * len(head))
    worst: dict[str, tuple[float, str]] = {}
    for label, mb, pipe, base in rows:
        if pipe is None or base is None:
            print(f"{label[-34:]:<34} {mb:>5.0f} | failed")
            continue
        # Medians of the per-round ratios (the two ran alternately, round by round).
        r_pipe, r_proc, r_cpu = 1 / base["pair_seconds"], 1 / base["pair_process"], 1 / base["pair_cpu"]
        for key, r in (("analysis", r_pipe), ("process", r_proc), ("process CPU", r_cpu)):
            if r > worst.get(key, (0.0, ""))[0]:
                worst[key] = (r, label)
        print(
            f"{label[-34:]:<34} {mb:>5.0f} | {pipe['seconds']:>8.4f} {base['seconds']:>12.4f} {r_pipe:>6.2f} | "
            f"{pipe['process_s']:>6.2f} {base['process_s']:>12.2f} {r_proc:>6.2f} | "
            f"{pipe['cpu_s']:>6.2f} {base['cpu_s']:>12.2f} {r_cpu:>6.2f}"
        )
    for key, (r, label) in worst.items():
        print(f"worst {key} ratio: {r:.2f} ({label})")


def compile_bytecode() -> None:
    """pip compiles an installed package's modules; this editable checkout may not have them.

    Without .pyc files (e.g. ``PYTHONDONTWRITEBYTECODE=1``), every fresh process would compile our
    sources on import, and pay for it in peak RSS, while HTA's installed modules are compiled.
    """
    for pkg in ("backend", "agent"):
        compileall.compile_dir(str(REPO / pkg), quiet=1)


if __name__ == "__main__":
    raise SystemExit(main())
