"""Classify where each step's wall time goes, pick the primary bottleneck, rank the fixes.

Time accounting partitions every step window into the bottleneck kinds, so shares sum to 1 and
"share of step time" means the same thing for every kind:

GPU traces (the device timeline decides; a busy GPU is not waiting on anything):
  compute        time a computation kernel runs;
  communication  collective kernels running while no compute kernel runs (exposed);
  transfer       memcpy/memset running while no kernel runs (exposed copies);
  then each idle stretch of the GPU is charged to what the host was doing:
  input          the host was inside ``DataLoader.__next__``;
  memory         the host was inside ``cudaMalloc``/``cudaFree`` after the first step;
  sync           the idle stretch began when a blocking call returned (the drained queue's refill
                 bubble) or the host was blocked while the GPU idled;
  launch         the GPU waited for the host to issue the next op (HTA's "host wait");
  other          idle with the next op already issued (cross-stream waits, the profiler).
CPU-only traces (the training thread decides):
  input          inside ``DataLoader.__next__``;  communication  CPU collectives (gloo);
  compute        inside heavy arithmetic ops (matmul, conv, attention, norms: ``ops.COMPUTE_OP_RE``)
                 whose name's median duration is at least ``SMALL_OP_NS``, then inside any other op whose
                 name's median is at least ``BIG_OP_NS``
                 (elementwise math and reductions on large tensors);
  memory         inside ops (name median >= ``SMALL_OP_NS``) that only allocate, fill or copy memory
                 (``ops.MEMORY_OP_RE``: empty, zeros, clone, copy_, cat, ...). This is our CPU
                 definition of memory-bound: time spent producing/moving per-step temporaries rather
                 than computing; the ``[memory]`` events' bytes allocated per step are its evidence;
  launch         framework overhead: the remaining (small) ops plus the short (< 50 µs) gaps between
                 ops (Python glue, dispatch) — dominant when a step runs many tiny ops;
  other          longer stretches outside any op (user Python code, I/O, sleeps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import intervals as iv
from . import timeline as tl
from .breakdown import collective_op_mask, computation_kernel_union
from .inputs import InputStats
from .memory import MemoryStats
from .model import INT64_MIN, HostKind, RankTrace, Step
from .ops import COMPUTE_OP_RE, MEMORY_OP_RE, median_dur_by_name
from .rules import KINDS, RULES, Context, Hit, Rule, speedup
from .steps import device_op_mask, launching_call
from .sync import SyncStats
from .timeline import Accounting

SYNC_TOLERANCE_NS = 10_000  # a sync returning up to 10 µs before the GPU went idle still drained it
GLUE_NS = 50_000  # gaps between host ops shorter than this are dispatch/Python glue
SMALL_OP_NS = 20_000  # CPU ops shorter than this are overhead, whatever they compute or copy
BIG_OP_NS = 50_000  # other CPU ops at least this long do real arithmetic (elementwise, reductions)


def account(
    trace: RankTrace,
    steps: list[Step],
    inputs: InputStats,
    sync: SyncStats,
    memory: MemoryStats,
    comm_host: bool,
) -> Accounting:
    starts, ends = tl.step_windows(steps)
    step_ns = (ends - starts).astype(np.int64)
    gpu_active = device_op_mask(trace) & tl.gpu_in_steps(trace, steps) if trace.has_gpu else None
    if gpu_active is not None and gpu_active.any():
        kinds = _account_gpu(trace, starts, ends, inputs, sync, memory)
    else:
        kinds = _account_cpu(trace, starts, ends, inputs, comm_host)
    for k in (*KINDS, "other"):
        if k not in kinds:
            kinds[k] = np.zeros(len(steps), dtype=np.int64)
    return Accounting(step_ns=step_ns, kinds=kinds)


def _account_gpu(
    trace: RankTrace,
    starts: np.ndarray,
    ends: np.ndarray,
    inputs: InputStats,
    sync: SyncStats,
    memory: MemoryStats,
) -> dict[str, np.ndarray]:
    busy = {
        "compute": computation_kernel_union(trace),
        "communication": tl.comm_union(trace),
        "transfer": tl.gpu_union(trace, tl.copy_mask(trace)),
        "input": inputs.intervals,
        "memory": memory.alloc_call_intervals,
    }
    claimed = iv.claim_in_order(starts, ends, list(busy.values()))
    out = dict(zip(busy, claimed.per_layer, strict=True))
    # The rest of the idle time is charged by what happened around it: it depends on what is left.
    idle = claimed.free
    stalled = iv.intersect(idle, _sync_bubbles(idle, sync))
    out["sync"] = tl.per_step(stalled, starts, ends)
    host_wait, other = _split_idle(trace, iv.subtract(idle, stalled))
    out["launch"] = tl.per_step(host_wait, starts, ends)
    out["other"] = tl.per_step(other, starts, ends)
    return out


def _sync_bubbles(idle: iv.Intervals, sync: SyncStats) -> iv.Intervals:
    """Idle stretches that begin as a blocking call returns, plus idle time while the host is blocked."""
    if sync.call_ends.size == 0 or idle[0].size == 0:
        return iv.EMPTY
    gs, ge = idle
    # The first blocking-call end at or after (gap start - tolerance) must fall before the gap's end.
    j = sync.call_ends.searchsorted(gs - SYNC_TOLERANCE_NS, side="left")
    ok = j < sync.call_ends.size
    hit = np.zeros(gs.size, dtype=np.bool_)
    hit[ok] = sync.call_ends[j[ok]] < ge[ok]
    blocked = iv.union(sync.call_starts, sync.call_ends)
    gaps: iv.Intervals = (gs[hit], ge[hit])
    return iv.union(np.concatenate([gaps[0], blocked[0]]), np.concatenate([gaps[1], blocked[1]]))


def _split_idle(trace: RankTrace, idle: iv.Intervals) -> tuple[iv.Intervals, iv.Intervals]:
    """Host wait (next GPU op issued after the gap began, or none issued yet) vs. the rest."""
    gs, ge = idle
    if gs.size == 0 or not len(trace.host):
        return idle, iv.EMPTY
    g = trace.gpu
    act = device_op_mask(trace).nonzero()[0]
    order = act[g.ts[act].argsort(kind="stable")]
    launcher = launching_call(trace)
    k = g.ts[order].searchsorted(ge, side="left")  # the first GPU op starting at/after the gap's end
    host_wait = np.ones(gs.size, dtype=np.bool_)
    has_next = k < order.size
    nxt = order[k[has_next]]
    li = launcher[nxt]
    issued = np.where(li >= 0, trace.host.ts[np.maximum(li, 0)], INT64_MIN)
    host_wait[has_next] = issued >= gs[has_next]
    return (gs[host_wait], ge[host_wait]), (gs[~host_wait], ge[~host_wait])


def _account_cpu(
    trace: RankTrace, starts: np.ndarray, ends: np.ndarray, inputs: InputStats, comm_host: bool
) -> dict[str, np.ndarray]:
    h = trace.host
    ops = trace.host_kind(HostKind.CPU_OP)
    typical = median_dur_by_name(trace, ops)[h.name]
    sized = ops & (typical >= SMALL_OP_NS)  # shorter ops are dispatch overhead whatever their name
    all_ops = tl.host_union(trace, ops)
    # Short gaps between ops are dispatch and Python glue: overhead of issuing many small ops.
    gap_s, gap_e = all_ops[1][:-1], all_ops[0][1:]
    short = (gap_e - gap_s) < GLUE_NS
    layers: list[tuple[str, iv.Intervals]] = [("input", inputs.intervals)]
    if comm_host:
        layers.append(("communication", tl.host_union(trace, collective_op_mask(trace))))
    layers += [
        (
            "compute",
            tl.host_union(
                trace, sized & tl.host_name_mask(trace, COMPUTE_OP_RE, "cpu_compute", HostKind.CPU_OP)
            ),
        ),
        (
            "memory",
            tl.host_union(
                trace, sized & tl.host_name_mask(trace, MEMORY_OP_RE, "cpu_memory", HostKind.CPU_OP)
            ),
        ),
        ("compute", tl.host_union(trace, ops & (typical >= BIG_OP_NS))),
        (
            "launch",
            iv.union(np.concatenate([all_ops[0], gap_s[short]]), np.concatenate([all_ops[1], gap_e[short]])),
        ),
    ]
    claimed = iv.claim_in_order(starts, ends, [ivs for _, ivs in layers])
    out: dict[str, np.ndarray] = {}
    for (kind, _), per in zip(layers, claimed.per_layer, strict=True):
        out[kind] = out[kind] + per if kind in out else per
    out["other"] = claimed.unclaimed
    return out


# --- classification and ranking ------------------------------------------------------------------


@dataclass(frozen=True)
class Bottleneck:
    kind: str
    share: float
    us_per_step: float
    confidence: float
    evidence: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Recommendation:
    id: str
    title: str
    kind: str
    change: str
    why: str
    expected_speedup: float
    removable_us_per_step: float
    confidence: float
    caveats: list[str]
    evidence: dict[str, object]


@dataclass(frozen=True)
class Diagnosis:
    primary: Bottleneck
    secondary: list[Bottleneck]
    recommendations: list[Recommendation]
    findings: list[Recommendation]  # every rule that fired, including those without a code change


def classify(ctx: Context) -> Diagnosis:
    shares = {k: ctx.accounting.share(k) for k in KINDS}
    ranked = sorted(KINDS, key=lambda k: -shares[k])
    hits = [(rule, hit) for rule in RULES if (hit := rule.evaluate(ctx)) is not None]
    recs = sorted(
        (_render(rule, hit, ctx) for rule, hit in hits), key=lambda r: (-r.expected_speedup, -r.confidence)
    )
    evidence = {rule.kind: hit.evidence for rule, hit in sorted(hits, key=lambda p: p[1].removable_ns)}
    # Each kind's margin is over the largest of the others: the runner-up's share for the leader.
    top, runner_up = shares[ranked[0]], shares[ranked[1]] if len(ranked) > 1 else 0.0
    bottlenecks = [
        Bottleneck(
            kind=k,
            share=round(shares[k], 4),
            us_per_step=round(ctx.accounting.mean_ns(k) / 1e3, 3),
            confidence=_confidence(shares[k], runner_up if i == 0 else top, ctx),
            evidence=evidence.get(k, {}),
        )
        for i, k in enumerate(ranked)
    ]
    primary = bottlenecks[0]
    secondary = [b for b in bottlenecks[1:] if b.share >= 0.05]
    with_change = [r for r in recs if r.change]
    return Diagnosis(primary=primary, secondary=secondary, recommendations=with_change, findings=recs)


def _confidence(share: float, best_other: float, ctx: Context) -> float:
    """Higher when the kind dominates clearly and the trace has several steps to average over."""
    margin = share - best_other
    conf = 0.35 + 0.5 * share + 0.4 * max(-0.5, min(0.5, margin))
    if ctx.n_steps < 2:
        conf -= 0.15
    if not ctx.has_step_markers:
        conf -= 0.1
    conf -= 0.5 * ctx.accounting.share("other")  # time we could not explain weakens every verdict
    return round(float(min(0.95, max(0.05, conf))), 2)


def _render(rule: Rule, hit: Hit, ctx: Context) -> Recommendation:
    params = {"kind_pct": 100 * ctx.share(rule.kind)} | hit.params
    return Recommendation(
        id=rule.id,
        title=rule.title,
        kind=rule.kind,
        change=rule.change.format(**params) if rule.change else "",
        why=rule.why.format(**params),
        expected_speedup=round(speedup(ctx.step_ns, hit.removable_ns), 3),
        removable_us_per_step=round(hit.removable_ns / 1e3, 3),
        confidence=hit.confidence if hit.confidence is not None else 0.5,
        caveats=[caveat.format(**params) for caveat in rule.caveats],
        evidence=hit.evidence,
    )
