"""Classify where each step's wall time goes, pick the primary bottleneck, rank the fixes.

Time accounting partitions every step window into the bottleneck kinds, so shares sum to 1 and
"share of step time" means the same thing for every kind:

GPU traces (the device timeline decides; a busy GPU is not waiting on anything):
  compute        time a computation kernel runs;
  communication  collective kernels running while no compute kernel runs (exposed);
  transfer       memcpy/memset running while no kernel runs (exposed copies);
  then each idle stretch of the GPU is charged to what the host was doing:
  input          the host was inside ``DataLoader.__next__``;
  memory         the host was inside an allocator call (``cudaMalloc``/``hipFree``, ...), in any step;
  sync           the idle stretch began when a user sync returned (a device-to-host read or an
                 explicit synchronize: the drained queue's refill bubble) or the host was blocked
                 in one while the GPU idled;
  transfer       (also) the same around a blocking host-to-device copy (``x.to(device)`` from
                 pageable memory): the copy is needed, pinned memory + ``non_blocking`` fix it;
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

import dataclasses
import re
from dataclasses import dataclass, field

import numpy as np

from ..analyzers import timeline as tl
from ..analyzers.breakdown import collective_op_mask, computation_kernel_union
from ..analyzers.inputs import InputStats
from ..analyzers.memory import MemoryStats
from ..analyzers.ops import COMPUTE_OP_RE, MEMORY_OP_RE, median_dur_by_name
from ..analyzers.recurrence import TOP_FEW, PassWaits
from ..analyzers.sync import SyncStats
from ..analyzers.timeline import Accounting
from ..model import intervals as iv
from ..model.steps import device_op_mask, launching_call
from ..model.trace import INT64_MIN, HostKind, RankTrace, Step
from ..report.consistency import consistent
from ..report.contract import Bottleneck, Recommendation
from . import KINDS, NO_COMPUTE_RATIO, declared, fired
from .record import Context, Hit, Rule, speedup

SYNC_TOLERANCE_NS = 10_000  # a sync returning up to 10 µs before the GPU went idle still drained it
GLUE_NS = 50_000  # gaps between host ops shorter than this are dispatch/Python glue
SMALL_OP_NS = 20_000  # CPU ops shorter than this are overhead, whatever they compute or copy
BIG_OP_NS = 50_000  # other CPU ops at least this long do real arithmetic (elementwise, reductions)


@dataclass(frozen=True)
class Evidence:
    """What ``account`` charges step time by (the drawn steps of ``step_timeline`` read the
    resulting partition back from the ``Accounting``)."""

    inputs: InputStats
    sync: SyncStats
    memory: MemoryStats
    comm_host: bool  # host (gloo) collectives recorded: a CPU step charges them to communication


def account(trace: RankTrace, steps: list[Step], ev: Evidence) -> Accounting:
    starts, ends = tl.step_windows(steps)
    step_ns = (ends - starts).astype(np.int64)
    idle: dict[str, iv.Intervals] = {}
    on_gpu = uses_gpu_timeline(trace, steps)
    if on_gpu:
        kinds, claimed, layer_kinds, idle = _account_gpu(trace, starts, ends, ev.inputs, ev.sync, ev.memory)
    else:
        kinds, claimed, layer_kinds = _account_cpu(trace, starts, ends, ev.inputs, ev.comm_host)
    for k in (*KINDS, "other"):
        if k not in kinds:
            kinds[k] = np.zeros(len(steps), dtype=np.int64)
    return Accounting(step_ns, kinds, claimed, layer_kinds, on_gpu, idle)


def _account_gpu(
    trace: RankTrace,
    starts: np.ndarray,
    ends: np.ndarray,
    inputs: InputStats,
    sync: SyncStats,
    memory: MemoryStats,
) -> tuple[dict[str, np.ndarray], iv.Claimed, tuple[str, ...], dict[str, iv.Intervals]]:
    """Per-step ns of each kind, the claim, its layers' kinds, and the idle stretches by the kind
    they were charged to."""
    busy = gpu_busy_layers(trace, inputs, memory)
    claimed = iv.claim_in_order(starts, ends, list(busy.values()))
    out = dict(zip(busy, claimed.per_layer, strict=True))
    idle = charge_idle(trace, claimed.free, sync)
    for kind, stretches in idle.items():
        out[kind] = out.get(kind, 0) + tl.per_step(stretches, starts, ends)
    return out, claimed, tuple(busy), idle


def uses_gpu_timeline(trace: RankTrace, steps: list[Step]) -> bool:
    """Whether ``account`` partitions the steps by the device timeline (else by the host thread)."""
    return bool(trace.has_gpu and (device_op_mask(trace) & tl.gpu_in_steps(trace, steps)).any())


def gpu_busy_layers(trace: RankTrace, inputs: InputStats, memory: MemoryStats) -> dict[str, iv.Intervals]:
    """The layers that claim a GPU step's time, in claim order (the step timeline draws the same)."""
    return {
        "compute": computation_kernel_union(trace),
        "communication": tl.comm_union(trace),
        "transfer": tl.gpu_union(trace, tl.copy_mask(trace)),
        "input": inputs.intervals,
        "memory": memory.alloc_call_intervals,
    }


def charge_idle(trace: RankTrace, idle: iv.Intervals, sync: SyncStats) -> dict[str, iv.Intervals]:
    """Charge the GPU's unclaimed idle stretches to sync, launch (host wait) or other.

    What an idle stretch is charged to depends on what happened around it, so this runs on what
    the busy layers left.
    """
    dead = _trailing_silence(trace, idle)
    idle = iv.subtract(idle, dead)
    to_sync, to_transfer = _sync_bubbles(idle, sync)
    stalled = iv.intersect(idle, to_sync)
    idle = iv.subtract(idle, stalled)
    copying = iv.intersect(idle, to_transfer)  # blocking HtoD copies: the transfer's
    host_wait, other = _split_idle(trace, iv.subtract(idle, copying))
    other = iv.union(np.concatenate([other[0], dead[0]]), np.concatenate([other[1], dead[1]]))
    return {"sync": stalled, "transfer": copying, "launch": host_wait, "other": other}


def _trailing_silence(trace: RankTrace, idle: iv.Intervals) -> iv.Intervals:
    """Idle time after the last GPU op while the host records nothing either: unexplained.

    Neither a sync bubble (nothing is relaunched) nor a launch wait (nothing is launched): e.g. a
    step range left open around untraced work after the last kernel (compilation, export).
    """
    gs, ge = idle
    g = trace.gpu
    dev = device_op_mask(trace)
    if gs.size == 0 or not dev.any():
        return iv.EMPTY
    last = int(g.end[dev].max())
    tail = gs >= last
    if not tail.any():
        return iv.EMPTY
    busy = _host_active_after(trace, last)
    silent = iv.subtract((gs[tail], ge[tail]), busy)
    return silent


def _host_active_after(trace: RankTrace, t: int) -> iv.Intervals:
    """When the host records anything after ``t`` (only the trace's tail is asked about)."""
    h = trace.host
    active = trace.host_kind(HostKind.CPU_OP, HostKind.RUNTIME, HostKind.DRIVER, HostKind.PYTHON_FUNCTION)
    late = active & (h.end > t)
    return iv.union(h.ts[late], h.end[late])


def _sync_bubbles(idle: iv.Intervals, sync: SyncStats) -> tuple[iv.Intervals, iv.Intervals]:
    """The idle time blocking calls cause, for sync (user syncs) and for transfer (blocking
    host-to-device copies): the time the host is blocked in them, and the refill bubbles of the
    queues they drain, i.e. the idle stretches in which a draining call returns. A pageable copy's
    staging call drains nothing: a stretch it returns in is a bubble only as the continuation of
    the one before it, when a draining call returned into that one (the stretch before the staging
    copy), and then of that call's class; otherwise the host was busy elsewhere (launch)."""
    user, htod = sync, sync.htod
    ends = np.concatenate([user.call_ends, htod.call_ends])
    if ends.size == 0 or idle[0].size == 0:
        return iv.EMPTY, iv.EMPTY
    is_htod = np.concatenate(
        [np.zeros(user.call_ends.size, np.bool_), np.ones(htod.call_ends.size, np.bool_)]
    )
    drains = np.concatenate([user.drains, htod.drains])
    gs, ge = idle
    d_ends, d_htod = ends[drains], is_htod[drains]
    order = d_ends.argsort(kind="stable")
    d_ends, d_htod = d_ends[order], d_htod[order]
    # A draining call returns in the stretch (or up to the tolerance before it began).
    j = d_ends.searchsorted(gs - SYNC_TOLERANCE_NS, side="left")
    jj = np.minimum(j, max(d_ends.size - 1, 0))
    drained = (j < d_ends.size) & (d_ends[jj] < ge) if d_ends.size else np.zeros(gs.size, np.bool_)
    # A staging call returns in it, and the previous stretch was a drained bubble.
    s_ends = np.sort(ends[~drains])
    k = s_ends.searchsorted(gs - SYNC_TOLERANCE_NS, side="left")
    staged = (
        (k < s_ends.size) & (s_ends[np.minimum(k, max(s_ends.size - 1, 0))] < ge) if s_ends.size else k < 0
    )
    cont = np.zeros(gs.size, np.bool_)
    cont[1:] = staged[1:] & ~drained[1:] & drained[:-1]
    by = np.where(cont, np.concatenate([jj[:1], jj[:-1]]), jj)  # whose bubble: that drain's class
    copy_bubble = (drained | cont) & d_htod[by] if d_ends.size else cont & False
    sync_bubble = (drained | cont) & ~d_htod[by] if d_ends.size else cont & False
    out = []
    for calls, bubble in ((user, sync_bubble), (htod, copy_bubble)):
        blocked = iv.union(calls.call_starts, calls.call_ends)
        out.append(
            iv.union(np.concatenate([gs[bubble], blocked[0]]), np.concatenate([ge[bubble], blocked[1]]))
        )
    return out[0], out[1]


def _split_idle(trace: RankTrace, idle: iv.Intervals) -> tuple[iv.Intervals, iv.Intervals]:
    """Host wait (next GPU op issued after the gap began, or none issued yet) vs. the rest."""
    gs, ge = idle
    if gs.size == 0 or not len(trace.host):
        return idle, iv.EMPTY
    order, order_ts = trace.memo("diagnose.device_ops_by_start", lambda: _device_ops_by_start(trace))
    launcher = launching_call(trace)
    k = order_ts.searchsorted(ge, side="left")  # the first GPU op starting at/after the gap's end
    host_wait = np.ones(gs.size, dtype=np.bool_)
    has_next = k < order.size
    nxt = order[k[has_next]]
    li = launcher[nxt]
    issued = np.where(li >= 0, trace.host.ts[np.maximum(li, 0)], INT64_MIN)
    host_wait[has_next] = issued >= gs[has_next]
    return (gs[host_wait], ge[host_wait]), (gs[~host_wait], ge[~host_wait])


def _device_ops_by_start(trace: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """Device ops in start order, with their starts (cached: the accounting and each drawn step ask)."""
    g = trace.gpu
    act = device_op_mask(trace).nonzero()[0]
    order = act[g.ts[act].argsort(kind="stable")]
    return order, g.ts[order]


def _account_cpu(
    trace: RankTrace, starts: np.ndarray, ends: np.ndarray, inputs: InputStats, comm_host: bool
) -> tuple[dict[str, np.ndarray], iv.Claimed, tuple[str, ...]]:
    layers = cpu_layers(trace, inputs, comm_host)
    claimed = iv.claim_in_order(starts, ends, [ivs for _, ivs in layers])
    out: dict[str, np.ndarray] = {}
    for (kind, _), per in zip(layers, claimed.per_layer, strict=True):
        out[kind] = out[kind] + per if kind in out else per
    out["other"] = claimed.unclaimed
    return out, claimed, tuple(kind for kind, _ in layers)


def cpu_layers(trace: RankTrace, inputs: InputStats, comm_host: bool) -> list[tuple[str, iv.Intervals]]:
    """The layers that claim a CPU-only step's time, in claim order (a kind may appear twice)."""
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
    return layers


# --- classification and ranking ------------------------------------------------------------------

# How the verdict is chosen (one function, ``choose_limiter``, shared with the run aggregate):
# every kind gets the time its best change surely saves, per step (``sure_share``). For the waits
# (input, transfer, launch, memory, sync, exposed communication) that is the measured time, or,
# where the change only shortens a measured wait (pinned copies run faster, they do not vanish), the
# low end of its estimated range. For compute it is the precision rule's estimate of what cheaper
# arithmetic saves, counted at ``ESTIMATE_WEIGHT``: a measured wait counts more than an estimated
# kernel speedup. The kind with the most such time limits the step.
ESTIMATE_WEIGHT = 0.5
BUSY_SHARE = 0.5
COMPARABLE_GAIN = 1.2
MIN_CARD_SPEEDUP = 1.02  # expected gains at or below this stay findings, never recommendation cards
WAIT_KINDS = tuple(k for k in KINDS if k != "compute")


@dataclass(frozen=True)
class Diagnosis:
    primary: Bottleneck
    secondary: list[Bottleneck]
    recommendations: list[Recommendation]
    findings: list[Recommendation]  # every rule that fired, including those without a code change
    # Per kind: {share, removable_share, basis, score}: what ``choose_limiter`` ranked.
    limiter: dict[str, dict[str, object]] = field(default_factory=dict)


def sure_share(removable_share: float, basis: str, kind: str, low_speedup: float | None = None) -> float:
    """What a change surely removes, as a fraction of the step (module comment above ``ESTIMATE_WEIGHT``):
    a measured wait all of its time; an estimated kernel speedup (compute) ``ESTIMATE_WEIGHT`` of it;
    an estimate of how much of a measured wait a change removes, the low end of its range."""
    if basis != "estimate":
        return removable_share
    if kind != "compute" and low_speedup is not None:
        return min(removable_share, 1.0 - 1.0 / low_speedup if low_speedup > 1.0 else 0.0)
    return removable_share * ESTIMATE_WEIGHT


def rank_key(rec: Recommendation, step_ns: float) -> float:
    """How recommendations are ranked: what each surely removes, as a fraction of the step."""
    share = rec.removable_us_per_step * 1e3 / step_ns if step_ns > 0 else 0.0
    low = rec.expected_speedup_range[0] if rec.expected_speedup_range else None
    return sure_share(share, rec.basis, rec.kind, low)


def choose_limiter(shares: dict[str, float], removable: dict[str, tuple[float, str]]) -> tuple[str, str]:
    """The kind that limits the step, and why it was chosen ("busy", "removable", "largest share").

    ``shares``: kind -> fraction of step time; ``removable``: kind -> (fraction of the step its
    removal saves, basis). Pure, so a run's aggregate applies exactly the per-trace rule.
    """
    scores = {k: removable.get(k, (0.0, "measured"))[0] for k in KINDS}  # already sure shares
    waits = {k: scores[k] for k in WAIT_KINDS}
    best_wait = max(waits, key=lambda k: (waits[k], k))
    if shares.get("compute", 0.0) >= BUSY_SHARE and speedup(1.0, waits[best_wait]) < COMPARABLE_GAIN:
        return "compute", "busy"
    best = max(scores, key=lambda k: (scores[k], k))
    if speedup(1.0, scores[best]) > MIN_CARD_SPEEDUP:
        return best, "removable"
    return max(KINDS, key=lambda k: (shares.get(k, 0.0), k)), "largest share"


def basis_of(kind: str) -> str:
    return "estimate" if kind == "compute" else "measured"


def classify(ctx: Context) -> Diagnosis:
    shares = {k: ctx.accounting.share(k) for k in KINDS}
    hits = fired(ctx)
    recs = sorted(
        (_render(rule, hit, ctx) for rule, hit in hits),
        key=lambda r: (-rank_key(r, ctx.step_ns), -r.confidence, r.id),
    )
    evidence = {rule.kind: hit.evidence for rule, hit in sorted(hits, key=lambda p: p[1].removable_ns)}
    best = _best_by_kind(recs)
    removable = _removable_by_kind(ctx, best)
    kind, reason = choose_limiter(shares, removable)
    limiter = {
        k: {
            "share": round(shares[k], 4),
            "removable_share": round(removable[k][0], 4),
            "basis": removable[k][1],
            "score": round(removable[k][0], 4),
        }
        for k in KINDS
    }
    # The verdict above weighs every finding; what the report shows never contradicts itself or
    # promises nothing (``consistency``), and the cards and the note below read only that.
    recs = consistent(recs, declared)
    cards = [
        r for r in recs if r.change and r.expected_speedup > MIN_CARD_SPEEDUP and r.basis != "single-pass"
    ]
    cards = _primary_first(kind, cards)
    others = sorted((k for k in KINDS if k != kind), key=lambda k: -shares[k])
    # Confidence from the verdict's own margin: its removable time (or, compute-bound, its busy
    # share) over the best other kind's weighted removable time.
    scores = {k: removable[k][0] for k in KINDS}
    weight = shares[kind] if reason in ("busy", "largest share") else scores[kind]
    top_other = max((scores[k] for k in others), default=0.0)
    primary = Bottleneck(
        kind=kind,
        share=round(shares[kind], 4),
        us_per_step=round(ctx.accounting.mean_ns(kind) / 1e3, 3),
        confidence=_confidence(weight, top_other, ctx),
        evidence=evidence.get(kind, {}),
        gain=_gain(kind, removable[kind], best, ctx),
        basis=removable[kind][1],
        note=_note(kind, reason, cards, recs, ctx),
    )
    secondary = [
        Bottleneck(
            kind=k,
            share=round(shares[k], 4),
            us_per_step=round(ctx.accounting.mean_ns(k) / 1e3, 3),
            confidence=_confidence(shares[k], shares[kind], ctx),
            evidence=evidence.get(k, {}),
            gain=_gain(k, removable[k], best, ctx),
            basis=removable[k][1],
        )
        for k in others
        if shares[k] >= 0.05
    ]
    return Diagnosis(
        primary=primary, secondary=secondary, recommendations=cards, findings=recs, limiter=limiter
    )


def _removable_by_kind(ctx: Context, best: dict[str, Recommendation]) -> dict[str, tuple[float, str]]:
    """Kind -> (fraction of the step its removal surely saves, basis): what the kind's best change
    surely removes (``sure_share``; the card that leads when the kind limits, so verdict and card
    agree), else for a wait no rule has a change for, its measured time; compute has no removable
    time without a change."""
    step = ctx.step_ns or 1.0
    out = {k: (ctx.accounting.share(k), "measured") for k in WAIT_KINDS}
    out["compute"] = (0.0, "estimate")
    for kind, rec in best.items():
        if rec.basis == "single-pass":
            out[kind] = (min(1.0, rec.removable_us_per_step * 1e3 / step), basis_of(kind))
        else:
            out[kind] = (min(1.0, rank_key(rec, step)), rec.basis)
    return out


def _best_by_kind(recs: list[Recommendation]) -> dict[str, Recommendation]:
    """Each kind's highest-ranked finding with a code change (``recs`` is in rank order)."""
    best: dict[str, Recommendation] = {}
    for r in recs:
        if r.change and r.kind not in best:
            best[r.kind] = r
    return best


def _gain(kind: str, removable: tuple[float, str], best: dict[str, Recommendation], ctx: Context) -> float:
    """The speedup the verdict states for ``kind``: its best card's (the high end of an estimate's
    range, the number the card shows), else the speedup of its measured time; none for a one-pass
    trace's kind whose waits may be one-time costs."""
    rec = best.get(kind)
    if rec is not None and rec.basis != "single-pass":
        return rec.expected_speedup_range[1] if rec.expected_speedup_range else rec.expected_speedup
    if not ctx.iterations_found:
        return 1.0
    return round(speedup(1.0, removable[0]), 3)


def _primary_first(kind: str, cards: list[Recommendation]) -> list[Recommendation]:
    """The best card for the primary kind leads; the rest keep their ranking."""
    own = next((r for r in cards if r.kind == kind), None)
    return cards if own is None else [own, *(r for r in cards if r is not own)]


def _note(
    kind: str, reason: str, cards: list[Recommendation], recs: list[Recommendation], ctx: Context
) -> str:
    """One sentence on why the next optimization is not about the primary kind ("" when it is)."""
    if cards and cards[0].kind == kind:
        return ""
    if not ctx.iterations_found:
        return _one_time_note(ctx.pass_waits.get(kind)) + (
            f" The next optimization targets {cards[0].kind}, whose waits recur." if cards else ""
        )
    nxt = f" The next optimization targets {cards[0].kind} instead." if cards else ""
    if kind == "communication" and ctx.ns("compute") < NO_COMPUTE_RATIO * ctx.ns("communication"):
        return (
            "There is almost no compute to hide communication behind: send less (fewer, larger or "
            "compressed collectives) or fix a straggler rank." + nxt
        )
    if reason == "largest share":
        return (
            f"Nothing in the step is removable at a meaningful gain; {kind} is only its largest part." + nxt
        )
    if kind == "compute":
        if any(r.id == "compute.no_cheap_win" for r in recs):
            return "No cheap compute win: the matmul kernels already run in reduced precision." + nxt
        caps = ctx.caps
        if ctx.has_gpu and (caps is None or caps.autocast_dtype is None):
            return "No faster precision is known for this device, so no compute change is proposed." + nxt
        return "The compute is busy with work no rule can make cheaper from the trace alone." + nxt
    return f"No rule has a code change for {kind} waits in this trace." + nxt


def _one_time_note(waits: PassWaits | None) -> str:
    """Why a one-pass trace's kind gets no per-pass gain: its waits are few or long (one-time
    candidates), or, without a device timeline, cannot be counted."""
    if waits is None or waits.count == 0:
        spread = "so its waits may be one-time costs"
    else:
        spread = (
            f"and its {waits.kind} time is carried by {waits.count} stretch{'es' if waits.count != 1 else ''} "
            f"({100 * waits.top_share:.0f}% in the longest {min(TOP_FEW, waits.count)}), too few alike "
            "ones to recur: they may be one-time costs"
        )
    return (
        f"The trace holds no repeated iteration, {spread} (first-call initialisation, autotuning, "
        "compilation): no per-pass gain is claimed; profile several iterations (prof.step() each "
        "iteration) for advice."
    )


def _confidence(share: float, best_other: float, ctx: Context) -> float:
    """Higher when the kind dominates clearly and the trace has several steps to average over."""
    margin = share - best_other
    conf = 0.35 + 0.5 * share + 0.4 * max(-0.5, min(0.5, margin))
    if ctx.n_steps < 2:
        conf -= 0.15
    if not ctx.has_step_markers:
        conf -= 0.1
    if not ctx.iterations_found:
        conf -= 0.15  # one span: warm-up and steady state cannot be told apart
    conf -= 0.5 * ctx.accounting.share("other")  # time we could not explain weakens every verdict
    return round(float(min(0.95, max(0.05, conf))), 2)


def _render(rule: Rule, hit: Hit, ctx: Context) -> Recommendation:
    params = {"kind_pct": 100 * ctx.share(rule.kind)} | hit.params
    waits = None if ctx.iterations_found else ctx.pass_waits.get(rule.kind)
    # A caveat that formats to nothing does not apply to this trace (its query said so).
    caveats = [text for caveat in rule.caveats if (text := caveat.format(**params))]
    if waits is not None and waits.recurs and rule.kind in WAIT_KINDS:
        # One pass whose waits of this kind recur: the recurring part is claimed, per pass.
        hit = _recurring_part(hit, waits.recurring_fraction)
        hit = dataclasses.replace(hit, evidence=hit.evidence | {"one_pass": waits.evidence()})
        basis = rule.basis
        caveats.append(_one_pass_caveat(waits))
    else:
        basis = rule.basis if ctx.iterations_found else "single-pass"
    gain = speedup(ctx.step_ns, hit.removable_ns)
    span = None
    if basis == "estimate":
        lo, hi = hit.removable_range_ns or (0.5 * hit.removable_ns, hit.removable_ns)
        span = (round(speedup(ctx.step_ns, lo), 3), round(speedup(ctx.step_ns, hi), 3))
    elif basis == "single-pass":
        gain = 1.0  # a one-pass trace cannot tell a one-time cost from a per-step one
    words = (lambda text: text) if ctx.iterations_found else _per_pass
    return Recommendation(
        id=rule.id,
        title=words(rule.title),
        kind=rule.kind,
        change=words(rule.change.format(**params)) if rule.change else "",
        why=words(rule.why.format(**params)),
        expected_speedup=round(gain, 3),
        # The part the gain counts (``speedup`` caps it at 95% of the step): N = S / (S - M) as shown.
        removable_us_per_step=round(min(hit.removable_ns, 0.95 * ctx.step_ns) / 1e3, 3),
        confidence=hit.confidence if hit.confidence is not None else 0.5,
        caveats=[words(c) for c in caveats],
        evidence=hit.evidence,
        basis=basis,
        expected_speedup_range=span,
    )


_STEP_WORDS = re.compile(r"\b(per|each|of the|the|a) step\b|\bper-step\b")


def _per_pass(text: str) -> str:
    """A one-pass trace's unit is the pass (one forward, one request), not a training step."""
    return _STEP_WORDS.sub(lambda m: f"{m.group(1)} pass" if m.group(1) else "per-pass", text)


def _recurring_part(hit: Hit, fraction: float) -> Hit:
    """``hit`` cut to the recurring share of its kind's time (a one-pass trace's one-time candidates
    are not claimed)."""
    rng = hit.removable_range_ns
    return dataclasses.replace(
        hit,
        removable_ns=hit.removable_ns * fraction,
        removable_range_ns=None if rng is None else (rng[0] * fraction, rng[1] * fraction),
    )


def _one_pass_caveat(waits: PassWaits) -> str:
    """What a per-pass gain on a one-pass trace counts, and what it leaves out."""
    left = waits.total_ns - waits.recurring_ns
    out = (
        f"One pass, no repeated iteration: the gain counts the {waits.recurring_count} alike waits "
        f"(median {waits.median_ns / 1e3:.1f} µs) that recur within the pass"
    )
    if left > 0:
        out += (
            f"; {left / 1e3:.0f} µs in {waits.count - waits.recurring_count} long waits may be one-time "
            "costs (first call, autotuning, compilation) and is not counted"
        )
    return out + "."
