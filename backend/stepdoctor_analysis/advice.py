"""Advice beyond single-node DDP training: by collective type, for the allocator, for inference.

Rules here are data like those in ``rules.py`` (which appends them to ``RULES``): keyword specs of
``rules.Rule`` whose queries read ``Context`` and the rule's own ``thresholds``. A rule names the
workloads it fits (``Rule.workloads``): advice for both training and inference also fits a workload
the trace cannot tell ("unknown", ``workload.fits``); advice for one kind does not. Two tables scope
the existing rules:
- ``TRAINING_ONLY``: advice that only means something with a backward pass and an optimizer, never
  given to an inference trace, nor to one whose workload is unknown (``workload``);
- ``COLLECTIVE_SCOPE``: the communication advice that fits each collective type. DDP's bucket size
  and compression hook fix an exposed gradient all-reduce, not an MoE all-to-all or an FSDP
  all-gather: the advice follows the collective the step actually waits for (``comm.dominant``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .rules import Context, Hit, Query, Rule

TRAINING = ("training",)
INFERENCE = ("inference",)

# Rule id -> why it is training advice.
TRAINING_ONLY: dict[str, str] = {
    "launch.foreach_optimizer": "an optimizer step exists only in training",
    "memory.zero_grad_set_to_none": "gradients exist only in training",
    "communication.overlap": "DDP gradient buckets and compression hooks exist only in training",
    "sync.host_sync": "its advice (accumulate the loss on the device) is a training loop's",
    "launch.cuda_graphs": "inference gets inference.cuda_graphs (static KV cache, batching)",
    "launch.cpu_overhead": "inference gets inference.cpu_overhead (inference_mode, batching)",
    "compute.mixed_precision": "its autocast-around-the-loss change is a training step's",
}
# Rule id -> the dominant collective types its advice addresses (None: no typed collective seen).
COLLECTIVE_SCOPE: dict[str, tuple[str | None, ...]] = {
    "communication.overlap": ("all_reduce", "broadcast", "reduce", "other", None),
}
# Rule id -> allocator states in which it applies (``memory.allocator``).
ALLOCATOR_SCOPE: dict[str, tuple[str | None, ...]] = {
    "memory.allocator_steady_state": ("thrashing", "ok", None),
}


def scoped(rule: Rule) -> Rule:
    """``rule`` limited to the workloads, collective types and allocator states it fits."""
    if rule.id in TRAINING_ONLY:
        rule = dataclasses.replace(rule, workloads=TRAINING)
    if rule.id in COLLECTIVE_SCOPE:
        rule = dataclasses.replace(rule, query=_when_dominant(COLLECTIVE_SCOPE[rule.id], rule.query))
    if rule.id in ALLOCATOR_SCOPE:
        rule = dataclasses.replace(rule, query=_when_allocator(ALLOCATOR_SCOPE[rule.id], rule.query))
    return rule


def _when_dominant(types: tuple[str | None, ...], query: Query) -> Query:
    def scoped_query(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
        dom = ctx.comm.dominant
        return query(ctx, lim) if (dom.type if dom else None) in types else None

    return scoped_query


def _when_allocator(states: tuple[str | None, ...], query: Query) -> Query:
    def scoped_query(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
        return query(ctx, lim) if ctx.memory.allocator in states else None

    return scoped_query


def _hit(*args: Any, **kwargs: Any) -> Hit:
    from .rules import Hit  # rules.py imports this module: resolve at call time

    return Hit(*args, **kwargs)


def _us(ns: float) -> float:
    return round(ns / 1e3, 1)


def _time(ns: float) -> str:
    """``13.9 ms`` / ``450 µs``: times in a sentence."""
    return f"{ns / 1e6:.1f} ms" if ns >= 1e6 else f"{ns / 1e3:.0f} µs"


# --- communication by collective type ----------------------------------------------------------


def _collective(types: tuple[str, ...], *, workload: str | None = None) -> Query:
    """Fires when the step waits mostly for one of ``types``; removable: that type's exposed time."""

    def query(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
        dom = ctx.comm.dominant
        if dom is None or dom.type not in types or dom.exposed_ns_per_step <= 0:
            return None
        if workload is not None and (ctx.workload is None or ctx.workload.kind != workload):
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
        return _hit(ctx.share("communication"), removable, evidence, params)

    return query


# --- allocator ---------------------------------------------------------------------------------


def _allocator_disabled(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    m = ctx.memory
    if m.allocator != "disabled":
        return None
    evidence = dict(m.allocator_evidence) | {
        "allocator_us_per_step": _us(m.alloc_call_ns_per_step),
        "gpu_idle_in_allocator_us_per_step": _us(ctx.ns("memory")),
    }
    params = {"calls": m.alloc_calls_per_step, "ms": m.alloc_call_ns_per_step / 1e6}
    return _hit(ctx.share("memory"), ctx.ns("memory"), evidence, params, 0.9)


# --- inference ---------------------------------------------------------------------------------


def _inference_mode(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
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
    return _hit(
        1.0, gain[1] * overhead, evidence, {"grad": grad}, conf, (gain[0] * overhead, gain[2] * overhead)
    )


def _inference_graphs(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
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
    params = {"kernels": w.kernels_per_step, "median_us": w.median_kernel_us, "change": change}
    return _hit(ctx.share("launch"), ctx.ns("launch"), evidence, params)


def _inference_cpu_overhead(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    from .rules import overhead_hit  # rules.py imports this module: resolve at call time

    w = ctx.workload
    if ctx.has_gpu or w is None or not w.inference:
        return None
    return overhead_hit(ctx, lim, 0.5)


def _inference_sync(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    """Reads in an inference loop; a decode loop (the phase the trace shows) reads tokens back."""
    w, s = ctx.workload, ctx.sync
    if w is None or not w.inference or s.calls_per_step <= 0 or element_reads(ctx):
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
    return _hit(ctx.share("sync"), ctx.ns("sync"), evidence, params)


def element_reads(ctx: Context) -> bool:
    """The syncs are a loop reading tensor elements one by one (``sync.element_reads`` fires):
    that card replaces the general sync advice."""
    from .rules import rule  # rules.py imports this module: resolve at call time

    r = rule("sync.element_reads")
    hit = r.query(ctx, r.thresholds)
    return hit is not None and hit.metric >= r.threshold


def _element_reads(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
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
    return _hit(s.dtoh_reads_per_step, ctx.ns("sync"), evidence, params, 0.85)


def _inference_compute(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
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
    return _hit(
        ctx.share("compute"),
        removable,
        evidence,
        {"change": change},
        None,
        (compute * lim["gain_low"], compute * lim["gain_high"]),
    )


RULE_SPECS: list[dict[str, Any]] = [
    {
        "id": "communication.all_to_all",
        "kind": "communication",
        "title": "Balance and overlap the all-to-all (MoE experts, embedding tables)",
        "trigger": "an exposed all-to-all is the collective the step waits for most, > 10% of the step",
        "threshold": 0.10,
        "query": _collective(("all_to_all",)),
        "change": "MoE: balance expert load (auxiliary load-balancing loss or capacity factor; EPLB / redundant "
        "experts when serving) and overlap dispatch/combine with expert compute (DeepEP's async mode, "
        "two-micro-batch overlap); embedding tables (TorchRec): rebalance the sharding plan "
        "(EmbeddingShardingPlanner with the real topology, row-/column-wise for hot tables) and use "
        "TrainPipelineSparseDist so the all-to-all overlaps the dense part; across nodes, hierarchical "
        "all-to-all (NVLink within the node first)",
        "why": "The step waits {exposed} per step in exposed {type} ({libs}); only {hidden_pct:.0f}% of "
        "it runs under compute. Uneven token or id counts per rank make every rank wait for the fullest one.",
        "caveats": (
            "DDP bucket sizes and gradient compression do not touch an all-to-all.",
            "If one rank is a straggler, the others' exposed time is waiting: fix the straggler first.",
        ),
    },
    {
        "id": "communication.fsdp_prefetch",
        "kind": "communication",
        "title": "Prefetch FSDP's all-gathers and shard within the node",
        "trigger": "exposed all-gather/reduce-scatter (FSDP, ZeRO) is the collective the step waits for most, "
        "> 10% of the step",
        "threshold": 0.10,
        "query": _collective(("all_gather", "reduce_scatter")),
        "change": "FSDP(model, forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, "
        "limit_all_gathers=True) with larger wrap units (auto_wrap_policy per transformer block); "
        "sharding_strategy=ShardingStrategy.HYBRID_SHARD (or SHARD_GRAD_OP) keeps the all-gathers on the "
        "node's NVLink; FSDP2: fully_shard(..., reshard_after_forward=False) for the last blocks and "
        "block.set_modules_to_forward_prefetch([next_block])",
        "why": "The step waits {exposed} per step in exposed {type} ({libs}); only {hidden_pct:.0f}% of "
        "it overlaps compute, so parameters arrive after the layer that needs them is ready to run.",
        "caveats": (
            "Prefetching and reshard_after_forward=False hold more parameters in memory.",
            "HYBRID_SHARD replicates the model across nodes: each node must fit one sharded copy.",
        ),
    },
    {
        "id": "communication.pipeline_bubbles",
        "kind": "communication",
        "title": "Shrink the pipeline bubbles",
        "trigger": "exposed send/recv (pipeline parallelism) is the collective the step waits for most, > 10%",
        "threshold": 0.10,
        "query": _collective(("send_recv",)),
        "change": "More micro-batches per step (n_microbatches >= 4 x the number of stages) with an interleaved "
        "schedule (torch.distributed.pipelining.ScheduleInterleaved1F1B or ScheduleInterleavedZeroBubble), "
        "and split the layers so every stage takes the same time",
        "why": "Stages wait {exposed} per step in exposed send/recv for their neighbours: pipeline "
        "bubbles, or a stage slower than the others.",
        "caveats": ("More micro-batches mean smaller ones: keep each large enough to fill the GPU.",),
    },
    {
        "id": "communication.tensor_parallel",
        "kind": "communication",
        "title": "Cheaper tensor-parallel all-reduce for serving",
        "trigger": "inference: exposed all-reduce > 10% of the step",
        "threshold": 0.10,
        "query": _collective(("all_reduce",), workload="inference"),
        "change": "Keep the custom all-reduce on (vLLM: disable_custom_all_reduce=False; SGLang: without "
        "--disable-custom-all-reduce), fuse all-reduce with the following RMSNorm where the server supports "
        "it, and keep tensor parallelism inside one NVLink domain (lower tensor_parallel_size, add data or "
        "pipeline parallelism across nodes)",
        "why": "Each forward waits {exposed} in exposed all-reduce ({libs}): tensor-parallel layers "
        "synchronise twice per transformer block.",
        "caveats": ("Custom all-reduce kernels need peer-to-peer access between the GPUs (NVLink or xGMI).",),
        "workloads": INFERENCE,
    },
    {
        "id": "memory.allocator_disabled",
        "kind": "memory",
        "title": "Turn the caching allocator back on",
        "trigger": "every allocation reaches the driver (>= 50 cudaMalloc/cudaFree per step, or nothing "
        "cached) and the GPU idles in them > 5% of the step",
        "threshold": 0.05,
        "query": _allocator_disabled,
        "change": "Unset PYTORCH_NO_CUDA_MEMORY_CACHING (PYTORCH_NO_HIP_MEMORY_CACHING on ROCm); if it was set "
        "to fight fragmentation, use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead",
        "why": "{calls:.0f} allocator calls per step ({ms:.1f} ms) go to the driver: the caching allocator is "
        "off, so every tensor's allocation and free synchronises the device and the GPU idles "
        "{kind_pct:.0f}% of the step.",
        "caveats": ("Memory debugging tools (compute-sanitizer) need caching off; profile without them.",),
    },
    {
        "id": "inference.inference_mode",
        "kind": "launch",
        "title": "Run inference under torch.inference_mode()",
        "trigger": "inference whose forward ops autograd recorded (they carry a 'Sequence number'); "
        "without such ops, inference with no no_grad/inference_mode context in the trace",
        "threshold": 1.0,
        "query": _inference_mode,
        "thresholds": {
            "overhead_gain_low": 0.05,
            "overhead_gain": 0.15,
            "overhead_gain_high": 0.3,
            "recorded_confidence": 0.85,  # the ops show grad on
            "stack_confidence": 0.75,  # Python frames recorded and none enters no_grad/inference_mode
            "guess_confidence": 0.55,  # nothing shows grad mode
        },
        "change": "with torch.inference_mode(): output = model(batch)  # model.eval() alone still records "
        "autograd state for every op",
        "why": "The trace runs a forward pass with no backward or optimizer, and {grad}: "
        "every op pays for autograd bookkeeping it never uses.",
        "caveats": (
            "Grad mode shows in the matmul-class ops autograd recorded, or in Python frames (with_stack=True); "
            "if torch.no_grad() is already used, inference_mode() saves a little more.",
            "Tensors created under inference_mode cannot be used in autograd later.",
        ),
        "workloads": INFERENCE,
        "basis": "estimate",
    },
    {
        "id": "inference.cuda_graphs",
        "kind": "launch",
        "title": "Launch the forward as one CUDA graph, batch more per forward",
        "trigger": "inference: GPU waiting for the host to launch work > 10% of the step",
        "threshold": 0.10,
        "query": _inference_graphs,
        "change": "{change}",
        "why": "The GPU waits for the host {kind_pct:.0f}% of the step ({kernels:.0f} kernels per forward, "
        "median {median_us:.1f} µs): at small batch every kernel is too short to hide its launch.",
        "caveats": (
            "CUDA graphs need static shapes (pad to bucketed batch sizes and sequence lengths).",
            "A static KV cache preallocates memory for the maximum sequence length.",
        ),
        "workloads": INFERENCE,
    },
    {
        "id": "inference.cpu_overhead",
        "kind": "launch",
        "title": "Fewer, bigger ops per request",
        "trigger": "inference on CPU: framework overhead > 20% of the step",
        "threshold": 0.20,
        "query": _inference_cpu_overhead,
        "thresholds": {"small_median_op_ns": 50_000, "many_ops_per_step": 100},
        "change": "with torch.inference_mode(): out = model(torch.stack(requests))  # batch requests per "
        "forward; and model = torch.compile(model) to fuse the small ops",
        "why": "{kind_pct:.0f}% of each forward is dispatch overhead: {ops:.0f} ops with a median of "
        "{median_us:.1f} µs, too small to amortise their dispatch at this batch size.",
        "caveats": ("Batching adds queueing latency per request; bound it with a maximum wait.",),
        "workloads": INFERENCE,
    },
    {
        "id": "inference.host_sync",
        "kind": "sync",
        "title": "Keep the loop's reads off the host",
        "trigger": "inference: GPU idle after host syncs > 5% of the step",
        "threshold": 0.05,
        "query": _inference_sync,
        "change": "{change}",
        "why": "{calls:.0f} blocking syncs per step ({trigger}) drain the GPU queue; it idles {kind_pct:.0f}% of "
        "the step while the host decides what to launch next.",
        "caveats": ("{caveat}",),
        "workloads": INFERENCE,
    },
    {
        "id": "sync.element_reads",
        "kind": "sync",
        "title": "Reduce on the device, read once",
        "trigger": ">= 100 blocking device-to-host reads of <= 64 bytes per step, GPU idle after them > 5%",
        "threshold": 100,
        "query": _element_reads,
        "thresholds": {"max_read_bytes": 64, "min_sync_share": 0.05},
        "keeps": ("device",),
        "change": "Replace the Python loop over tensor elements ({trigger} per element: .item(), .cpu(), print) "
        "with one vectorized op on the device (e.g. total = x.sum(), counts = (x > 0).sum(), torch.where), "
        "then read the result once: total.item()",
        "why": "{reads:.0f} device-to-host reads of {bytes:.0f} bytes per step each block the host until the "
        "GPU has drained its queue: a Python loop reading a tensor element by element. The GPU idles "
        "{kind_pct:.0f}% of the step between the reads; pinned memory cannot speed up a copy this small.",
        "caveats": (
            "Code that needs each value on the host (printing every element) can read the whole "
            "tensor once with x.tolist() instead.",
        ),
    },
    {
        "id": "inference.low_precision",
        "kind": "compute",
        "title": "Cheaper arithmetic for inference: lower precision, quantization, channels_last",
        "trigger": "inference: compute > 30% of the step",
        "threshold": 0.30,
        "query": _inference_compute,
        "thresholds": {
            "min_fp32_share": 0.05,
            "gain_low": 0.15,
            "gpu_gain": 0.35,
            "cpu_gain": 0.3,
            "gain_high": 0.5,
        },
        "change": "{change}",
        "why": "The forward is busy with arithmetic {kind_pct:.0f}% of the step; inference tolerates lower "
        "precision weights without a loss scale.",
        "caveats": (
            "Check accuracy on a validation set after quantizing.",
            "Dynamic int8 quantization speeds up Linear/LSTM layers on x86/ARM CPUs, not convolutions.",
        ),
        "workloads": INFERENCE,
        "asserts": ("precision gain",),
        "basis": "estimate",
    },
]
