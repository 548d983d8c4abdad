"""Path in, report out: load → steps → analyzers → time accounting → rules → Report.

The only place with side inputs (host RAM via ``os.sysconf``, run metadata); the analyzers below it
stay pure functions of the trace.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from . import parsing as parse
from .analyzers import breakdown as bd
from .analyzers import gpu_metrics, step_timeline, tables
from .analyzers import hta_metrics as hta
from .analyzers import timeline as tl
from .analyzers.comm import analyze_comm
from .analyzers.floors import analyze_floors
from .analyzers.inputs import analyze_inputs, loader_settings
from .analyzers.memory import analyze_memory, memory_curves
from .analyzers.ops import analyze_ops
from .analyzers.precision import DeviceCaps, trace_caps
from .analyzers.recurrence import pass_waits
from .analyzers.sync import analyze_sync
from .analyzers.transfers import analyze_transfers
from .analyzers.workload import detect_workload
from .errors import TraceError
from .model import steps
from .model.arrays import median_of
from .model.trace import RankTrace
from .parsing import job_files
from .report.document import Report, StepRow, field_dict, plain
from .rules import KINDS, diagnose, pattern_minimums
from .rules.memory_advice import report_section as memory_section
from .rules.record import Context

if TYPE_CHECKING:
    from .parsing.forking import Started
    from .run.verdict import RunVerdict

Progress = Callable[[str], None]


def analyze_path(
    path: str | Path,
    *,
    rank: int | None = None,
    max_bytes: int | None = None,
    progress: Progress | None = None,
    metadata: dict[str, Any] | None = None,
    workers: int = 1,
    done: Callable[[int, int], None] | None = None,
    started: Started | None = None,
) -> Report:
    """Diagnose a trace file, or a directory of per-rank traces (adds the ``ranks`` section).

    ``workers`` > 1: a directory of more than two files is analysed by that many processes
    (``rank_pool``), each file's summary streamed back, ``done(analysed, total)`` after each;
    fewer files are each parsed by two processes (``parsing.forked``). ``started``: the second
    parser ``parsing.start_trace`` forked for the file ``path``."""
    say = progress or (lambda _msg: None)
    p = Path(path)
    if rank is None and workers > 1 and p.is_dir() and len(files := job_files(p)) > 2:
        from . import rank_pool  # many files: a process pool, summaries only

        say(f"analyzing {len(files)} traces in {min(workers, len(files))} processes")
        verdict, top = rank_pool.analyze_files(
            files,
            analyze_trace,
            workers=workers,
            max_bytes=max_bytes,
            metadata=metadata,
            done=done,
            series=_series_memory(p),
        )
        return _with_verdict(p, top, verdict)
    say(f"loading {p.name}")
    traces = parse.load_job(p, max_bytes=max_bytes, workers=workers, started=started)
    if rank is not None:
        traces = [t for t in traces if t.rank == rank or (t.rank is None and len(traces) == 1)]
        if not traces:
            raise TraceError(f"{p.name}: no trace for rank {rank}")
    reports = []
    for i, t in enumerate(traces):
        say(f"analyzing {Path(t.source).name}" + (f" ({i + 1}/{len(traces)})" if len(traces) > 1 else ""))
        reports.append(analyze_trace(t, metadata=metadata))
    if len(reports) == 1:
        return reports[0]
    return _job_report(p, traces, reports)


def analyze_trace(
    trace: RankTrace, *, metadata: dict[str, Any] | None = None, host_memory: int | None = None
) -> Report:
    """Diagnose one rank's parsed trace. ``metadata``: the run metadata the caller has (the server:
    the upload's), merged with what the trace embeds (``run_metadata``); ``host_memory``: host RAM in
    bytes, by default read from that metadata (``_host_memory``)."""
    metadata = run_metadata(trace, metadata)
    if host_memory is None:
        host_memory = _host_memory(metadata)
    iters = steps.find_iterations(trace)
    step_list = iters.steps
    if not step_list:
        raise TraceError(f"{Path(trace.source).name}: the trace holds no activity to analyze")
    breakdown = bd.compute_breakdown(trace, step_list)
    inputs = analyze_inputs(trace, step_list)
    sync = analyze_sync(trace, step_list)
    memory = analyze_memory(trace, step_list, host_memory=host_memory)
    comm = analyze_comm(trace, step_list)
    evidence = diagnose.Evidence(inputs, sync, memory, comm_host=comm.host_collective_ns_per_step > 0)
    acc = diagnose.account(trace, step_list, evidence)
    ctx = Context(
        has_gpu=bool(trace.has_gpu and len(trace.gpu)),
        device=trace.devices[0] if trace.devices else None,
        n_steps=len(step_list),
        has_step_markers=bool(steps.step_marker_mask(trace).any()),
        step_ns=tl.mean_or_zero(acc.step_ns),
        accounting=acc,
        transfers=analyze_transfers(trace, step_list),
        sync=sync,
        memory=memory,
        comm=comm,
        inputs=inputs,
        ops=analyze_ops(trace, step_list, pattern_minimums()),
        loader=loader_settings(metadata),
        launch=hta.kernel_launch_stats(trace) if trace.has_gpu else None,
        caps=trace_caps(trace),
        iterations_found=iters.found,
        workload=detect_workload(trace, step_list, metadata),
        floors=analyze_floors(trace, step_list) if acc.on_gpu else None,
        pass_waits=pass_waits(acc, step_list, iters.found),
    )
    dx = diagnose.classify(ctx)
    per_kind = {k: acc.kinds[k].tolist() for k in (*KINDS, "other")}
    rows = [
        StepRow(
            number=s.number,
            start_us=round(s.start / 1e3, 3),
            duration_us=round((s.end - s.start) / 1e3, 3),
            kinds={k: round(ns[i] / 1e3, 3) for k, ns in per_kind.items()},
        )
        for i, s in enumerate(step_list)
    ]
    dev = ctx.device
    return Report(
        source=trace.source,
        primary=dx.primary,
        secondary=dx.secondary,
        recommendations=dx.recommendations,
        findings=dx.findings,
        breakdown=breakdown.average_us(),
        steps=rows,
        metrics=_metrics(trace, ctx, step_list),
        step_time_us=round(ctx.step_ns / 1e3, 3),
        rank=trace.rank,
        world_size=trace.world_size,
        format=trace.format,
        device=_device(dev, ctx.caps) if ctx.has_gpu else None,
        warnings=_warnings(ctx, iters),
        workload=plain(ctx.workload),
        iterations=_iterations(iters, step_list),
        limiter=dx.limiter,
        tables=tables.build_tables(trace, step_list),  # JSON-ready: to_dict converts the report once
        timeline=step_timeline.build_timeline(trace, step_list, acc),
    )


def _device(dev: Any, caps: DeviceCaps | None) -> dict[str, Any]:
    """The GPU as the trace describes it; a GPU trace without ``deviceProperties`` is still a GPU."""
    out: dict[str, Any] = {
        "type": "gpu",
        "name": (dev.name if dev is not None and dev.name else None),
        "memory_gb": round(dev.total_memory / 2**30, 2) if dev is not None and dev.total_memory else None,
        "compute_capability": f"{dev.compute_major}.{dev.compute_minor}" if dev is not None else None,
    }
    if caps is not None:
        out |= {
            "vendor": caps.vendor,
            "arch": caps.arch,
            "precisions": [p for p in ("fp16", "bf16", "tf32", "fp8") if getattr(caps, p)],
        }
    return out


def _iterations(iters: steps.Iterations, step_list: list[Any]) -> dict[str, Any]:
    """How the analysed steps were found, and the warm-up set apart from them."""
    durs = sorted(s.end - s.start for s in step_list)
    median = durs[len(durs) // 2] if durs else 0
    warm_ns = sum(s.end - s.start for s in iters.warmup)
    return {
        "source": iters.source,
        "anchor": iters.anchor,
        "count": len(step_list),
        "warmup": {
            "count": len(iters.warmup),
            "us": round(warm_ns / 1e3, 3),
            "ratio_to_median": round(max(s.end - s.start for s in iters.warmup) / median, 2)
            if iters.warmup and median
            else None,
        },
    }


def _metrics(trace: RankTrace, ctx: Context, step_list: list[Any]) -> dict[str, Any]:
    acc = ctx.accounting
    durs = acc.step_ns / 1e3
    out: dict[str, Any] = {
        "step_time_us": {
            "mean": tl.mean_or_zero(durs),
            "p50": median_of(durs),
            "max": float(durs.max()),
            "min": float(durs.min()),
        },
        "kinds_us": {k: round(acc.mean_ns(k) / 1e3, 3) for k in (*KINDS, "other")},
        "shares": {k: round(acc.share(k), 4) for k in (*KINDS, "other")},
        "transfers": ctx.transfers,
        "sync": {
            "calls_per_step": ctx.sync.calls_per_step,
            "blocked_us_per_step": ctx.sync.blocked_ns_per_step / 1e3,
            "by_api": ctx.sync.by_api,
            "triggers": ctx.sync.triggers,
        },
        "memory": {
            "devices": [field_dict(d) | {"peak_fraction": d.peak_fraction} for d in ctx.memory.devices],
            "steady_alloc_calls_per_step": ctx.memory.steady_alloc_calls_per_step,
            "alloc_calls_per_step": ctx.memory.alloc_calls_per_step,
            "alloc_call_us_per_step": ctx.memory.alloc_call_ns_per_step / 1e3,
            "allocator": ctx.memory.allocator,  # disabled | thrashing | ok (``memory``)
            "allocator_evidence": ctx.memory.allocator_evidence,
            "out_of_memory": ctx.memory.out_of_memory,
            # For drawing: totals over time, µs from the first step's start (``origin_us``).
            "series": {
                "origin_us": round(step_list[0].start / 1e3, 3),
                "curves": memory_curves(trace, origin_ns=step_list[0].start),
                "categories": ctx.memory.use.series,  # bytes by category over time (``memory_use``)
            },
            **memory_section(ctx.memory.use, step_list[0].start, ctx.workload),
        },
        "communication": ctx.comm,
        "input": {k: v for k, v in field_dict(ctx.inputs).items() if k != "intervals"},
        "ops": ctx.ops,
    }
    out.update(_engine_metrics(trace, step_list, ctx.launch))
    return plain(out)


def _engine_metrics(trace: RankTrace, step_list: list[Any], launch: hta.LaunchStats | None) -> dict[str, Any]:
    """GPU utilization (TensorBoard's definitions) and HTA's temporal/idle/launch metrics."""
    if not trace.has_gpu:
        return {}
    g = gpu_metrics.compute_gpu_metrics(trace, step_list)
    return {
        "gpu": {
            "utilization": g.utilization,
            "sm_efficiency": g.sm_efficiency,
            "occupancy": g.occupancy,
            "devices": [{"device": d.device, **field_dict(d.overall)} for d in g.devices],
        },
        "hta": {
            "temporal": hta.temporal_breakdown(trace),
            "idle": hta.idle_time_breakdown(trace),
            "launch": launch,
        },
    }


def _warnings(ctx: Context, iters: steps.Iterations) -> list[str]:
    out = []
    if not iters.found:
        out.append(
            "no ProfilerStep markers and no repeating iteration found: the whole trace is analysed as one pass; "
            "waits that recur within it (many and alike) get per-pass advice, waits that may be one-time costs "
            "(few and long) get no gain (call prof.step() each iteration)"
        )
    elif not ctx.has_step_markers:
        out.append(
            f"no ProfilerStep markers: {len(iters.steps) + len(iters.warmup)} iterations found from "
            f"{iters.source} ({iters.anchor[:80]})"
        )
    if iters.warmup:
        ms = sum(s.end - s.start for s in iters.warmup) / 1e6
        out.append(
            f"{len(iters.warmup)} leading iteration(s) set apart as warm-up ({ms:.1f} ms: one-time costs such as "
            "autotuning, lazy initialisation or compilation); the diagnosis covers the steady state"
        )
    if ctx.n_steps < 2:
        out.append("fewer than 2 steps: numbers are not averaged; profile more active steps")
    if ctx.memory.out_of_memory:
        out.append(f"{ctx.memory.out_of_memory} out-of-memory events in the trace")
    return out


def run_metadata(trace: RankTrace, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run metadata the diagnosis reads (DataLoader settings, CPU count, host, workload tags):
    what our agent embedded in the trace (``RankTrace.run_metadata``), over what the caller passes
    (the server: the upload's metadata) for keys the trace leaves out or null. The trace's own record
    wins: it was written by the process that ran, with the trace. Every path (``stepdoctor analyze``,
    the server's worker) reads it here, so the same trace gets the same concrete change everywhere."""
    embedded = {k: v for k, v in trace.run_metadata.items() if v is not None}
    return {**(given or {}), **embedded}


def _host_memory(metadata: dict[str, Any] | None) -> int:
    """Host RAM in bytes: from the run metadata, else this machine's when the trace was recorded here.

    A server analysing another host's upload must not report its own RAM as that host's capacity.
    """
    md = metadata or {}
    for key in ("host_memory_bytes", "host_memory", "ram_bytes"):
        v = md.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if md.get("host") is not None and md["host"] != _hostname():
        return 0
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _hostname() -> str:
    import socket  # only metadata naming a host asks this machine's name

    return socket.gethostname()


def _job_report(path: Path, traces: list[RankTrace], reports: list[Report]) -> Report:
    """A directory: the run's verdict (``run_verdict.run_verdict``, the function the server's run
    diagnosis calls, so both agree) on the report of the trace that stands for the run.

    The verdict's figures replace the lead trace's: step time, breakdown, shares and time per kind,
    the limiter and its gain, the merged cards, ranks and windows. The lead's per-step rows, tables
    and drawn steps stay as the run's example.
    """
    from .run import ranks  # directories only: a single trace's analysis (and CLI start) skips them
    from .run import verdict as run_verdict

    entries = [
        ranks.TraceEntry(r.typed(), window=i, worker=ranks.worker_name(t.source))
        for i, (t, r) in enumerate(zip(traces, reports, strict=True))
    ]
    verdict = run_verdict.run_verdict(entries, series=_series_memory(path))
    return _with_verdict(path, reports[verdict.lead if verdict.lead is not None else 0], verdict)


def _series_memory(path: Path) -> Any:
    """The agent's step-series memory beside a run's traces (``run_timeline.RunTimeline.memory``), for
    the run's leak over every step; None without a series, or with one that does not read (the CLI
    names a bad chunk with the timeline it prints)."""
    from .run.timeline import read_run_timeline

    try:
        timeline = read_run_timeline(path) if path.is_dir() else None
    except TraceError:
        return None
    return timeline.memory if timeline is not None else None


def _with_verdict(path: Path, top: Report, verdict: RunVerdict) -> Report:
    """The lead trace's report with the run's verdict's figures (``_job_report``; ``rank_pool``)."""
    step = verdict.step_time_us
    if verdict.primary is not None:
        p = verdict.primary
        own = top.primary.kind == p.kind
        top.primary = msgspec.structs.replace(
            top.primary,
            kind=p.kind,
            share=round(p.share, 4),
            us_per_step=p.us_per_step,
            evidence=top.primary.evidence if own else {},
            gain=p.gain,
            basis=p.basis,
            note=p.note
            or ("" if own else "This is the job's limiter over all ranks; no single rank's own verdict is."),
        )
    top.secondary = [
        msgspec.structs.replace(
            b, share=round(verdict.shares.get(b.kind, 0.0), 4), us_per_step=verdict.kinds_us.get(b.kind, 0.0)
        )
        for b in top.secondary
        if verdict.primary is None or b.kind != verdict.primary.kind
    ]
    top.step_time_us = round(step, 3)
    top.breakdown = dict(verdict.breakdown)
    top.metrics = {
        **top.metrics,
        "step_time_us": {**top.metrics["step_time_us"], "mean": step},
        "shares": {k: round(verdict.shares.get(k, 0.0), 4) for k in top.metrics["shares"]},
        "kinds_us": {k: round(verdict.kinds_us.get(k, 0.0), 3) for k in top.metrics["kinds_us"]},
    }
    top.recommendations = [_card(c) for c in verdict.recommendations]
    top.findings = [_card(f) for f in verdict.findings]
    top.ranks = plain(
        verdict.rank_section().to_dict()
        | {
            "steps": verdict.steps,
            "limiter": verdict.primary.kind if verdict.primary else None,
            "limiter_reason": verdict.primary.reason if verdict.primary else "",
        }
    )
    top.source = str(path)
    top.warnings = [*top.warnings, *verdict.warnings]
    return top


def _card(card: Any) -> diagnose.Recommendation:
    """A run card or finding as the report's recommendation (the run-only counts left out)."""
    fields = {f: getattr(card, f) for f in diagnose.Recommendation.__struct_fields__}
    return diagnose.Recommendation(**fields)
