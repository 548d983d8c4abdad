"""Every rule, as it runs: one keyword ``Rule(...)`` record each; ``RULES`` per trace (in
ranking-tie order), ``JOB_RULES`` per job.

A record holds its query, thresholds and scope (``workloads``, ``collectives``, ``allocator``,
``yields_to``; applied by ``record.Rule.evaluate`` and ``record.fire``), so the record read here is
the one that runs; nothing rewrites it. Adding a rule is appending one record (its query in
``bottlenecks``, ``beyond_ddp`` or ``memory_advice``) and running ``make docs`` (docs/rules.md).
"""

from __future__ import annotations

from .. import STRAGGLER_ID
from ..analyzers.memory_use import LEAK_MIN_MIB_PER_STEP
from .beyond_ddp import (
    allocator_disabled,
    element_reads,
    exposed_collective,
    inference_compute,
    inference_cpu_overhead,
    inference_graphs,
    inference_mode,
    inference_sync,
    per_job,
)
from .bottlenecks import (
    anti_pattern,
    cpu_overhead,
    cpu_temporaries,
    exposed_comm,
    exposed_copies,
    fp32_compute,
    gpu_launch,
    host_syncs,
    layout_transforms,
    loader_wait,
    no_cheap_compute_win,
    pageable_copies,
    simt_fp32,
    single_tensor_optimizer,
    small_matmuls,
    steady_allocator,
    sync_copies,
)
from .memory_advice import fragmentation, leak, pressure
from .record import Rule

TRAINING = ("training",)  # advice that needs a backward pass and an optimizer: never given to
# inference, nor to a trace whose workload is unknown (``workload.fits``)
INFERENCE = ("inference",)

# A launch-bound step's waits grow under the profiler, which records every op: its bound overstates.
PROFILER_OVERHEAD = (
    "The profiler adds its own cost to every op it records (more with record_shapes and "
    "profile_memory), so a launch-bound step runs slower profiled and this bound overstates the "
    "gain: time the loop without the profiler before and after."
)
RULES: list[Rule] = [
    Rule(
        id="input.dataloader_workers",
        kind="input",
        title="Feed the step faster: more DataLoader workers",
        trigger="DataLoader wait > 5% of the step (TensorBoard's threshold)",
        threshold=0.05,
        query=loader_wait,
        keeps=("device",),
        change="{change}",
        why="The training loop waits {kind_pct:.0f}% of each step in DataLoader.__next__: {cause}.",
        caveats=(
            "Each worker holds a copy of the dataset object; watch host RAM.",
            "Workers compete with the main process for CPU cores.",
        ),
    ),
    Rule(
        id="transfer.pinned_memory",
        kind="transfer",
        title="Copy from pinned memory, asynchronously",
        trigger="any pageable host↔device copy of ≥ 64 KB while copies are exposed ≥ 1% of the step",
        threshold=0.01,
        query=pageable_copies,
        thresholds={"pinned_over_pageable": 2.0},
        change="DataLoader(..., pin_memory=True) and batch = batch.to(device, non_blocking=True)",
        why="Copies from pageable host memory are staged through a bounce buffer, block the host and run at "
        "{gbps:.1f} GB/s; exposed copies take {kind_pct:.0f}% of the step.{blocks} Estimate: pinned at "
        "{pinned_gbps:.0f} GB/s ({source}), from no overlap to full overlap with the rest of the step.",
        caveats=(
            "Pinned memory is page-locked host RAM; pinning very large buffers can starve the OS.",
            "{pin_thread}",  # batches from worker processes: the loader's pin thread copies them again
        ),
        basis="estimate",
    ),
    Rule(
        id="transfer.overlap_copies",
        kind="transfer",
        title="Overlap copies with compute",
        trigger="copies not overlapped by kernels > 10% of the step",
        threshold=0.10,
        query=exposed_copies,
        keeps=("host", "kernels", "copies"),
        change="Prefetch the next batch to the GPU on a side stream (torch.cuda.Stream) with non_blocking=True copies",
        why="Copies run while no kernel runs for {kind_pct:.0f}% of the step.",
        caveats=("Overlap needs pinned memory and enough memory for two batches on the device.",),
    ),
    Rule(
        id="transfer.sync_memcpy",
        kind="transfer",
        title="Replace synchronous cudaMemcpy",
        trigger="any synchronous cudaMemcpy in the step (Nsight's rule)",
        threshold=1.0,
        query=sync_copies,
        keeps=("host", "device"),
        change="Use tensor.to(device, non_blocking=True) from pinned memory instead of blocking copies",
        why="Synchronous memcpy blocks the host on every call.",
        caveats=("Small HtoD copies (<= 64 KB) of scalars are cheap; look at the largest first.",),
    ),
    Rule(
        id="sync.host_sync",
        kind="sync",
        title="Stop synchronizing with the GPU inside the step",
        trigger="GPU idle after host syncs > 5% of the step",
        threshold=0.05,
        query=host_syncs,
        workloads=TRAINING,  # its advice (accumulate the loss on the device) is a training loop's
        yields_to=("sync.element_reads",),  # a per-element loop: its own card
        keeps=("host", "device"),
        change="Remove per-step {trigger} calls (.item(), .cpu(), print(loss)): accumulate on the device, e.g. "
        "running_loss += loss.detach(), and read it every N steps",
        why="{calls:.0f} blocking syncs per step (mostly {trigger}) drain the GPU queue; the GPU then idles {kind_pct:.0f}% "
        "of the step while the host relaunches work.",
        caveats=(
            "Data-dependent control flow (early stopping, NaN checks) needs some syncs; do them every N steps.",
        ),
    ),
    Rule(
        id="launch.cuda_graphs",
        kind="launch",
        title="Cut kernel-launch overhead with CUDA graphs",
        trigger="GPU waiting for the host to launch work > 10% of the step",
        threshold=0.10,
        query=gpu_launch,
        workloads=TRAINING,  # inference gets inference.cuda_graphs (static KV cache, batching)
        keeps=("device",),
        change='model = torch.compile(model, mode="reduce-overhead")  # captures CUDA graphs; or a larger batch per step',
        why="The GPU waits for the host to issue work {kind_pct:.0f}% of the step ({kernels:.0f} kernels per step, "
        "median {median_us:.1f} µs each): launching them costs more than running them.",
        caveats=(
            "CUDA graphs need static shapes and no host syncs inside the captured region.",
            "Compilation takes time on the first steps.",
            PROFILER_OVERHEAD,
        ),
    ),
    Rule(
        id="launch.cpu_overhead",
        kind="launch",
        title="Run fewer, bigger ops",
        trigger="framework overhead (small ops and the glue between them) > 20% of the step",
        threshold=0.20,
        query=cpu_overhead,
        workloads=TRAINING,  # inference gets inference.cpu_overhead (inference_mode, batching)
        thresholds={"small_median_op_ns": 50_000, "many_ops_per_step": 100},
        change="model = torch.compile(model)  # fuses small ops; also vectorize Python loops over tensors and use larger batches",
        why="{kind_pct:.0f}% of the step is dispatch overhead: {ops:.0f} ops per step with a median of {median_us:.1f} µs "
        "each, rather than arithmetic.",
        caveats=("torch.compile needs a C++ compiler on CPU and adds compile time to the first steps.",),
    ),
    Rule(
        id="memory.cpu_temporaries",
        kind="memory",
        title="Stop re-allocating large temporaries every step",
        trigger="allocating/filling/copying ops > 15% of the step (CPU)",
        threshold=0.15,
        query=cpu_temporaries,
        thresholds={"large_alloc_mb_per_step": 64},
        change="Allocate buffers once outside the loop and reuse them (out=..., in-place ops such as buf.zero_()); "
        "avoid per-step torch.zeros/clone/cat of large tensors",
        why="{kind_pct:.0f}% of the step is spent allocating, filling or copying memory ({mb:.0f} MB allocated per "
        "step) rather than computing.",
        caveats=("Reused buffers must not be captured by autograd across steps.",),
    ),
    Rule(
        id="memory.allocator_steady_state",
        kind="memory",
        title="Stop cudaMalloc/cudaFree in steady state",
        trigger="any cudaMalloc/cudaFree after the first step",
        threshold=0.01,
        query=steady_allocator,
        allocator=("thrashing", "ok", None),  # memory.allocator_disabled covers "disabled"
        keeps=("device",),
        thresholds={"explicit_free_share": 0.5},
        change="{change}",
        why="The caching allocator keeps calling cudaMalloc/cudaFree after warm-up: {cause}.",
        caveats=("{caveat}",),
    ),
    # Memory use: near capacity, leaks, fragmentation (``memory_advice``); none claims a speedup.
    Rule(
        id="memory.pressure",
        kind="memory",
        title="Memory is nearly full",
        trigger="peak > 90% of device memory, or any out-of-memory event",
        threshold=0.90,
        query=pressure,
        change="{change}",
        why="{where}; {advice}",
        caveats=("{caveat}",),
        claims_speedup=False,
    ),
    Rule(
        id="memory.leak",
        kind="memory",
        title="Memory grows every step",
        trigger="allocated memory at the ends of >= 3 consecutive steps rises every step, by >= 1 MiB per "
        "step on average, no step by less than half the mean rise",
        threshold=LEAK_MIN_MIB_PER_STEP,
        query=leak,
        change="{change}",
        why="Allocated memory on {device} ends each of {steps} steps {growth} higher ({first} to {last}): "
        "{who}. At this rate the run runs out of memory however large the device.",
        caveats=(
            "Growth that levels off (a cache filling, optimizer state created in the first steps) is not a leak: "
            "profile more steps to tell.",
        ),
        claims_speedup=False,
    ),
    Rule(
        id="memory.fragmentation",
        kind="memory",
        title="The allocator's cache is fragmented",
        trigger="at the allocated peak, reserved exceeds allocated by >= 25% of reserved and >= 1 GiB, "
        "with reserved >= 50% of device memory",
        threshold=0.25,
        query=fragmentation,
        thresholds={"min_gap_gib": 1.0, "min_reserved_share": 0.5},
        change="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the first CUDA allocation)",
        why="When allocated memory on {device} peaks at {alloc}, the allocator holds {reserved}: {gap} "
        "({gap_pct:.0f}% of what it reserved) is cached in blocks the requests do not fit, and reserved stays "
        "that far above allocated for {time_pct:.0f}% of the steps' time. Expandable segments grow one "
        "segment instead of caching blocks of fixed sizes.",
        caveats=(
            "It does not help when the gap is memory an earlier, larger phase left cached (evaluation, a "
            "bigger first batch: call torch.cuda.empty_cache() once after it), inside CUDA graphs' private "
            "pools, with the cudaMallocAsync backend, or before PyTorch 2.1 (the option does not exist there).",
        ),
        claims_speedup=False,
    ),
    Rule(
        id="communication.overlap",
        kind="communication",
        title="Hide gradient communication behind compute",
        trigger="exposed collectives > 10% of the step (TensorBoard's threshold)",
        threshold=0.10,
        query=exposed_comm,
        workloads=TRAINING,  # DDP gradient buckets and compression hooks exist only in training
        collectives=("all_reduce", "broadcast", "reduce", "other", None),  # DDP's kind
        thresholds={"no_compute_ratio": 0.1},
        change="DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True, static_graph=True); "
        "with model.no_sync() for gradient-accumulation micro-steps; "
        "or ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)",
        why="Collectives run with no compute to hide them for {kind_pct:.0f}% of the step; overlap can hide at most "
        "the step's compute time.",
        caveats=(
            "If one rank is a straggler, the others' exposed time is waiting, not bandwidth: fix the straggler.",
        ),
    ),
    Rule(
        id="compute.mixed_precision",
        kind="compute",
        title="Make the compute itself cheaper: mixed precision",
        trigger="compute > 30% of the step with FP32 matmul/conv/attention kernels >= 5% of it, on a device with "
        "faster reduced-precision units",
        threshold=0.30,
        query=fp32_compute,
        workloads=TRAINING,  # its autocast-around-the-loss change is a training step's
        thresholds={
            "min_fp32_share": 0.05,
            "fp32_gain_low": 0.4,
            "fp32_gain": 0.6,
            "fp32_gain_high": 0.8,
            "tf32_gain_low": 0.2,
            "tf32_gain": 0.35,
            "tf32_gain_high": 0.5,
            "cpu_gain_low": 0.1,
            "cpu_gain": 0.3,
            "peak_efficiency_low": 0.5,
            "peak_efficiency_high": 1.2,
        },
        change="{change}",
        why="The device is busy with arithmetic {kind_pct:.0f}% of the step; its {work} work can run in {dtype}.",
        caveats=(
            "Check the loss curve after switching precision.",
            "{hardware}",
        ),
        basis="estimate",
        asserts=("precision gain",),
    ),
    Rule(
        id="compute.no_cheap_win",
        kind="compute",
        title="No cheap compute win: the matmuls already run in reduced precision",
        trigger="compute > 30% of the step with < 5% of it in FP32 matmuls",
        threshold=0.30,
        query=no_cheap_compute_win,
        thresholds={"min_fp32_share": 0.05, "named_dtype_share": 0.05},
        change="",
        why="GEMM/conv/attention kernels already run in {dtypes} ({low_pct:.0f}% of their time in reduced precision): "
        "lower precision has nothing cheap left. Gains must come from doing less work (fused kernels such as "
        "scaled_dot_product_attention, torch.compile) or from the waits around the compute.",
        basis="estimate",
        asserts=("no fp32 matmul", "no precision gain"),
    ),
    Rule(
        id="compute.small_matmuls",
        kind="compute",
        title="FP32 matmuls too small for lower precision to help",
        trigger="FP32 matmuls in kernels under 10 µs take > 5% of the step, longer ones < 5%",
        threshold=0.05,
        query=small_matmuls,
        thresholds={"min_fp32_share": 0.05},
        change="",
        why="{short_pct:.0f}% of the step is FP32 matmul kernels shorter than {bound_us:.0f} µs each: launch "
        "latency and operand loads bound them, not arithmetic, so bf16/TF32 would barely shorten them. "
        "Give each kernel more work instead: a larger batch, or fuse the small layers (torch.compile).",
        basis="estimate",
        asserts=("fp32 matmul", "no precision gain"),
    ),
    Rule(
        id="compute.channels_last",
        kind="compute",
        title="Keep convolution tensors channels-last",
        trigger="NCHW<->NHWC transform kernels > 5% of the step",
        threshold=0.05,
        query=layout_transforms,
        keeps=("host",),
        change="model = model.to(memory_format=torch.channels_last); "
        "batch = batch.to(memory_format=torch.channels_last)  # cuDNN's fast convolution kernels are NHWC",
        why="{kind_pct:.0f}% of the step ({us:.0f} µs) is spent transposing tensors between NCHW and NHWC "
        "around the convolution kernels: the model keeps its activations channels-first while cuDNN runs "
        "channels-last kernels.",
        caveats=(
            "Ops that need contiguous NCHW (some custom ops, view/reshape on channels) copy back: check the "
            "transforms are gone in the next trace.",
        ),
    ),
    Rule(
        id="launch.foreach_optimizer",
        kind="launch",
        title="Use the multi-tensor optimizer",
        trigger="optimizer step runs >= 20 single-tensor update ops and no _foreach_ ops",
        threshold=20,
        query=single_tensor_optimizer,
        workloads=TRAINING,  # an optimizer step exists only in training
        change="{change}",
        why="{optimizer}.step updates each parameter tensor with separate ops.",
        caveats=(),
        basis="estimate",
    ),
    Rule(
        id="memory.zero_grad_set_to_none",
        kind="memory",
        title="Drop gradients instead of zeroing them",
        trigger="zero_grad runs aten::zero_",
        threshold=1.0,
        query=anti_pattern("zero_grad_fill"),
        workloads=TRAINING,  # gradients exist only in training
        change="optimizer.zero_grad(set_to_none=True)",
        why="zero_grad writes zeros into every gradient tensor each step.",
        caveats=("Code that reads .grad before backward must handle None.",),
        basis="estimate",
    ),
    Rule(
        id="compute.tf32",
        kind="compute",
        title="Use tensor cores for FP32 matmuls",
        trigger="FP32 SIMT GEMM kernels on an sm_80+ GPU",
        threshold=1.0,
        query=simt_fp32,
        thresholds={"peak_efficiency_low": 0.5, "peak_efficiency_high": 1.2},
        change='torch.set_float32_matmul_precision("high")  # TF32 tensor cores; or autocast to bf16',
        why="FP32 GEMMs run on CUDA cores although the GPU has tensor cores.",
        caveats=("TF32 keeps FP32 range with a 10-bit mantissa.",),
        basis="estimate",
        asserts=("fp32 matmul", "precision gain"),
    ),
    Rule(
        id="launch.select_loop",
        kind="launch",
        title="Vectorize indexing loops",
        trigger=">= 1000 aten::select/index/slice per step",
        threshold=1000,
        query=anti_pattern("select_loop"),
        change="Replace Python loops over tensor elements with one vectorized op (index_select, gather, masks)",
        why="Thousands of select/index ops per step indicate a Python loop over tensor elements.",
        caveats=(),
        basis="estimate",
    ),
    Rule(
        id="transfer.small_copies",
        kind="transfer",
        title="Batch small host-to-device copies",
        trigger=">= 50 HtoD copies <= 64 KB per step",
        threshold=50,
        query=anti_pattern("small_htod_copies"),
        change="Create tensors directly on the device (torch.zeros(..., device=device)) or stack them and copy once",
        why="Many tiny HtoD copies each pay the launch and synchronization cost.",
        caveats=(),
        basis="estimate",
    ),
    # Beyond single-node DDP training (``beyond_ddp``): collectives by type, the allocator, inference.
    Rule(
        id="communication.all_to_all",
        kind="communication",
        title="Balance and overlap the all-to-all (MoE experts, embedding tables)",
        trigger="an exposed all-to-all is the collective the step waits for most, > 10% of the step",
        threshold=0.10,
        query=exposed_collective,
        collectives=("all_to_all",),
        change="MoE: balance expert load (auxiliary load-balancing loss or capacity factor; EPLB / redundant "
        "experts when serving) and overlap dispatch/combine with expert compute (DeepEP's async mode, "
        "two-micro-batch overlap); embedding tables (TorchRec): rebalance the sharding plan "
        "(EmbeddingShardingPlanner with the real topology, row-/column-wise for hot tables) and use "
        "TrainPipelineSparseDist so the all-to-all overlaps the dense part; across nodes, hierarchical "
        "all-to-all (NVLink within the node first)",
        why="The step waits {exposed} per step in exposed {type} ({libs}); only {hidden_pct:.0f}% of "
        "it runs under compute. Uneven token or id counts per rank make every rank wait for the fullest one.",
        caveats=(
            "DDP bucket sizes and gradient compression do not touch an all-to-all.",
            "If one rank is a straggler, the others' exposed time is waiting: fix the straggler first.",
        ),
    ),
    Rule(
        id="communication.fsdp_prefetch",
        kind="communication",
        title="Prefetch FSDP's all-gathers and shard within the node",
        trigger="exposed all-gather/reduce-scatter (FSDP, ZeRO) is the collective the step waits for most, "
        "> 10% of the step",
        threshold=0.10,
        query=exposed_collective,
        collectives=("all_gather", "reduce_scatter"),
        change="FSDP(model, forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, "
        "limit_all_gathers=True) with larger wrap units (auto_wrap_policy per transformer block); "
        "sharding_strategy=ShardingStrategy.HYBRID_SHARD (or SHARD_GRAD_OP) keeps the all-gathers on the "
        "node's NVLink; FSDP2: fully_shard(..., reshard_after_forward=False) for the last blocks and "
        "block.set_modules_to_forward_prefetch([next_block])",
        why="The step waits {exposed} per step in exposed {type} ({libs}); only {hidden_pct:.0f}% of "
        "it overlaps compute, so parameters arrive after the layer that needs them is ready to run.",
        caveats=(
            "Prefetching and reshard_after_forward=False hold more parameters in memory.",
            "HYBRID_SHARD replicates the model across nodes: each node must fit one sharded copy.",
        ),
    ),
    Rule(
        id="communication.pipeline_bubbles",
        kind="communication",
        title="Shrink the pipeline bubbles",
        trigger="exposed send/recv (pipeline parallelism) is the collective the step waits for most, > 10%",
        threshold=0.10,
        query=exposed_collective,
        collectives=("send_recv",),
        change="More micro-batches per step (n_microbatches >= 4 x the number of stages) with an interleaved "
        "schedule (torch.distributed.pipelining.ScheduleInterleaved1F1B or ScheduleInterleavedZeroBubble), "
        "and split the layers so every stage takes the same time",
        why="Stages wait {exposed} per step in exposed send/recv for their neighbours: pipeline "
        "bubbles, or a stage slower than the others.",
        caveats=("More micro-batches mean smaller ones: keep each large enough to fill the GPU.",),
    ),
    Rule(
        id="communication.tensor_parallel",
        kind="communication",
        title="Cheaper tensor-parallel all-reduce for serving",
        trigger="inference: exposed all-reduce > 10% of the step",
        threshold=0.10,
        query=exposed_collective,
        collectives=("all_reduce",),
        change="Keep the custom all-reduce on (vLLM: disable_custom_all_reduce=False; SGLang: without "
        "--disable-custom-all-reduce), fuse all-reduce with the following RMSNorm where the server supports "
        "it, and keep tensor parallelism inside one NVLink domain (lower tensor_parallel_size, add data or "
        "pipeline parallelism across nodes)",
        why="Each forward waits {exposed} in exposed all-reduce ({libs}): tensor-parallel layers "
        "synchronise twice per transformer block.",
        caveats=("Custom all-reduce kernels need peer-to-peer access between the GPUs (NVLink or xGMI).",),
        workloads=INFERENCE,
    ),
    Rule(
        id="memory.allocator_disabled",
        kind="memory",
        title="Turn the caching allocator back on",
        trigger="every allocation reaches the driver (>= 50 cudaMalloc/cudaFree per step, or nothing "
        "cached) and the GPU idles in them > 5% of the step",
        threshold=0.05,
        query=allocator_disabled,
        change="Unset PYTORCH_NO_CUDA_MEMORY_CACHING (PYTORCH_NO_HIP_MEMORY_CACHING on ROCm); if it was set "
        "to fight fragmentation, use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead",
        why="{calls:.0f} allocator calls per step ({ms:.1f} ms) go to the driver: the caching allocator is "
        "off, so every tensor's allocation and free synchronises the device and the GPU idles "
        "{kind_pct:.0f}% of the step.",
        caveats=("Memory debugging tools (compute-sanitizer) need caching off; profile without them.",),
    ),
    Rule(
        id="inference.inference_mode",
        kind="launch",
        title="Run inference under torch.inference_mode()",
        trigger="inference whose forward ops autograd recorded (they carry a 'Sequence number'); "
        "without such ops, inference with no no_grad/inference_mode context in the trace",
        threshold=1.0,
        query=inference_mode,
        thresholds={
            "overhead_gain_low": 0.05,
            "overhead_gain": 0.15,
            "overhead_gain_high": 0.3,
            "recorded_confidence": 0.85,  # the ops show grad on
            "stack_confidence": 0.75,  # Python frames recorded and none enters no_grad/inference_mode
            "guess_confidence": 0.55,  # nothing shows grad mode
        },
        change="with torch.inference_mode(): output = model(batch)  # model.eval() alone still records "
        "autograd state for every op",
        why="The trace runs a forward pass with no backward or optimizer, and {grad}: "
        "every op pays for autograd bookkeeping it never uses.",
        caveats=(
            "Grad mode shows in the matmul-class ops autograd recorded, or in Python frames (with_stack=True); "
            "if torch.no_grad() is already used, inference_mode() saves a little more.",
            "Tensors created under inference_mode cannot be used in autograd later.",
        ),
        workloads=INFERENCE,
        basis="estimate",
    ),
    Rule(
        id="inference.cuda_graphs",
        kind="launch",
        title="Launch the forward as one CUDA graph, batch more per forward",
        trigger="inference: GPU waiting for the host to launch work > 10% of the step",
        threshold=0.10,
        query=inference_graphs,
        change="{change}",
        why="The GPU waits for the host {kind_pct:.0f}% of the step ({kernels:.0f} kernels per forward, "
        "median {median_us:.1f} µs): at small batch every kernel is too short to hide its launch.",
        caveats=(
            "CUDA graphs need static shapes (pad to bucketed batch sizes and sequence lengths).",
            "{kv_cache}",  # decode only: a trace that shows no decode has no KV cache to speak of
            PROFILER_OVERHEAD,
        ),
        workloads=INFERENCE,
    ),
    Rule(
        id="inference.cpu_overhead",
        kind="launch",
        title="Fewer, bigger ops per request",
        trigger="inference on CPU: framework overhead > 20% of the step",
        threshold=0.20,
        query=inference_cpu_overhead,
        thresholds={"small_median_op_ns": 50_000, "many_ops_per_step": 100},
        change="with torch.inference_mode(): out = model(torch.stack(requests))  # batch requests per "
        "forward; and model = torch.compile(model) to fuse the small ops",
        why="{kind_pct:.0f}% of each forward is dispatch overhead: {ops:.0f} ops with a median of "
        "{median_us:.1f} µs, too small to amortise their dispatch at this batch size.",
        caveats=("Batching adds queueing latency per request; bound it with a maximum wait.",),
        workloads=INFERENCE,
    ),
    Rule(
        id="inference.host_sync",
        kind="sync",
        title="Keep the loop's reads off the host",
        trigger="inference: GPU idle after host syncs > 5% of the step",
        threshold=0.05,
        query=inference_sync,
        yields_to=("sync.element_reads",),  # a per-element loop: its own card
        change="{change}",
        why="{calls:.0f} blocking syncs per step ({trigger}) drain the GPU queue; it idles {kind_pct:.0f}% of "
        "the step while the host decides what to launch next.",
        caveats=("{caveat}",),
        workloads=INFERENCE,
    ),
    Rule(
        id="sync.element_reads",
        kind="sync",
        title="Reduce on the device, read once",
        trigger=">= 100 blocking device-to-host reads of <= 64 bytes per step, GPU idle after them > 5%",
        threshold=100,
        query=element_reads,
        thresholds={"max_read_bytes": 64, "min_sync_share": 0.05},
        keeps=("device",),
        change="Replace the Python loop over tensor elements ({trigger} per element: .item(), .cpu(), print) "
        "with one vectorized op on the device (e.g. total = x.sum(), counts = (x > 0).sum(), torch.where), "
        "then read the result once: total.item()",
        why="{reads:.0f} device-to-host reads of {bytes:.0f} bytes per step each block the host until the "
        "GPU has drained its queue: a Python loop reading a tensor element by element. The GPU idles "
        "{kind_pct:.0f}% of the step between the reads; pinned memory cannot speed up a copy this small.",
        caveats=(
            "Code that needs each value on the host (printing every element) can read the whole "
            "tensor once with x.tolist() instead.",
        ),
    ),
    Rule(
        id="inference.low_precision",
        kind="compute",
        title="Cheaper arithmetic for inference: lower precision, quantization, channels_last",
        trigger="inference: compute > 30% of the step",
        threshold=0.30,
        query=inference_compute,
        thresholds={
            "min_fp32_share": 0.05,
            "gain_low": 0.15,
            "gpu_gain": 0.35,
            "cpu_gain": 0.3,
            "gain_high": 0.5,
        },
        change="{change}",
        why="The forward is busy with arithmetic {kind_pct:.0f}% of the step; inference tolerates lower "
        "precision weights without a loss scale.",
        caveats=(
            "Check accuracy on a validation set after quantizing.",
            "Dynamic int8 quantization speeds up Linear/LSTM layers on x86/ARM CPUs, not convolutions.",
        ),
        workloads=INFERENCE,
        asserts=("precision gain",),
        basis="estimate",
    ),
]

# Cards decided per job, over its ranks, not on one trace: the straggler card
# (``ranks.straggler_advice``, which reads its threshold here). Documented like any other rule.
JOB_RULES: list[Rule] = [
    Rule(
        id=STRAGGLER_ID,
        kind="communication",
        title="Even out the ranks: one rank holds the others back",
        trigger="a rank's busy time before its collectives exceeds the other ranks' median by > 10% of it (per job)",
        threshold=0.10,  # the slack HTA and gpuprof use
        query=per_job,
        change="by the straggler's cause: balance its work, feed it faster, free its host CPU, or drop its own syncs",
        why="{rank} works longer before its collectives than the others; every other rank waits for it.",
        caveats=("DDP bucket sizes or compression do not help while the others are waiting, not sending.",),
    ),
]
