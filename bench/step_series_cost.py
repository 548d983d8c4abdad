"""What ``prof.step()`` costs outside capture windows, with the step series on and off.

Alternating rounds in one process (so background load hits every mode alike), each a tight loop of
``--calls`` calls with no work between them, far from any window (``skip_first`` is huge):

  bare     a method call that does nothing (the floor of any ``prof.step()``)
  off      stepdoctor with the series off (``series=False``): the step counter compare
  on       stepdoctor with the series on (the default): wall time, data wait, limit checks;
           memory samples, median blocks and chunk hand-offs amortised over the calls

The figure for the README is ``on - off`` (what timing every step adds) and ``on - bare``
(what ``prof.step()`` costs in all). Also times the DataLoader ``__next__`` wrapper per batch.

    .venv/bin/python bench/step_series_cost.py [--calls 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import stepdoctor


class Bare:
    def step(self) -> None:
        pass


def per_call_ns(prof: Any, calls: int) -> tuple[float, float]:
    """(wall ns, thread CPU ns) per call: CPU time leaves out the waits of a busy machine."""
    step = prof.step
    start, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(calls):
        step()
    return (time.perf_counter_ns() - start) / calls, (time.thread_time_ns() - cpu) / calls


def loader_ns(calls: int, timed: bool, spool: str) -> float:
    data = torch.utils.data.TensorDataset(torch.zeros(calls, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    prof = stepdoctor.profile("bench", "loader", spool=spool, skip_first=10**9, series=True)
    with prof:
        if timed:
            prof.watch(loader)
        start = time.perf_counter_ns()
        for _ in loader:
            pass
        took = time.perf_counter_ns() - start
    return took / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"bare": [], "off": [], "on": []}
    with tempfile.TemporaryDirectory() as spool:
        for _ in range(args.rounds):
            for mode in results:
                if mode == "bare":
                    results[mode].append(per_call_ns(Bare(), args.calls))
                    continue
                prof = stepdoctor.profile(
                    "bench", mode, spool=spool, skip_first=10**9, series=mode == "on", anomaly_capture=False
                )
                with prof:
                    results[mode].append(per_call_ns(prof, args.calls))
        loaders: dict[str, list[float]] = {"untimed": [], "timed": []}
        for _ in range(3):
            for mode in loaders:
                loaders[mode].append(loader_ns(20_000, mode == "timed", spool))
    med = {mode: statistics.median(w for w, _ in v) for mode, v in results.items()}
    cpu = {mode: statistics.median(c for _, c in v) for mode, v in results.items()}
    print(
        f"torch {torch.__version__}; {args.rounds} alternating rounds of {args.calls} calls; median ns per call"
    )
    for mode, value in med.items():
        walls = [w for w, _ in results[mode]]
        print(
            f"  {mode:<5} {value:7.0f} ns wall ({min(walls):.0f}-{max(walls):.0f}), {cpu[mode]:7.0f} ns CPU"
        )
    print(
        f"  series cost (on - off): {med['on'] - med['off']:.0f} ns wall, {cpu['on'] - cpu['off']:.0f} ns CPU per step"
    )
    print(
        f"  prof.step() outside windows (on - bare): {med['on'] - med['bare']:.0f} ns wall, "
        f"{cpu['on'] - cpu['bare']:.0f} ns CPU per step"
    )
    lm = {mode: statistics.median(v) for mode, v in loaders.items()}
    print(
        f"  DataLoader batch (batch_size=1, no workers): {lm['untimed']:.0f} ns untimed, {lm['timed']:.0f} ns timed "
        f"(+{lm['timed'] - lm['untimed']:.0f} ns per batch)"
    )


if __name__ == "__main__":
    main()
