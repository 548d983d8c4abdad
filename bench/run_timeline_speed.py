"""How long the run timeline takes on a long run: 10 million steps in 1,000 agent-sized chunks.

Builds the chunks with the agent's own encoder (10,000 steps each, 1% of steps profiled, a few
slow steps), then times ``run_timeline`` (validate every chunk, assemble, statistics, anomalies at
full resolution, a 1,000-point curve) and ``compare`` on the result. Prints seconds and bytes.

    .venv/bin/python bench/run_timeline_speed.py [--steps 10000000]
"""

from __future__ import annotations

import argparse
import array
import resource
import time

import numpy as np

from stepdoctor.series import encode_chunk
from stepdoctor_analysis.run.timeline import Side, compare, run_timeline

CHUNK = 10_000


def chunks(steps: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for seq, first in enumerate(range(0, steps, CHUNK)):
        n = min(CHUNK, steps - first)
        wall = rng.normal(20e6, 1e6, n).clip(1e6).astype(np.int64)
        wall[rng.integers(0, n, 3)] = 80_000_000
        header = {
            "format": 1,
            "kind": "stepdoctor.series",
            "stream": "bench",
            "seq": seq,
            "rank": 0,
            "first_step": first,
            "count": n,
            "t_end": time.time(),
            "final": first + n == steps,
            "anomaly": {"k": 1.5, "window": 50, "warmup": 50, "min_ms": 1.0},
            "profiled": [[first + 100, first + 199]],
            "windows": [{"first_step": first + 102, "last_step": first + 199, "reason": "schedule"}],
            "anomalies": [],
        }
        mem = array.array("q", [first])
        cols = [
            ("wall_ns", array.array("q", wall.tobytes())),
            ("data_ns", array.array("q", np.full(n, 1000, dtype=np.int64).tobytes())),
            ("mem_step", mem),
            ("mem_kind", array.array("q", [0])),
            ("mem_a", array.array("q", [1 << 30])),
            ("mem_b", array.array("q", [-1])),
        ]
        out.append(encode_chunk(header, cols))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000_000)
    args = ap.parse_args()
    data = chunks(args.steps)
    size = sum(len(c) for c in data)
    start = time.perf_counter()
    timeline = run_timeline(data)
    took = time.perf_counter() - start
    side = Side("run", unprofiled_median_ms=timeline.unprofiled_median_ms)
    compare(side, side)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{timeline.steps:,} steps in {len(data):,} chunks ({size / 1e6:.1f} MB stored, "
        f"{size / timeline.steps:.1f} B/step): run_timeline {took:.2f} s, peak RSS {peak:.0f} MiB; "
        f"{len(timeline.display.step)} display points, {timeline.anomaly_steps} anomalous steps, "
        f"{len(timeline.windows)} windows"
    )


if __name__ == "__main__":
    main()
