"""The queries of the per-kind rules: input, transfer, sync, launch, memory, communication, compute.

Each reads ``Context`` and its rule's ``thresholds`` and returns a ``Hit`` (metric, removable time,
evidence, template parameters) or None; the records that run them are in ``catalog``.

Ranking uses the upper-bound speedup total / (total − removable) (Nsight/RATELProf, anchors §4).
Thresholds follow the peers where they had one (TensorBoard: DataLoader > 5% of the step,
communication > 10%, peak memory > 90%) and add what they lacked: pageable copies, host syncs,
launch overhead, allocator churn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..analyzers.inputs import suggested_workers
from ..analyzers.precision import LATENCY_BOUND_NS, LOW_PRECISION, host_link_gbps, peak_ratio
from ..analyzers.sync import BlockingCalls
from ..analyzers.transfers import BANDWIDTH_MIN_BYTES
from ..model import intervals as iv
from .record import Context, Hit, Query


def _us(ns: float) -> float:
    return round(ns / 1e3, 1)


def idle_ns(ctx: Context, kind: str) -> float:
    """Device idle time charged to ``kind`` per step (``diagnose.charge_idle``): for transfer, the
    idle around blocking host-to-device copies, apart from the copies' own (busy) time."""
    stretches = ctx.accounting.idle.get(kind)
    return iv.total(stretches) / ctx.n_steps if stretches is not None and ctx.n_steps else 0.0


def loader_wait(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    st, ld = ctx.inputs, ctx.loader
    if st.loader_ns_per_step <= 0:
        return None
    workers = suggested_workers(ld)
    single = st.single_process or ld.num_workers == 0
    evidence = {
        "loader_us_per_step": _us(st.loader_ns_per_step),
        "exposed_us_per_step": _us(ctx.ns("input")),
        "iterators": st.iterators,
        "max_wait_us": _us(st.max_wait_ns),
        "num_workers": ld.num_workers,
        "cpu_count": ld.cpu_count,
    }
    pin = ", pin_memory=True" if ctx.has_gpu else ""
    change = f"DataLoader(dataset, batch_size=..., num_workers={workers}{pin}, persistent_workers=True, prefetch_factor=4)"
    if not single:
        change += (
            "; and make __getitem__ cheaper (decode/augment once and cache, or move transforms to the GPU)"
        )
    cause = (
        "the main process loads every batch itself (single-process DataLoader, num_workers=0)"
        if single
        else "the worker processes cannot prefetch batches as fast as the step consumes them"
    )
    htod = ctx.transfers.direction("HtoD")
    htod_bytes = htod.bytes_per_step if htod is not None and htod.pinned_count_per_step > 0 else 0.0
    if _loader_workers(ctx) and htod_bytes > 0 and (ld.pin_memory or htod_bytes >= BANDWIDTH_MIN_BYTES):
        # pin_memory=True with workers: one thread copies every batch into page-locked memory,
        # and it can be the limit instead of the workers; the trace does not record that thread.
        mb = htod_bytes / 2**20
        cause += (
            f", or the loader's pin-memory thread cannot copy them into page-locked memory as fast "
            f"({mb:.1f} MB copied host-to-device per step; one thread, sharing the GIL with the loop)"
        )
        change += (
            "; more workers only help if the workers are the limit: time `for batch in loader: pass` "
            "with pin_memory=True and False to tell the workers from the pin-memory thread"
        )
        evidence["htod_mb_per_step"] = round(mb, 2)
    return Hit(ctx.share("input"), ctx.ns("input"), evidence, {"change": change, "cause": cause})


def pageable_copies(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Pinned copies run at the link's rate, and non_blocking lets them overlap the rest of the step.

    Only pageable copies large enough to be bandwidth-bound (``transfers.BANDWIDTH_MIN_BYTES``) are
    estimated: a 4-byte copy's "rate" measures its latency, and pinning it gains nothing; tiny
    copies in a loop are ``transfer.small_copies``' and the syncs' problem.
    Low end: the exposed pageable copies only get faster (pageable rate -> pinned rate, measured on
    the trace's own large pinned copies, else the device's reference link rate). High end: they also
    overlap everything else, so the step shrinks to the highest of what still runs: the copies at
    the pinned rate, the kernels, the host's own work (``floors``), and by no more than the exposed
    pageable copy time (other waits are not this change's to remove).
    """
    t = ctx.transfers
    if t.bulk_pageable_count_per_step <= 0 or t.copy_ns_per_step <= 0:
        return None
    bulk_ns, bulk_bytes = t.bulk_pageable_ns_per_step, t.bulk_pageable_bytes_per_step
    frac = min(1.0, bulk_ns / t.copy_ns_per_step)
    # The device idle while the host blocks in host-to-device copies and relaunches after them
    # (``sync.htod_blocking_mask``): gone with non_blocking copies, all of it (the low end too);
    # the exposed copies themselves only run faster.
    blocked = idle_ns(ctx, "transfer")
    exposed = (ctx.ns("transfer") - blocked) * frac + blocked
    htod = t.direction("HtoD")
    pageable_gbps = bulk_bytes / bulk_ns if bulk_ns > 0 else 0.0
    link = host_link_gbps(ctx.caps)
    rate, source = (
        (t.pinned_gbps, "pinned copies in this trace")
        if t.pinned_gbps > 0
        else (link, f"reference for the {ctx.caps.arch if ctx.caps else ''} host link")
        if link
        else (lim["pinned_over_pageable"] * pageable_gbps, "pageable rate x pinned_over_pageable")
    )
    rate = max(rate, pageable_gbps)  # pinned copies are never slower than staged ones
    pinned_ns = bulk_bytes / rate if rate > 0 else bulk_ns
    lo = min(exposed, max(0.0, bulk_ns - pinned_ns) + blocked)
    hi = exposed
    f = ctx.floors
    if f is not None:
        floor = max(f.copies - bulk_ns + pinned_ns, f.kernels, f.host)
        hi = min(exposed, ctx.step_ns - floor)
        lo = min(lo, max(hi, 0.0))
        hi = max(lo, hi)
    blocking = ctx.sync.htod
    evidence = {
        "pageable_copies_per_step": round(t.pageable_count_per_step, 2),
        "bandwidth_bound_copies_per_step": round(t.bulk_pageable_count_per_step, 2),
        "pageable_mb_per_step": round(bulk_bytes / 2**20, 2),
        "exposed_copy_us_per_step": _us(ctx.ns("transfer")),
        "htod_bandwidth_gbps": round(htod.bandwidth_gbps, 2) if htod else None,
        "pageable_gbps": round(pageable_gbps, 2),
        "pinned_gbps": round(rate, 2),
        "pinned_rate_source": source,
        "pinned_copy_us_per_step": _us(pinned_ns),
        "blocking_htod": {
            "ops": [
                {"op": x.op, "calls": x.count, "blocked_us": _us(x.blocked_ns)} for x in blocking.triggers[:3]
            ],
            "calls_per_step": round(blocking.calls_per_step, 2),
            "host_blocked_us_per_step": _us(blocking.blocked_ns_per_step),
            "gpu_idle_us_per_step": _us(blocked),
        },
    }
    from_workers = _loader_workers(ctx)
    evidence["from_loader_workers"] = from_workers
    params = {
        "gbps": pageable_gbps,
        "pinned_gbps": rate,
        "source": source,
        "blocks": _blocks(blocking, blocked),
        "pin_thread": _pin_thread(bulk_bytes) if from_workers else "",
    }
    return Hit(ctx.share("transfer"), 0.5 * (lo + hi), evidence, params, 0.9, (lo, hi))


def _loader_workers(ctx: Context) -> bool:
    """Batches come from DataLoader worker processes (the trace's iterator, or the run metadata)."""
    return ctx.inputs.multi_process or (ctx.loader.num_workers or 0) > 0


def _pin_thread(bytes_per_step: float) -> str:
    """What pin_memory=True costs when the batches come from worker processes: the profiler does
    not record the loader's pin-memory thread, so no estimate can include it (on the H100 loop in
    tests/fixtures/traces/cuda/transfer_workers it took the measured gain from ~1.6x to 1.05-1.25x)."""
    return (
        "The batches come from DataLoader worker processes through shared memory: pin_memory=True adds "
        f"a copy of each batch ({bytes_per_step / 2**20:.1f} MB per step) into page-locked memory, made by "
        "one thread of the training process that shares the GIL with the loop. The estimate leaves that "
        "copy out: if the thread cannot keep pace, the wait moves into DataLoader.__next__. Time the loop "
        "after the change; fewer bytes per batch (uint8 rather than float32, converted on the GPU) cut "
        "both copies."
    )


def _blocks(blocking: BlockingCalls, idle: float) -> str:
    """Which op blocked the host copying host-to-device, for the pinned-memory card's text."""
    if blocking.calls_per_step <= 0:
        return ""
    op = blocking.triggers[0].op if blocking.triggers else "a copy"
    return (
        f" {op} blocks the host copying host→device ({blocking.calls_per_step:.0f} blocking calls per step: "
        f"the staged copy, the synchronize after it); the GPU idles {idle / 1e3:.0f} µs per step around them."
    )


def exposed_copies(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    t = ctx.transfers
    if t.copy_ns_per_step <= 0 or t.pageable_count_per_step > 0:
        return None
    evidence = {
        "exposed_copy_us_per_step": _us(ctx.ns("transfer")),
        "copy_us_per_step": _us(t.copy_ns_per_step),
    }
    return Hit(ctx.share("transfer"), ctx.ns("transfer"), evidence)


def sync_copies(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    t = ctx.transfers
    if t.sync_copy_calls_per_step <= 0:
        return None
    evidence = {
        "sync_copy_calls_per_step": t.sync_copy_calls_per_step,
        "host_blocked_us_per_step": _us(t.sync_copy_host_ns_per_step),
    }
    return Hit(
        t.sync_copy_calls_per_step,
        min(t.sync_copy_host_ns_per_step, ctx.ns("sync") + ctx.ns("transfer")),
        evidence,
    )


def host_syncs(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    s = ctx.sync
    if s.calls_per_step <= 0:
        return None
    triggers = [{"op": t.op, "calls": t.count, "blocked_us": _us(t.blocked_ns)} for t in s.triggers[:5]]
    top = s.triggers[0].op if s.triggers else "a blocking call"
    evidence = {
        "sync_calls_per_step": round(s.calls_per_step, 2),
        "host_blocked_us_per_step": _us(s.blocked_ns_per_step),
        "gpu_idle_after_sync_us_per_step": _us(ctx.ns("sync")),
        "apis": s.by_api,
        "triggers": triggers,
    }
    return Hit(
        ctx.share("sync"), ctx.ns("sync"), evidence, {"trigger": top, "calls": round(s.calls_per_step, 1)}
    )


def gpu_launch(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    if not ctx.has_gpu:
        return None
    o = ctx.ops
    evidence = {
        "host_wait_us_per_step": _us(ctx.ns("launch")),
        "kernels_per_step": round(o.kernels_per_step, 1),
        "median_kernel_us": _us(o.median_kernel_ns),
    }
    if ctx.launch is not None and ctx.launch.count:
        evidence |= {
            "median_launch_us": _us(ctx.launch.cpu_duration_ns["p50"]),
            "median_launch_delay_us": _us(ctx.launch.launch_delay_ns["p50"]),
            "short_kernel_fraction": round(ctx.launch.short_kernels / ctx.launch.count, 3),
        }
    params = {"kernels": o.kernels_per_step, "median_us": o.median_kernel_ns / 1e3}
    return Hit(ctx.share("launch"), ctx.ns("launch"), evidence, params)


def overhead_hit(ctx: Context, lim: Mapping[str, float], weak_confidence: float) -> Hit:
    """CPU dispatch overhead (training or inference): confident only for many tiny ops, not a few
    big non-matmul ops, so a small median op is required."""
    o = ctx.ops
    evidence = {
        "overhead_us_per_step": _us(ctx.ns("launch")),
        "ops_per_step": round(o.ops_per_step, 1),
        "median_op_us": _us(o.median_op_ns),
    }
    many_tiny = o.median_op_ns < lim["small_median_op_ns"] and o.ops_per_step >= lim["many_ops_per_step"]
    params = {"ops": o.ops_per_step, "median_us": o.median_op_ns / 1e3}
    return Hit(
        ctx.share("launch"), ctx.ns("launch"), evidence, params, 0.85 if many_tiny else weak_confidence
    )


def cpu_overhead(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    return None if ctx.has_gpu else overhead_hit(ctx, lim, 0.45)


def cpu_temporaries(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    if ctx.has_gpu:
        return None
    cpu = next((d for d in ctx.memory.devices if d.device == "cpu"), None)
    evidence: dict[str, Any] = {"memory_op_us_per_step": _us(ctx.ns("memory"))}
    if cpu:
        evidence |= {
            "alloc_mb_per_step": round(cpu.alloc_bytes_per_step / 2**20, 2),
            "allocs_per_step": round(cpu.allocs_per_step, 1),
            "peak_mb": round(cpu.peak_allocated / 2**20, 2),
        }
    conf = 0.8 if cpu and cpu.alloc_bytes_per_step >= lim["large_alloc_mb_per_step"] * 2**20 else 0.5
    mb = cpu.alloc_bytes_per_step / 2**20 if cpu else 0.0
    return Hit(ctx.share("memory"), ctx.ns("memory"), evidence, {"mb": mb}, conf)


def steady_allocator(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Steady-state cudaMalloc/cudaFree; the fix follows who frees: frees outside any op are an
    explicit ``torch.cuda.empty_cache()`` (expandable segments would not stop it), frees inside
    ops are the allocator's own retry when an allocation finds no fitting block."""
    m = ctx.memory
    if m.steady_alloc_calls_per_step <= 0:
        return None
    outside = m.steady_frees_outside_ops_per_step
    explicit = m.steady_frees_per_step > 0 and outside >= lim["explicit_free_share"] * m.steady_frees_per_step
    evidence = {
        "cudaMalloc_cudaFree_per_step": round(m.steady_alloc_calls_per_step, 2),
        "host_us_per_step": _us(m.steady_alloc_call_ns_per_step),
        "gpu_idle_us_per_step": _us(ctx.ns("memory")),
        "frees_per_step": round(m.steady_frees_per_step, 2),
        "frees_outside_ops_per_step": round(outside, 2),
    }
    if explicit:
        change = "Remove torch.cuda.empty_cache() from the loop (call it, if at all, once outside the training loop)"
        cause = (
            f"{outside:.0f} of its {m.steady_frees_per_step:.0f} cudaFree calls per step run outside any op: "
            "an explicit torch.cuda.empty_cache() hands the cache back, and the next step allocates it again"
        )
        caveat = "To release memory between phases (evaluation, another model), call it once there, not every step."
    else:
        change = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the first CUDA allocation)"
        cause = "the calls run inside allocating ops: the cache has no fitting block (fragmentation or varying shapes)"
        caveat = "Varying input shapes cause this too: pad or bucket them."
    params = {"change": change, "cause": cause, "caveat": caveat}
    return Hit(m.steady_alloc_calls_per_step, max(ctx.ns("memory"), 0.0), evidence, params)


def exposed_comm(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    c = ctx.comm
    if c.kernel_ns_per_step <= 0 and c.host_collective_ns_per_step <= 0:
        return None
    exposed, compute = ctx.ns("communication"), ctx.ns("compute")
    evidence = {
        "collective_us_per_step": _us(c.kernel_ns_per_step or c.host_collective_ns_per_step),
        "exposed_us_per_step": _us(exposed),
        "compute_us_per_step": _us(compute),
        "overlap_fraction": round(c.overlap_fraction, 3),
        "top_collectives": [{"name": n, "count": k, "total_us": _us(t)} for n, k, t in c.top_kernels[:3]],
    }
    # Overlap can hide communication only behind compute that exists: at most the step's compute
    # time, and nothing worth a change when compute is under a tenth of the exposed collectives.
    hideable = min(exposed, compute) if compute >= lim["no_compute_ratio"] * exposed else 0.0
    return Hit(ctx.share("communication"), hideable, evidence)


_FP32_CLASS = ("fp32", "tf32")  # matmul precisions that reduced precision speeds up


def _exposed_kernel_fraction(ctx: Context) -> float:
    """The part of summed kernel time the step waits for (compute time over summed kernels: kernels
    on several streams overlap), to scale a kind of kernels' summed time to step time."""
    o = ctx.ops
    return min(1.0, ctx.ns("compute") / o.kernel_ns_per_step) if o.kernel_ns_per_step > 0 else 0.0


def _fp32_matmul_work(ctx: Context, *, short: bool = False) -> dict[str, float]:
    """FP32/TF32 matmul-class time per step that a faster precision can shorten, scaled to the
    exposed compute (kernels may overlap); ``short``: instead the time in kernels too short for
    precision to matter (``precision.LATENCY_BOUND_NS``)."""
    o = ctx.ops
    scale = _exposed_kernel_fraction(ctx)
    short_ns = o.matmul_short_ns_by_precision
    if short:
        return {p: short_ns.get(p, 0.0) * scale for p in _FP32_CLASS}
    return {p: (o.matmul_ns_by_precision.get(p, 0.0) - short_ns.get(p, 0.0)) * scale for p in _FP32_CLASS}


def fp32_compute(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    compute = ctx.ns("compute")
    if compute <= 0:
        return None
    top = [k.name for k in (ctx.ops.top_kernels if ctx.has_gpu else ctx.ops.top_ops)[:3]]
    evidence: dict[str, Any] = {"compute_us_per_step": _us(compute), "top": top}
    if not ctx.has_gpu:
        # CPUs: bf16 helps only with AVX512-BF16/AMX units; a modest estimate.
        change = 'with torch.autocast(device_type="cpu", dtype=torch.bfloat16): loss = model(batch)'
        hardware = "On CPUs without bf16 units (AVX512-BF16/AMX) bf16 can be slower."
        return Hit(
            ctx.share("compute"),
            lim["cpu_gain"] * compute,
            evidence,
            {"change": change, "hardware": hardware, "work": "arithmetic", "dtype": "bfloat16"},
            removable_range_ns=(lim["cpu_gain_low"] * compute, lim["cpu_gain"] * compute),
        )
    caps = ctx.caps
    dtype = caps.autocast_dtype if caps else None
    work = _fp32_matmul_work(ctx)
    if dtype is None or sum(work.values()) < lim["min_fp32_share"] * ctx.step_ns:
        return None  # already low precision, no matmul work, or no faster dtype on this device
    est = precision_gain(ctx, lim, work, dtype)
    if est is None:  # no peak figures for this device: fixed fractions of the matmul time
        lo, mid, hi = (sum(work[p] * lim[f"{p}_gain{end}"] for p in work) for end in ("_low", "", "_high"))
        basis = ""
    else:
        lo, mid, hi, basis = est
    evidence |= {
        "fp32_matmul_us_per_step": _us(work["fp32"]),
        "tf32_matmul_us_per_step": _us(work["tf32"]),
        "matmul_us_by_precision": {k: _us(v) for k, v in ctx.ops.matmul_ns_by_precision.items()},
        **_precision_sources(ctx),
        "device_arch": caps.arch if caps else None,
        "autocast_dtype": dtype,
        "estimate_basis": basis
        or "fixed fractions of the FP32 matmul time (no peak figures for this device)",
    }
    if dtype == "bfloat16":
        change = (
            'with torch.autocast(device_type="cuda", dtype=torch.bfloat16): loss = model(batch)  '
            '# or first torch.set_float32_matmul_precision("high") (TF32)'
            if caps and caps.tf32
            else 'with torch.autocast(device_type="cuda", dtype=torch.bfloat16): loss = model(batch)'
        )
        hardware = f"{caps.arch if caps else 'This GPU'} has bf16 units; bf16 keeps FP32's range, no loss scaling needed."
    else:
        change = (
            'scaler = torch.amp.GradScaler("cuda"); with torch.autocast(device_type="cuda", dtype=torch.float16): '
            "loss = model(batch); scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()"
        )
        hardware = (
            f"{caps.arch if caps else 'This GPU'} has FP16 tensor cores but no bf16: use float16 with a GradScaler "
            "(inference needs no scaler)."
        )
    if basis:
        hardware += f" Estimate: {basis}."
    params = {
        "change": change,
        "hardware": hardware,
        "dtype": dtype,
        "work": "FP32 matmul/conv/attention",
        "fp32_pct": 100 * sum(work.values()) / ctx.step_ns if ctx.step_ns else 0.0,
    }
    return Hit(ctx.share("compute"), mid, evidence, params, removable_range_ns=(lo, hi))


def precision_gain(
    ctx: Context, lim: Mapping[str, float], work: Mapping[str, float], target: str
) -> tuple[float, float, float, str] | None:
    """Matmul time per step that running ``work`` (ns per source precision) in ``target`` removes:
    (low, point, high, basis in words); None when the device's peak figures are unknown.

    Each source precision's matmuls run the device's dense peak ratio (``precision.peak_ratio``)
    times an efficiency between ``peak_efficiency_low`` (reduced-precision kernels reach less of
    their peak at small or awkward shapes) and ``peak_efficiency_high`` (large GEMMs reach as much
    of it as FP32 SIMT kernels of theirs, or more); the point estimate takes the geometric mean.
    """
    lo = mid = hi = 0.0
    said = []
    for source, ns in work.items():
        if ns <= 0:
            continue
        ratio = peak_ratio(ctx.caps, source, target)
        if ratio is None:
            return None
        fast = [max(1.0, ratio * lim[k]) for k in ("peak_efficiency_low", "peak_efficiency_high")]
        fast.insert(1, (fast[0] * fast[1]) ** 0.5)
        lo, mid, hi = (acc + ns * (1.0 - 1.0 / f) for acc, f in zip((lo, mid, hi), fast, strict=True))
        said.append(f"{source} matmuls {fast[0]:.1f}–{fast[2]:.1f}× faster ({ratio:.1f}× dense peak)")
    arch = ctx.caps.arch if ctx.caps else "?"
    return lo, mid, hi, f"{arch} {target}: " + ", ".join(said)


def _precision_sources(ctx: Context) -> dict[str, Any]:
    """Kernel-name and op-dtype evidence for the matmul precision, when record_shapes gave op dtypes."""
    got = ctx.ops.matmul_precision_evidence
    return {"precision_sources": got} if got else {}


def no_cheap_compute_win(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Matmuls already in reduced precision (or FP32 work too small): say so instead of advising it again."""
    if not ctx.has_gpu or ctx.ns("compute") <= 0:
        return None
    by = ctx.ops.matmul_ns_by_precision
    matmul = sum(by.values())
    low = sum(v for k, v in by.items() if k in LOW_PRECISION)
    floor = lim["min_fp32_share"] * ctx.step_ns
    if matmul <= 0 or sum(_fp32_matmul_work(ctx).values()) >= floor:
        return None
    if sum(_fp32_matmul_work(ctx, short=True).values()) >= floor:
        return None  # FP32 matmuls too short for precision: compute.small_matmuls says so
    dtypes = ", ".join(
        k for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= lim["named_dtype_share"] * matmul
    )
    evidence = {
        "matmul_us_by_precision": {k: _us(v) for k, v in by.items()},
        "low_precision_fraction": round(low / matmul, 3),
        **_precision_sources(ctx),
    }
    return Hit(ctx.share("compute"), 0.0, evidence, {"dtypes": dtypes, "low_pct": 100 * low / matmul}, 0.7)


def small_matmuls(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """FP32 matmuls that are mostly microsecond kernels: lower precision would not shorten them."""
    if not ctx.has_gpu or ctx.ns("compute") <= 0:
        return None
    short = sum(_fp32_matmul_work(ctx, short=True).values())
    if short <= 0 or sum(_fp32_matmul_work(ctx).values()) >= lim["min_fp32_share"] * ctx.step_ns:
        return None
    evidence = {
        "fp32_matmul_us_per_step": _us(sum(ctx.ops.matmul_ns_by_precision.get(p, 0.0) for p in _FP32_CLASS)),
        "in_kernels_under_us": _us(LATENCY_BOUND_NS),
        "short_fp32_matmul_us_per_step": _us(short),
        "median_kernel_us": _us(ctx.ops.median_kernel_ns),
    }
    params = {"short_pct": 100 * short / ctx.step_ns, "bound_us": LATENCY_BOUND_NS / 1e3}
    return Hit(short / ctx.step_ns, 0.0, evidence, params, 0.7)


def layout_transforms(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """NCHW<->NHWC transforms around convolution kernels: the time channels_last tensors remove."""
    o = ctx.ops
    if not ctx.has_gpu or o.layout_transform_ns_per_step <= 0:
        return None
    removable = o.layout_transform_ns_per_step * _exposed_kernel_fraction(ctx)
    evidence = {
        "layout_transform_us_per_step": _us(o.layout_transform_ns_per_step),
        "exposed_us_per_step": _us(removable),
    }
    params = {"us": removable / 1e3}
    return Hit(removable / ctx.step_ns if ctx.step_ns else 0.0, removable, evidence, params, 0.85)


_TORCH_OPTIMIZERS = {
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
}
_FUSED_OPTIMIZERS = {"Adam", "AdamW", "SGD"}  # fused=True on CUDA (torch >= 2.4 for SGD)


def single_tensor_optimizer(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Name the optimizer the trace shows (``Optimizer.step#SGD.step``), not a default one."""
    p = ctx.pattern("single_tensor_optimizer")
    if p is None:
        return None
    opt = str(p.evidence.get("optimizer") or "")
    if opt in _TORCH_OPTIMIZERS:
        change = f"torch.optim.{opt}(model.parameters(), lr=..., foreach=True)"
        if opt in _FUSED_OPTIMIZERS and ctx.has_gpu:
            change += "  # or fused=True (one kernel for all parameters)"
    else:
        change = f"Update all parameters at once in {opt or 'the optimizer'}.step with torch._foreach_* ops"
    removable = min(p.removable_ns_per_step, ctx.step_ns)
    return Hit(
        p.metric,
        removable,
        dict(p.evidence),
        {"change": change, "optimizer": opt or "the optimizer"},
        0.8,
        (0.5 * removable, removable),
    )


def simt_fp32(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """FP32 GEMMs on CUDA cores: what TF32 tensor cores remove, by the device's peak ratio (the
    same model as the mixed-precision card, so the two cards' ranges compare)."""
    p = ctx.pattern("fp32_matmul")
    if p is None:
        return None
    est = precision_gain(ctx, lim, {"fp32": _fp32_matmul_work(ctx)["fp32"]}, "tf32")
    if est is None:
        return anti_pattern("fp32_matmul")(ctx, lim)
    lo, mid, hi, basis = est
    evidence = dict(p.evidence) | {"estimate_basis": basis}
    return Hit(p.metric, mid, evidence, confidence=0.8, removable_range_ns=(lo, hi))


def anti_pattern(pid: str) -> Query:
    def query(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
        p = ctx.pattern(pid)
        if p is None:
            return None
        removable = min(p.removable_ns_per_step, ctx.step_ns)
        return Hit(
            p.metric,
            removable,
            dict(p.evidence),
            confidence=0.8,
            removable_range_ns=(0.5 * removable, removable),
        )

    return query
