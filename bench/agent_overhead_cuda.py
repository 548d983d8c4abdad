"""Agent overhead on real CUDA training loops, side by side in one process (needs a GPU).

For each loop of ``tests/fixtures/traces/cuda/record.py`` named on the command line (default: the
launch-bound one, where a per-step cost shows most, and the compute-bound FP32 one), rounds alternate
between the bare loop and the loop under ``stepdoctor.profile`` (one 3-step window every 50 steps,
spooled locally). Each step is timed with a device sync; the table gives the median step of each
mode over steps outside capture windows, their ratio, and the whole loop's ratio (windows included).

    PYTHONPATH=agent python3 bench/agent_overhead_cuda.py [--steps 200] [--rounds 3] [CASE ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import stepdoctor

RECORD = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traces" / "cuda" / "record.py"
SKIP, WARMUP, ACTIVE, EVERY = 5, 1, 3, 50


def _loops() -> dict:
    spec = importlib.util.spec_from_file_location("record", RECORD)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


def _steps(step, n: int, prof=None) -> tuple[list[float], float]:
    times = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        step()
        if prof is not None:
            prof.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times, time.perf_counter() - start


def _outside_windows(times: list[float]) -> list[float]:
    """Steps no capture window touches: with ``every``, window k spans the last warmup+active steps
    of [SKIP + k*EVERY, SKIP + (k+1)*EVERY); one step of margin each side (start, export)."""
    first = EVERY - WARMUP - ACTIVE - 1

    def touched(i: int) -> bool:
        k = i - SKIP
        return k >= 0 and (k % EVERY >= first or (k > 0 and k % EVERY == 0))

    return [t for i, t in enumerate(times) if not touched(i)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("cases", nargs="*", default=["launch", "compute_fp32"])
    args = ap.parse_args()
    loops = _loops()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'loop':14s} {'bare ms':>9s} {'agent ms':>9s} {'outside':>8s} {'whole':>7s}")
    for name in args.cases:
        made = loops[name](False)
        step = made[0] if isinstance(made, tuple) else made
        _steps(step, 20)  # warm-up: allocator, cuBLAS handles, autotuning
        bare, agent, bare_total, agent_total = [], [], 0.0, 0.0
        for r in range(args.rounds):
            t, total = _steps(step, args.steps)
            bare += _outside_windows(t)
            bare_total += total
            with (
                tempfile.TemporaryDirectory() as spool,
                stepdoctor.profile(
                    "bench",
                    f"{name}-{r}",
                    spool=spool,
                    skip_first=SKIP,
                    warmup=WARMUP,
                    active=ACTIVE,
                    every=EVERY,
                ) as prof,
            ):
                t, total = _steps(step, args.steps, prof)
            agent += _outside_windows(t)
            agent_total += total
        b, a = statistics.median(bare), statistics.median(agent)
        print(f"{name:14s} {b * 1e3:9.3f} {a * 1e3:9.3f} {a / b:8.3f} {agent_total / bare_total:7.3f}")
        del step, made
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
