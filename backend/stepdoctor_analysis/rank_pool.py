"""A directory of many rank files analysed by a process pool (``stepdoctor analyze DIR``).

Each worker parses and analyses one file at a time and sends back only its ``TraceSummary`` (and
its rank, for the job's order), so the parent holds summaries, never the job's traces or reports:
memory is a few traces (one per worker), not the job. The verdict is ``run_verdict.verdict_of``
over those summaries in the job's order (``parsing.job_order``), the function the server calls;
the report that stands for the run (``RunVerdict.lead``) is then analysed once more in-process, so
the output is the one the serial path gives (``pipeline._job_report``), byte for byte.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from .parsing import job_order, load_trace
from .report.document import Report
from .run.ranks import worker_name
from .run.timeline import Memory as SeriesMemory
from .run.trace_summary import TraceEntry, TraceSummary, summary_of
from .run.verdict import RunVerdict, verdict_of

Done = Callable[[int, int], None]  # (files analysed, files in all)
Analyze = Callable[..., Report]  # ``pipeline.analyze_trace`` (passed in: the pipeline calls this module)


def _summarise_file(
    task: tuple[Analyze, int, str, int | None, dict[str, Any] | None],
) -> tuple[int, int | None, bytes]:
    """In a worker: one file's summary (msgspec JSON: cheaper to send than a pickled struct tree)."""
    analyze_trace, index, path, max_bytes, metadata = task
    trace = load_trace(path, max_bytes=max_bytes)
    report = analyze_trace(trace, metadata=metadata).typed()
    summary = summary_of(TraceEntry(report, worker=worker_name(trace.source)), key=index)
    return index, trace.rank, msgspec.json.encode(summary)


def summarise_files(
    files: list[Path],
    analyze_trace: Analyze,
    *,
    workers: int,
    max_bytes: int | None = None,
    metadata: dict[str, Any] | None = None,
    done: Done | None = None,
) -> list[tuple[Path, TraceSummary]]:
    """Every file with its summary, in the job's order (``key`` and ``window``: the place there).

    A file that does not parse or analyse raises its ``TraceError`` here, the first in file order."""
    tasks = [(analyze_trace, i, str(f), max_bytes, metadata) for i, f in enumerate(files)]
    ranks: list[int | None] = [None] * len(files)
    summaries: list[TraceSummary | None] = [None] * len(files)
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    decoder = msgspec.json.Decoder(TraceSummary)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(files))), mp_context=context) as pool:
        for n, (index, rank, data) in enumerate(pool.map(_summarise_file, tasks), 1):
            ranks[index], summaries[index] = rank, decoder.decode(data)
            if done is not None:
                done(n, len(files))
    out = []
    for pos, i in enumerate(job_order(ranks)):
        summary = summaries[i]
        assert summary is not None
        out.append((files[i], msgspec.structs.replace(summary, key=pos, window=pos)))
    return out


def analyze_files(
    files: list[Path],
    analyze_trace: Analyze,
    *,
    workers: int,
    max_bytes: int | None = None,
    metadata: dict[str, Any] | None = None,
    done: Done | None = None,
    series: SeriesMemory | None = None,
) -> tuple[RunVerdict, Report]:
    """The job's verdict over every file, and the lead trace's report (analysed again, in-process);
    ``series``: the run's step-series memory (``run_verdict.run_verdict``)."""
    found = summarise_files(
        files, analyze_trace, workers=workers, max_bytes=max_bytes, metadata=metadata, done=done
    )
    verdict = verdict_of([s for _, s in found], series=series)
    source = found[verdict.lead if verdict.lead is not None else 0][0]
    return verdict, analyze_trace(load_trace(source, max_bytes=max_bytes), metadata=metadata)
