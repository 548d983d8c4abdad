"""The diagnosis engine: parse Kineto traces into a columnar model, analyze, classify, recommend.

Pure functions over ``model.RankTrace``; no network, database or plotting here.
Entry point for other layers: ``stepdoctor_analysis.pipeline.analyze_path``.
"""

ENGINE_VERSION = "0.5.0"  # 0.5: memory diagnosis (what holds it, leaks, fragmentation, OOM forensics);
# 0.4: findings never contradict each other or promise nothing (consistency);
# 0.3: gains bounded by what still runs, grad mode read, sure-share verdict;
# 0.2: the verdict is the limiter (#9). Older stored analyses are redone
# Bump when the JSON report changes incompatibly; stored analyses with an older engine are redone.
SCHEMA_VERSION = 1

# The one vocabulary of the product: what bounds a step, and the TensorBoard plugin's step-time
# breakdown categories in its priority order. The server and dashboard import these.
BOTTLENECK_KINDS: tuple[str, ...] = (
    "input",
    "transfer",
    "launch",
    "memory",
    "sync",
    "communication",
    "compute",
)
# The job-level straggler card's id (``ranks.straggler_advice``); here so the guide and the text
# report name its section without importing the rank analysis.
STRAGGLER_ID = "communication.straggler"
BREAKDOWN_CATEGORIES: tuple[str, ...] = (
    "kernel",
    "memcpy",
    "memset",
    "communication",
    "runtime",
    "dataloader",
    "cpu_exec",
    "other",
)
