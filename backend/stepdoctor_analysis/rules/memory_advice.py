"""Memory advice as data: leaks, fragmentation, and what to do near capacity or after an OOM.

The queries of the memory rules (their records are in ``catalog``), which read
``Context.memory.use`` (``memory_use.MemoryUse``), and the report's memory section. None of them
claims a speedup: each averts an out-of-memory error or a slow death by growth, so their findings
state the memory a change frees and on what basis, never a step-time gain.

Near capacity, the change follows what dominates the memory at the peak (or when the OOM struck):
activations → checkpointing or a smaller micro-batch; optimizer state → 8-bit state or sharding;
parameters → sharding or lower-precision weights; gradients → sharding them; inputs → a smaller
batch; temporaries → fusing or chunking the op that makes them; inference → what an inference
server sizes (batch, KV cache). The memory each change frees is estimated from that category's
bytes, with the basis in the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..analyzers import memory_use
from ..analyzers.memory_use import CategoryBreakdown, MemoryUse
from ..analyzers.workload import Workload
from .record import Context, Hit

GIB = 2**30
MIB = 2**20
CHECKPOINT_FREES = 2 / 3  # of the activations: a block keeps its input and recomputes the rest
EIGHT_BIT_FREES = 0.75  # of the optimizer state: 1 byte per value instead of 4


def gib_text(n: float) -> str:
    """Bytes as GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / MIB:.1f} MiB"


# --- leaks -----------------------------------------------------------------------------------------


def leak(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    steady = [x for x in ctx.memory.use.leaks if x.steady]
    if not steady:
        return None
    worst = max(steady, key=lambda x: x.growth_per_step)
    top = worst.survivors[0] if worst.survivors else None
    evidence: dict[str, Any] = {
        "device": worst.device,
        "growth_mib_per_step": round(worst.growth_per_step / MIB, 2),
        "allocated_mib_at_step_ends": [round(b / MIB, 1) for b in worst.step_end_bytes],
        "surviving_allocations": worst.survivors,
    }
    params = {
        "device": worst.device,
        "growth": gib_text(worst.growth_per_step),
        "steps": len(worst.step_end_bytes),
        "first": gib_text(worst.step_end_bytes[0]),
        "last": gib_text(worst.step_end_bytes[-1]),
        "who": survivor_words(top),
        "change": leak_change(top),
    }
    conf = 0.85 if top is not None else 0.6
    return Hit(worst.growth_per_step / MIB, 0.0, evidence, params, conf)


def survivor_words(top: dict[str, object] | None) -> str:
    if top is None:
        return "the trace does not show which allocations survive (they were made before the profiled steps)"
    where = f" in {top['module']}" if top.get("module") else ""
    return (
        f"what survives each step is allocated by {top['op'] or 'an unnamed op'}{where} in the {top['phase']} "
        f"pass ({gib_text(float(top['bytes_per_step']))} per step)"  # type: ignore[arg-type]
    )


def leak_change(top: dict[str, object] | None) -> str:
    if top is not None and top.get("phase") == "forward":
        return (
            "Keep numbers, not tensors, across steps: losses.append(loss.item()) (or loss.detach()) instead of "
            "losses.append(loss): a kept loss keeps its autograd graph and every activation the graph saved; "
            "and run evaluation under torch.no_grad()"
        )
    return (
        "Find the list, dict or attribute that keeps tensors across steps and store detached copies "
        "(t.detach(), or t.item() for scalars); losses.append(loss) instead of loss.item() is the usual one"
    )


# --- fragmentation ---------------------------------------------------------------------------------


def fragmentation(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    found = [
        f
        for f in ctx.memory.use.fragmentation
        if f.reserved_at_peak - f.peak_allocated >= lim["min_gap_gib"] * GIB
        and (f.capacity <= 0 or f.peak_reserved >= lim["min_reserved_share"] * f.capacity)
    ]
    if not found:
        return None
    f = max(found, key=lambda x: x.gap_share)
    evidence = {
        "device": f.device,
        "peak_allocated_gb": round(f.peak_allocated / GIB, 2),
        "reserved_at_peak_gb": round(f.reserved_at_peak / GIB, 2),
        "peak_reserved_gb": round(f.peak_reserved / GIB, 2),
        "capacity_gb": round(f.capacity / GIB, 2) if f.capacity else None,
        "gap_share_at_peak": f.gap_share,
        "gap_time_share": f.gap_time_share,
        "allocator_retries_per_step": round(
            ctx.memory.steady_frees_per_step - ctx.memory.steady_frees_outside_ops_per_step, 2
        ),
    }
    params = {
        "device": f.device,
        "alloc": gib_text(f.peak_allocated),
        "reserved": gib_text(f.reserved_at_peak),
        "gap": gib_text(f.reserved_at_peak - f.peak_allocated),
        "gap_pct": 100 * f.gap_share,
        "time_pct": 100 * f.gap_time_share,
    }
    return Hit(f.gap_share, 0.0, evidence, params, 0.8)


# --- near capacity / out of memory -----------------------------------------------------------------


def pressure(ctx: Context, lim: Mapping[str, float]) -> Hit | None:
    m = ctx.memory
    worst = m.worst()
    if worst is None and m.out_of_memory == 0:
        return None
    frac = worst.peak_fraction if worst else 0.0
    oom = m.use.out_of_memory[0] if m.use.out_of_memory else None
    at = (oom.by_category if oom else None) or (m.use.peak(worst.device) if worst else None)
    evidence: dict[str, Any] = {
        "device": worst.device if worst else None,
        "peak_allocated_gb": round(worst.peak_allocated / GIB, 2) if worst else None,
        "peak_reserved_gb": round(worst.peak_reserved / GIB, 2) if worst else None,
        "capacity_gb": round(worst.capacity / GIB, 2) if worst else None,
        "out_of_memory_events": m.out_of_memory,
    }
    if at is not None:
        evidence["by_category_gb"] = {k: round(v / GIB, 3) for k, v in at.bytes.items() if v}
        evidence["dominant"] = at.dominant()
    if oom is not None:
        evidence["out_of_memory"] = {
            "device": oom.device,
            "requested_gb": round(oom.requested / GIB, 3),
            "allocated_gb": round(oom.allocated / GIB, 2),
            "reserved_gb": round(oom.reserved / GIB, 2),
        }
    where = (
        f"An allocation of {gib_text(oom.requested)} failed on {oom.device} (out of memory) with "
        f"{gib_text(oom.allocated)} allocated"
        if oom is not None
        else f"Peak memory reaches {100 * frac:.0f}% of {gib_text(worst.capacity)} on {worst.device}: one larger "
        "batch or fragmentation away from OOM"
        if worst is not None
        else "The trace holds an out-of-memory event"
    )
    when = "when the allocation failed" if oom is not None and oom.by_category is not None else "at the peak"
    change, why, caveat = capacity_advice(at, when, ctx.workload)
    params = {"where": where, "change": change, "advice": why, "caveat": caveat}
    metric = 1.0 if m.out_of_memory else frac
    return Hit(metric, 0.0, evidence, params, 0.9)


def capacity_advice(
    at: CategoryBreakdown | None, when: str, workload: Workload | None
) -> tuple[str, str, str]:
    """(change, why, caveat) by the category that dominates ``at`` (module docstring)."""

    def shard(held: float) -> str:
        return f"sharding over N ranks frees (1 - 1/N) of the {gib_text(held)} (each rank keeps 1/N)"

    inference = workload is not None and workload.kind == "inference"
    if at is None or at.dominant() is None:
        return (
            "Wrap large blocks in torch.utils.checkpoint.checkpoint(...) or halve the micro-batch and accumulate "
            "gradients",
            "the trace has no [memory] events to tell what holds the memory (record with profile_memory=True)",
            "Activation checkpointing trades about a third more compute for memory.",
        )
    dom = at.dominant() or ""
    b = at.bytes
    held = (
        f"{dom.replace('_', ' ')} {'holds' if dom in ('optimizer_state', 'persistent') else 'hold'} {gib_text(b[dom])} ({100 * at.share(dom):.0f}%) of the {gib_text(at.allocated)} "
        f"allocated {when}"
    )
    top_op = next((x["op"] for x in at.largest if x.get("category") == dom and x.get("op")), None)
    if inference:
        weights = b.get("parameters", 0) + b.get("persistent", 0)
        batch = b.get("activations", 0) + b.get("temporaries", 0) + b.get("inputs", 0)
        grad = workload.grad_enabled if workload is not None else None
        parts = []
        if grad:
            parts.append(
                "run under torch.inference_mode() (autograd keeps nothing for a backward that never comes)"
            )
        if workload is not None and workload.phase:
            parts.append(
                "size the KV cache to the batch (vLLM: gpu_memory_utilization, max_num_seqs, max_model_len)"
            )
        parts.append("halve the batch" if batch >= weights else "load the weights in bf16 or int8 (torchao)")
        frees = (
            f"halving the batch frees about {gib_text(batch / 2)} (what the batch allocates scales with it)"
            if batch >= weights
            else f"bf16 weights free about {gib_text(weights / 2)} if they are FP32 today, int8 about {gib_text(weights * 3 / 4)}"
        )
        return (
            "; ".join(parts).capitalize(),
            f"{held}: {frees}.",
            "A smaller batch lowers throughput per step; quantized weights need an accuracy check.",
        )
    if dom == "activations":
        inputs = b.get("inputs", 0)
        return (
            "Checkpoint each block: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) in the "
            "forward (Hugging Face: model.gradient_checkpointing_enable()); or halve the micro-batch and "
            "accumulate two micro-batches per optimizer step",
            f"{held}: checkpointing every block frees about {gib_text(b[dom] * CHECKPOINT_FREES)} of them "
            "(a block keeps only its input and recomputes the rest in backward); halving the micro-batch frees "
            f"about {gib_text((b[dom] + inputs) / 2)} (activations and inputs scale with the batch).",
            "Checkpointing costs 20-35% more compute per step; autocast to bf16 halves activations that are FP32 today.",
        )
    if dom == "optimizer_state":
        return (
            "Keep the optimizer state in 8 bits (bitsandbytes.optim.AdamW8bit) or shard it over the data-parallel "
            "ranks (torch.distributed.optim.ZeroRedundancyOptimizer, FSDP, DeepSpeed ZeRO-1)",
            f"{held}: 8-bit state frees about {gib_text(b[dom] * EIGHT_BIT_FREES)} (1 byte per value "
            f"instead of 4); {shard(b[dom])}.",
            "A fused optimizer (fused=True) removes the step's temporaries, not the state; 8-bit state changes "
            "the numerics slightly.",
        )
    if dom in ("parameters", "persistent"):
        what = "the parameters" if dom == "parameters" else "the parameters and optimizer state"
        return (
            f"Shard {what} (FSDP, DeepSpeed ZeRO-3), or keep the weights in bf16 with FP32 master weights "
            "only in the optimizer",
            f"{held}: {shard(b[dom])}; bf16 weights free about {gib_text(b.get('parameters', 0) / 2)} if "
            "they are FP32 today.",
            "Sharding adds an all-gather per layer in forward and backward.",
        )
    if dom == "gradients":
        return (
            "Shard the gradients with the optimizer state (FSDP, DeepSpeed ZeRO-2), or apply the optimizer as "
            "each gradient is ready (register_post_accumulate_grad_hook) so gradients never all coexist",
            f"{held}: {shard(b[dom])}; an optimizer step in backward frees most of them.",
            "Gradient clipping by global norm needs all gradients at once: it does not combine with the step in backward.",
        )
    if dom == "inputs":
        return (
            "Halve the batch and accumulate two micro-batches per optimizer step",
            f"{held}: halving the batch frees about {gib_text(b[dom] / 2)}.",
            "Keep the effective batch (micro-batch x accumulation steps) to keep the optimisation unchanged.",
        )
    op = f" (the largest is made by {top_op})" if top_op else ""
    return (
        "Fuse or chunk the op that makes the largest temporaries: torch.compile fuses elementwise chains "
        "without materialising their intermediates; chunk a large softmax or cross-entropy over the batch",
        f"{held}{op}: fusing or chunking frees up to that much.",
        "Chunking trades a few more kernel launches for memory.",
    )


# Report ------------------------------------------------------------------------------------------


def report_section(use: MemoryUse, origin_ns: int, workload: Workload | None) -> dict[str, object]:
    """The ``metrics.memory`` keys this module owns (``contract.MemorySection``); times in µs from
    ``origin_ns`` (the first step's start, as ``series``). Each out-of-memory event names the change
    that the near-capacity card (``memory.pressure``) gives for what was allocated then."""

    def at_us(ns: int) -> float:
        return round((ns - origin_ns) / 1000.0, 1)

    def categories(c: CategoryBreakdown) -> dict[str, object]:
        return {
            "device": c.device,
            "at_us": at_us(c.at_ns),
            "allocated": c.allocated,
            "reserved": c.reserved,
            "bytes": c.bytes,
            "shares": {k: round(c.share(k), 4) for k in memory_use.CATEGORIES},
            "dominant": c.dominant(),
            "basis": c.basis,
            "largest": c.largest,
        }

    return {
        "by_category": [categories(c) for c in use.at_peak],
        "leak": [dataclasses.asdict(x) for x in use.leaks],
        "fragmentation": [dataclasses.asdict(x) for x in use.fragmentation],
        "out_of_memory_at": [
            {
                "device": o.device,
                "at_us": at_us(o.at_ns),
                "requested": o.requested,
                "allocated": o.allocated,
                "reserved": o.reserved,
                "by_category": categories(o.by_category) if o.by_category else None,
                "rule": "memory.pressure",
                "change": capacity_advice(o.by_category, "when the allocation failed", workload)[0],
            }
            for o in use.out_of_memory
        ],
    }
