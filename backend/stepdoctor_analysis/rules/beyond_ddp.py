"""The queries of the advice beyond single-node DDP training: by collective type, for the
allocator, for inference, and for reads of single tensor elements.

Each reads ``Context`` and its rule's ``thresholds``; the records (``catalog``) carry the scope:
the collective types (``Rule.collectives``) and workloads (``Rule.workloads``) each advice fits.
DDP's bucket size and compression hook fix an exposed gradient all-reduce, not an MoE all-to-all or
an FSDP all-gather: the advice follows the collective the step actually waits for.
"""

from __future__ import annotations

from collections.abc import Mapping

from .bottlenecks import overhead_hit
from .record import Context, Hit


def _us(ns: float) -> float:
    return round(ns / 1e3, 1)


def _time(ns: float) -> str:
    """``13.9 ms`` / ``450 µs``: times in a sentence."""
    return f"{ns / 1e6:.1f} ms" if ns >= 1e6 else f"{ns / 1e3:.0f} µs"


# --- communication by collective type ----------------------------------------------------------


def per_job(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Never fires on one trace: a job-level card (``catalog.JOB_RULES``) is decided over the
    job's ranks (``ranks.straggler_advice``)."""
    return None


def exposed_collective(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """The step's exposed time in its dominant collective (the rule's ``collectives`` say which
    types its advice fits); removable: that type's exposed time."""
    dom = ctx.comm.dominant
    if dom is None or dom.exposed_ns_per_step <= 0:
        return None
    evidence = {
        "collective": dom.type,
        "exposed_us_per_step": _us(dom.exposed_ns_per_step),
        "overlapped_us_per_step": _us(dom.overlapped_ns_per_step),
        "calls_per_step": dom.calls_per_step,
        "libraries": dom.libraries,
        "top": dom.top,
        "by_type": {
            c.type: {
                "exposed_us": _us(c.exposed_ns_per_step),
                "overlapped_us": _us(c.overlapped_ns_per_step),
            }
            for c in ctx.comm.by_type
        },
    }
    params = {
        "type": dom.type.replace("_", "-"),
        "exposed": _time(dom.exposed_ns_per_step),
        "hidden_pct": 100 * dom.overlap_fraction,
        "libs": ", ".join(dom.libraries) or "unknown",
    }
    removable = min(dom.exposed_ns_per_step, ctx.ns("communication"))
    return Hit(ctx.share("communication"), removable, evidence, params)


# --- allocator ---------------------------------------------------------------------------------


def allocator_disabled(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    m = ctx.memory
    if m.allocator != "disabled":
        return None
    evidence = dict(m.allocator_evidence) | {
        "allocator_us_per_step": _us(m.alloc_call_ns_per_step),
        "gpu_idle_in_allocator_us_per_step": _us(ctx.ns("memory")),
    }
    params = {"calls": m.alloc_calls_per_step, "ms": m.alloc_call_ns_per_step / 1e6}
    return Hit(ctx.share("memory"), ctx.ns("memory"), evidence, params, 0.9)


# --- inference ---------------------------------------------------------------------------------


def inference_mode(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Grad was on in an inference forward: read from the ops autograd recorded (``grad_enabled``);
    where no op tells, guessed from the absence of a grad-disabling context (less sure)."""
    w = ctx.workload
    if w is None or not w.inference or w.grad_disabled or w.server:
        return None
    evidence = {"workload": w.kind, "evidence": w.evidence, "stack_recorded": w.with_stack}
    if w.grad_enabled:
        evidence["grad"] = w.grad_evidence
        conf, grad = lim["recorded_confidence"], f"grad enabled ({w.grad_evidence})"
    else:  # without recorded ops or Python frames the trace cannot show grad mode
        conf = lim["stack_confidence"] if w.with_stack else lim["guess_confidence"]
        grad = "no grad-disabling context"
    # Autograd bookkeeping is a part of each op's dispatch cost: a modest share of the overhead.
    overhead = ctx.ns("launch")
    gain = (lim["overhead_gain_low"], lim["overhead_gain"], lim["overhead_gain_high"])
    return Hit(
        1.0, gain[1] * overhead, evidence, {"grad": grad}, conf, (gain[0] * overhead, gain[2] * overhead)
    )


def inference_graphs(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    w = ctx.workload
    if not ctx.has_gpu or w is None or not w.inference:
        return None
    evidence = {
        "host_wait_us_per_step": _us(ctx.ns("launch")),
        "kernels_per_step": w.kernels_per_step,
        "median_kernel_us": w.median_kernel_us,
        "phase": w.phase,
        "cuda_graphs_already": w.cuda_graphs,
    }
    if w.cuda_graphs:
        change = (
            "CUDA graphs are already replayed: batch more requests per forward (vLLM max_num_seqs, SGLang "
            "--max-running-requests, or a larger eval batch_size) and move the remaining per-step Python "
            "(sampling, scheduling) off the critical path (overlap scheduling, async output processing)"
        )
    elif w.phase in ("decode", "prefill+decode"):
        change = (
            'model.generation_config.cache_implementation = "static"; '
            'model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)  '
            "# static KV cache + CUDA graphs for the decode loop; or serve with vLLM/SGLang, which graph decode"
        )
    else:
        batching = (
            "a larger batch_size, or dynamic batching in the server" if w.server else "a larger batch_size"
        )
        change = (
            'model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs; and batch more inputs '
            f"per forward ({batching})"
        )
    decode = w.phase in ("decode", "prefill+decode")
    params = {
        "kernels": w.kernels_per_step,
        "median_us": w.median_kernel_us,
        "change": change,
        "kv_cache": "A static KV cache preallocates memory for the maximum sequence length."
        if decode
        else "",
    }
    return Hit(ctx.share("launch"), ctx.ns("launch"), evidence, params)


def inference_cpu_overhead(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    w = ctx.workload
    if ctx.has_gpu or w is None or not w.inference:
        return None
    return overhead_hit(ctx, lim, 0.5)


def inference_sync(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Reads in an inference loop; a decode loop (the phase the trace shows) reads tokens back."""
    w, s = ctx.workload, ctx.sync
    if w is None or not w.inference or s.calls_per_step <= 0:
        return None
    top = s.triggers[0].op if s.triggers else "a blocking call"
    evidence = {
        "sync_calls_per_step": round(s.calls_per_step, 2),
        "dtoh_reads_per_step": round(s.dtoh_reads_per_step, 2),
        "gpu_idle_after_sync_us_per_step": _us(ctx.ns("sync")),
        "triggers": [{"op": t.op, "calls": t.count, "blocked_us": _us(t.blocked_ns)} for t in s.triggers[:5]],
        "phase": w.phase,
    }
    if w.phase in ("decode", "prefill+decode"):
        change = (
            f"Do not read tokens back per step ({top}: .item(), .tolist(), .cpu()): keep stopping criteria on "
            "the device (an eos mask with torch.where), copy generated ids out every N steps with "
            "non_blocking=True into pinned memory"
        )
        caveat = "Streaming servers must emit tokens as they come: overlap the copy, do not block on it."
    else:
        change = (
            f"Do not read results back every iteration ({top}: .item(), .tolist(), .cpu(), print): keep them "
            "on the device (collect them in a tensor, decide with torch.where), read once after the loop or "
            "every N iterations with non_blocking=True into pinned memory"
        )
        caveat = "A decision that depends on a value needs its read: batch such checks every N iterations."
    params = {"trigger": top, "calls": s.calls_per_step, "change": change, "caveat": caveat}
    return Hit(ctx.share("sync"), ctx.ns("sync"), evidence, params)


def element_reads(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Many tiny device-to-host reads, each blocking: a Python loop over a tensor's elements
    (``total += x[i].cpu()``). Pinned memory cannot help a 4-byte copy; the loop must go."""
    s = ctx.sync
    if s.dtoh_reads_per_step <= 0 or s.dtoh_read_median_bytes > lim["max_read_bytes"]:
        return None
    if ctx.share("sync") < lim["min_sync_share"]:
        return None
    top = s.triggers[0].op if s.triggers else "a blocking read"
    evidence = {
        "dtoh_reads_per_step": round(s.dtoh_reads_per_step, 1),
        "median_read_bytes": s.dtoh_read_median_bytes,
        "sync_calls_per_step": round(s.calls_per_step, 1),
        "gpu_idle_after_reads_us_per_step": _us(ctx.ns("sync")),
        "triggers": [{"op": t.op, "calls": t.count, "blocked_us": _us(t.blocked_ns)} for t in s.triggers[:5]],
    }
    params = {"reads": s.dtoh_reads_per_step, "bytes": s.dtoh_read_median_bytes, "trigger": top}
    return Hit(s.dtoh_reads_per_step, ctx.ns("sync"), evidence, params, 0.85)


def inference_compute(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    w = ctx.workload
    compute = ctx.ns("compute")
    if w is None or not w.inference or compute <= 0:
        return None
    names = [k.name for k in (ctx.ops.top_kernels if ctx.has_gpu else ctx.ops.top_ops)[:5]]
    conv = any("conv" in n.lower() for n in names)
    if ctx.has_gpu:
        fp32 = sum(ctx.ops.matmul_ns_by_precision.get(p, 0.0) for p in ("fp32", "tf32"))
        if fp32 < lim["min_fp32_share"] * ctx.step_ns:  # matmuls already in 16 bits or less: no win left
            return None
        change = (
            "model = model.to(torch.bfloat16)  # bf16 weights and activations (torch.float16 before "
            "compute capability 8.0); or weight-only int8/fp8 quantization (torchao.quantization.quantize_)"
        )
        frac = lim["gpu_gain"]
    else:
        change = (
            "model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)  "
            "# int8 weights for Linear/LSTM layers on CPU"
        )
        frac = lim["cpu_gain"]
    if conv:
        change += (
            "; model = model.to(memory_format=torch.channels_last) and inputs "
            "x.to(memory_format=torch.channels_last) for the convolutions"
        )
    evidence = {"compute_us_per_step": _us(compute), "top": names[:3], "convolutions": conv}
    removable = compute * frac
    return Hit(
        ctx.share("compute"),
        removable,
        evidence,
        {"change": change},
        None,
        (compute * lim["gain_low"], compute * lim["gain_high"]),
    )
