"""The diagnosis report: one dataclass, its versioned JSON form, and a terminal rendering.

The JSON form is typed in ``contract.ReportDoc`` (``Report.typed``; JSON Schema in
docs/report.schema.json, ``stepdoctor analyze --schema``). In words:

JSON schema (``SCHEMA_VERSION`` 1; what ``stepdoctor analyze --format json`` prints and the server
stores). Times are microseconds; shares are fractions of the summed step wall time.

    schema_version   int
    engine_version   str
    source           str            file (or directory) analysed
    rank             int | null     world_size: int | null
    format           str            trace generation the parser recognised
    device           {type: "gpu", name (null when the trace does not say), memory_gb, compute_capability,
                      vendor, arch, precisions[]} | null   (null on CPU-only traces)
    step_time_us     float          mean step wall time
    primary          {kind, share, us_per_step, confidence, evidence{}, gain, basis, note}: the limiter,
                     the kind whose removal gains most (``diagnose.choose_limiter``), not the
                     largest share; ``gain`` the speedup if its removable time went, ``basis``
                     "measured" (a wait) or "estimate" (compute), ``note`` one sentence when the
                     first recommendation is not about this kind
                     kind ∈ input|transfer|launch|memory|sync|communication|compute
    secondary        [same shape as primary], kinds with share >= 5%, largest first
    breakdown        {kernel, memcpy, memset, communication, runtime, dataloader, cpu_exec, other}:
                     float µs per step, averaged (TensorBoard's categories, summing to the step)
    recommendations  [{id, title, kind, change, why, expected_speedup, removable_us_per_step,
                       confidence, caveats[], evidence{}}], best first; [0] is the next optimization
                     + basis ("measured" | "estimate" | "single-pass") and expected_speedup_range
                     ([low, high] for estimates, else null); cards only above 1.02×, the first
                     one addresses the primary kind when any does
    findings         [same shape as recommendations; also rules without a code change, tiny gains]
    iterations       {source: markers|dataloader|optimizer|module|kernel-sequence|none, anchor,
                      count, warmup{count, us, ratio_to_median}}: how steps were found; warm-up
                      iterations are reported here and left out of every per-step figure
    limiter          {kind: {share, removable_share, basis, score}}: what the verdict ranked
    steps            [{number, start_us, duration_us, kinds{kind: µs}}]
    metrics          {kinds_us, shares, transfers, sync, memory, communication, input, ops,
                      gpu (utilization, ...), hta (temporal/idle/launch), ...}
    ranks            present for a directory (``ranks.RankVerdict.to_dict``): {count (distinct ranks),
                      windows (traces), basis, median_busy_us, spread, stragglers[rank],
                      straggler_details[{rank, busy_us, over_median, arrival_late_us, cause, why, ...}],
                      per_rank[{rank, worker, traces, steps, step_time_us, wait_us, busy_us,
                      arrival_us, kinds_us, primary_kind, primary_share}], primary_kind}; the
                      top-level diagnosis is then a straggler's, else a rank's whose verdict is the job's
    warnings         [str]
    workload         {kind: training|inference|unknown, phase: decode|prefill|prefill+decode|null,
                      source, evidence[], grad_disabled, with_stack, cuda_graphs, kernels_per_step,
                      median_kernel_us, grad_enabled, grad_evidence}: inference traces get inference
                      advice only; unknown ones neither training-only nor inference-only advice
    tables           {ops[], kernels[]: {name, calls, total_us, mean_us, share}, tensor_core_share}
                     (``tables.build_tables``)
    timeline         {steps[{number, why, duration_us, lanes[{label, kind, boxes[[start_us, end_us,
                     label, count]]}]}], names[]}: representative steps drawn (``step_timeline``)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from .. import BREAKDOWN_CATEGORIES, ENGINE_VERSION, SCHEMA_VERSION
from . import guide
from .consistency import MIN_ADVICE_SPEEDUP, shown_gain
from .contract import Bottleneck, Recommendation, ReportDoc, StepRow
from .contract import decode as decode_report

BREAKDOWN_KEYS = BREAKDOWN_CATEGORIES
NAMED_RANKS = 3  # a sentence names at most this many ranks, then "and N more"


def named_ranks(labels: Sequence[str], limit: int = NAMED_RANKS) -> str:
    """``labels`` as a sentence's list, at most ``limit`` of them then "and N more": at 1,000 ranks
    a verdict still reads as a sentence ("rank 613, rank 7, rank 9 and 41 more")."""
    shown, rest = list(labels[:limit]), len(labels) - limit
    if rest > 0:
        return f"{', '.join(shown)} and {rest} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}" if shown else ""


# torch-tb-profiler 0.4.3 reads only ProfilerStep and gloo/nccl ranges among ``user_annotation``
# events (``trace.create_trace_event``), and torch 2.x records ``enumerate(DataLoader)#…__next__`` as
# one: its overview then shows DataLoader 0 and counts that time as Other (the CPU ops inside it as
# CPU Exec). Recategorised as ``cpu_op``, as older torch wrote them, it shows our number. The plugin's
# miss, not the export's: the exported files are the uploaded bytes.
TENSORBOARD_DATALOADER_NOTE = (
    "TensorBoard's profiler plugin (torch-tb-profiler 0.4.3) shows DataLoader 0 for traces that record "
    "DataLoader.__next__ as a user_annotation (torch 2.x): it drops those events and counts the time as Other."
)

KIND_WORDS = {
    "input": "the training loop waits for the next batch from the DataLoader",
    "transfer": "the step waits for host↔device copies that nothing overlaps",
    "launch": "the device waits for the host to issue work (launch / dispatch overhead of many small ops)",
    "memory": "the step spends its time allocating, filling or copying memory",
    "sync": "the host synchronizes with the GPU inside the step, so the GPU idles while work is relaunched",
    "communication": "collective communication runs with no compute to hide it",
    "compute": "the device is busy with arithmetic: the step is compute-bound, so make the math cheaper",
}


@dataclass
class Report:
    source: str
    primary: Bottleneck
    secondary: list[Bottleneck]
    recommendations: list[Recommendation]
    findings: list[Recommendation]
    breakdown: dict[str, float]
    steps: list[StepRow]
    metrics: dict[str, Any]
    step_time_us: float
    rank: int | None = None
    world_size: int | None = None
    format: str = "kineto"
    device: dict[str, Any] | None = None
    ranks: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    workload: dict[str, Any] | None = None  # ``workload.Workload``: training/inference, decode/prefill
    # Operator/kernel tables and a drawn step (``tables``, ``step_timeline``): for the dashboard.
    tables: dict[str, Any] | None = None
    timeline: dict[str, Any] | None = None
    # How steps were found and the warm-up set apart (``pipeline._iterations``), and what the
    # verdict ranked (``diagnose.Diagnosis.limiter``).
    iterations: dict[str, Any] | None = None
    limiter: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "engine_version": ENGINE_VERSION,
            "source": self.source,
            "rank": self.rank,
            "world_size": self.world_size,
            "format": self.format,
            "device": self.device,
            "step_time_us": self.step_time_us,
            "primary": self.primary,
            "secondary": self.secondary,
            "breakdown": {k: float(self.breakdown.get(k, 0.0)) for k in BREAKDOWN_KEYS},
            "recommendations": self.recommendations,
            "findings": self.findings,
            "steps": self.steps,
            "metrics": self.metrics,
            "warnings": self.warnings,
            "workload": self.workload,
        }
        if self.iterations is not None:
            d["iterations"] = self.iterations
        if self.limiter is not None:
            d["limiter"] = self.limiter
        if self.ranks is not None:
            d["ranks"] = self.ranks
        if self.tables is not None:
            d["tables"] = self.tables
        if self.timeline is not None:
            d["timeline"] = self.timeline
        out: dict[str, Any] = plain(d)
        return out

    def typed(self) -> ReportDoc:
        """The report as the typed contract (``contract.ReportDoc``); raises if the two drifted apart."""
        return decode_report(self.to_dict())

    def render_text(self) -> str:
        return render_text(self)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # dataclass -> its field names (``fields()`` is slow)


def field_dict(obj: Any) -> dict[str, Any]:
    """A dataclass instance's fields by name, values as they are (``plain`` converts them)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: getattr(obj, name) for name in names}


def _numpy_builtin(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"a report holds a {type(obj).__name__}, which has no JSON form")


_TO_JSON = msgspec.json.Encoder(enc_hook=_numpy_builtin)
_FROM_JSON = msgspec.json.Decoder()


def plain(obj: Any) -> Any:
    """JSON-ready copy: exactly what a JSON round trip carries.

    Dataclasses become dicts (their ``__init__`` fields), tuples lists, numpy scalars and arrays
    Python values, keys strings, NaN and infinities ``None``; floats come back bit for bit. msgspec
    does both halves in C, several times faster than walking the objects in Python, and the result
    shares nothing with ``obj``.
    """
    return _FROM_JSON.decode(_TO_JSON.encode(obj))


def _fmt_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def _gain_text(rec: Recommendation) -> str:
    """The expected gain with its basis: an upper bound for a measured wait, a range for an estimate."""
    if rec.basis == "single-pass":
        return "single pass: no per-step gain claimed"
    if rec.expected_speedup_range:
        lo, hi = rec.expected_speedup_range
        return f"estimate: {lo:.2f}–{hi:.2f}× faster steps"
    return f"measured wait: up to {rec.expected_speedup:.2f}× faster steps"


def render_text(r: Report) -> str:
    """Plain-words terminal report: the primary bottleneck, the next change, the breakdown, findings."""
    lines: list[str] = []
    n_steps = int(r.ranks["steps"]) if r.ranks and "steps" in r.ranks else len(r.steps)
    where = [f"{n_steps} step{'s' if n_steps != 1 else ''}", f"mean step {_fmt_us(r.step_time_us)}"]
    if r.ranks:  # a directory: the run's figures over every rank and window
        count, windows = r.ranks["count"], r.ranks["windows"]
        where.insert(
            0, f"{count} rank{'s' if count != 1 else ''}, {windows} trace{'s' if windows != 1 else ''}"
        )
    if r.device:
        where.insert(0, str(r.device.get("name") or "GPU (name unknown)"))
    else:
        where.insert(0, "CPU only")
    if r.rank is not None and not r.ranks:
        where.insert(0, f"rank {r.rank}" + (f" of {r.world_size}" if r.world_size else ""))
    if r.workload and r.workload.get("kind") == "inference":
        where.append("inference" + (f" ({r.workload['phase']})" if r.workload.get("phase") else ""))
    elif r.workload and r.workload.get("kind") == "unknown":
        where.append("training or inference: the trace does not tell")
    lines += [f"stepdoctor {ENGINE_VERSION} — {r.source}", "  " + ", ".join(where), ""]
    p = r.primary
    lines += [
        f"Primary bottleneck: {p.kind.upper()} — {100 * p.share:.0f}% of step wall time "
        f"({_fmt_us(p.us_per_step)} per step, confidence {p.confidence:.2f})",
        f"  {KIND_WORDS[p.kind]}. What to do: {guide.link(p.kind)}",
    ]
    if p.gain > 1.02:
        what = "a measured wait" if p.basis == "measured" else "an estimate"
        lines.append(f"  It limits the step: removing it gains up to {p.gain:.2f}× ({what}).")
    if p.note:
        lines.append(f"  Note: {p.note}")
    if r.secondary:
        lines.append("  Also: " + ", ".join(f"{b.kind} {100 * b.share:.0f}%" for b in r.secondary))
    lines.append("")
    if r.recommendations:
        rec = r.recommendations[0]
        lines += [
            f"Next optimization: {rec.title} ({_gain_text(rec)})",
            f"  Change: {rec.change}",
            # A run's card carries the words of a trace that raised it (that trace's share), not the run's.
            f"  Why:    {rec.why}" if not r.ranks else f"  Seen in a trace: {rec.why}",
            f"  Guide:  {guide.link(rec.kind, rec.id)}",
        ]
        lines += [f"  Caveat: {c}" for c in rec.caveats]
    else:
        lines.append(
            "Next optimization: none proposed (see the note above)."
            if p.note
            else "Next optimization: none of the rules fired; the step looks balanced."
        )
    lines += ["", "Step time breakdown (µs per step, averaged; TensorBoard categories):"]
    total = sum(r.breakdown.get(k, 0.0) for k in BREAKDOWN_KEYS) or 1.0
    for k in BREAKDOWN_KEYS:
        v = r.breakdown.get(k, 0.0)
        lines.append(f"  {k:<14}{v:>14.1f}  {100 * v / total:5.1f}%")
    if r.breakdown.get("dataloader", 0.0) > 0:
        lines.append(f"  ({TENSORBOARD_DATALOADER_NOTE})")
    by_type = (r.metrics.get("communication") or {}).get("by_type") or []
    if by_type:
        lines += ["", "Communication by collective type (per step):"]
        for c in by_type:
            lines.append(
                f"  {c['type']:<15}{_fmt_us(c['exposed_ns_per_step'] / 1e3):>10} exposed"
                f"{_fmt_us(c['overlapped_ns_per_step'] / 1e3):>10} overlapped  "
                f"{c['calls_per_step']:g} calls  ({', '.join(c['libraries'])})"
            )
    others = (
        r.findings[1:6]
        if r.recommendations and r.findings and r.findings[0].id == r.recommendations[0].id
        else r.findings[:5]
    )
    if others:
        lines += ["", "Other findings:"]
        for f in others:
            # A fact, or a change that averts a failure, promises no speedup: no gain is shown.
            gain = f" ({_gain_text(f)})" if f.change and shown_gain(f) > MIN_ADVICE_SPEEDUP else ""
            lines.append(f"  - [{f.kind}] {f.title}: {f.why}{gain}")
            if f.change and not gain:  # a change that averts a failure (OOM, a leak): the fix is the point
                lines.append(f"      Change: {f.change}")
    if r.ranks:
        rk = r.ranks
        lines += [
            "",
            f"Ranks: {rk['count']} ({rk['windows']} traces), spread of {rk['basis']} "
            f"{100 * rk['spread']:.0f}% of the median ({_fmt_us(rk['median_busy_us'])}); "
            f"stragglers: {named_ranks([str(x) for x in rk['stragglers']]) or 'none'}",
        ]
    lines += [f"Warning: {w}" for w in r.warnings]
    return "\n".join(lines) + "\n"
