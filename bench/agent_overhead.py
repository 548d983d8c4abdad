"""Agent overhead on a CPU training loop, measured side by side in one process.

Modes, interleaved round by round so background load hits them alike:
  none     no profiler
  plain    torch.profiler on the same schedule, exporting with tensorboard_trace_handler
  live     stepdoctor uploading to a live server (tests/support/fake_server.py on 127.0.0.1)
  dead     stepdoctor with the server down (connection refused)
  hang     stepdoctor with a server that accepts connections and never answers

Prints median step-time ratios (all steps, and steps outside capture windows), the whole-loop
ratio agent/plain, and the longest time any prof.step() took on the training thread, split into
steps that export a window (torch's own work) and all others.

    .venv/bin/python bench/agent_overhead.py [--steps 150] [--rounds 3] [--every 50]
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import stepdoctor

SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"
sys.path.insert(0, str(SUPPORT.parent))
from support.fake_server import TOKEN, free_port  # noqa: E402

WARMUP, ACTIVE, SKIP = 2, 3, 5


@dataclass
class Sample:
    step_s: list[float] = field(default_factory=list)  # wall time per step, step() included
    cpu_s: list[float] = field(default_factory=list)  # training-thread CPU time per step (load-immune)
    call_s: list[float] = field(default_factory=list)  # time inside prof.step()
    loop_s: float = 0.0
    loop_cpu_s: float = 0.0  # whole-process CPU over the loop and the exit flush (background work included)
    delivered: int = 0


class NoProfiler:
    def step(self) -> None:
        pass


def workload(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )  # fmt: skip
    batches = [torch.randn(64, width) for _ in range(8)]
    return model, torch.optim.SGD(model.parameters(), lr=0.01), batches


def loop(prof: Any, steps: int, width: int) -> Sample:
    model, opt, batches = workload(width)
    sample = Sample()
    begin = last = time.perf_counter()
    last_cpu = time.thread_time()
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        model(batches[i % len(batches)]).square().mean().backward()
        opt.step()
        before = time.perf_counter()
        prof.step()
        now = time.perf_counter()
        sample.call_s.append(now - before)
        cpu = time.thread_time()
        sample.step_s.append(now - last)
        sample.cpu_s.append(cpu - last_cpu)
        last, last_cpu = now, cpu
    sample.loop_s = time.perf_counter() - begin
    return sample


def in_window(step: int, every: int) -> bool:
    """True for steps that warm up, record or export (the step ending a window runs the export), and
    the step right after (it starts the next cycle's bookkeeping)."""
    if step < SKIP:
        return False
    phase = (step - SKIP) % every
    wait = every - WARMUP - ACTIVE
    return phase >= wait - 1 or phase == 0


def run_mode(mode: str, steps: int, every: int, width: int, servers: dict[str, str], spool: Path) -> Sample:
    cpu = time.process_time()
    sample = _run_mode(mode, steps, every, width, servers, spool)
    sample.loop_cpu_s = time.process_time() - cpu
    return sample


def _run_mode(mode: str, steps: int, every: int, width: int, servers: dict[str, str], spool: Path) -> Sample:
    if mode == "none":
        return loop(NoProfiler(), steps, width)
    schedule = torch.profiler.schedule(
        skip_first=SKIP, wait=every - WARMUP - ACTIVE, warmup=WARMUP, active=ACTIVE
    )
    if mode == "plain":
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(spool / "plain")),
            record_shapes=True,
            profile_memory=True,
        ) as prof:
            return loop(prof, steps, width)
    with stepdoctor.profile(
        "bench",
        mode,
        server=servers[mode],
        token=TOKEN,
        spool=spool / mode,
        skip_first=SKIP,
        warmup=WARMUP,
        active=ACTIVE,
        every=every,
        flush_timeout=5.0 if mode == "live" else 0.5,
        http_timeout=5.0,
    ) as agent:
        sample = loop(agent, steps, width)
    sample.delivered = agent.stats.delivered
    return sample


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=55)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--every", type=int, default=25, help="one capture window every N steps")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (sets the step time)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--modes", default="none,plain,live,dead,hang", help="comma-separated; keep none,plain"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    results: dict[str, list[Sample]] = {m: [] for m in modes}
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)  # accepts into the backlog, never answers
    port = free_port()
    # The live server runs in its own process, as a real one would: its JSON parsing must not
    # compete with the training thread for this process's GIL.
    live = subprocess.Popen(
        [sys.executable, str(SUPPORT / "fake_server.py"), str(port)], stdout=subprocess.PIPE
    )
    assert live.stdout is not None and live.stdout.readline()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            servers = {
                "live": f"http://127.0.0.1:{port}",
                "dead": f"http://127.0.0.1:{free_port()}",
                "hang": f"http://127.0.0.1:{hang.getsockname()[1]}",
            }
            run_mode("none", 20, args.every, args.width, servers, Path(tmp))  # warm caches and allocator
            for rnd in range(args.rounds):
                print(f"round {rnd + 1}/{args.rounds}", flush=True)
                order = modes if rnd % 2 == 0 else modes[::-1]
                for mode in order:
                    sample = run_mode(mode, args.steps, args.every, args.width, servers, Path(tmp) / str(rnd))
                    results[mode].append(sample)
    finally:
        live.terminate()
        live.wait()
    hang.close()
    report(results, args.every)
    return 0


def report(results: dict[str, list[Sample]], every: int) -> None:
    """Ratios are paired per round (each mode against the reference run in the same round, so the
    machine's load drifts cancel), then the median over rounds is printed."""

    def median_step(sample: Sample, outside: bool | None, cpu: bool) -> float:
        values = sample.cpu_s if cpu else sample.step_s
        return statistics.median(
            dt
            for i, dt in enumerate(values)
            if i >= SKIP and (outside is None or in_window(i, every) != outside)
        )

    def paired(mode: str, base: str, outside: bool | None, cpu: bool = False) -> float:
        return statistics.median(
            median_step(a, outside, cpu) / median_step(b, outside, cpu)
            for a, b in zip(results[mode], results[base], strict=True)
        )

    def loop_ratio(mode: str, cpu: bool = False) -> float:
        return statistics.median(
            (a.loop_cpu_s / b.loop_cpu_s) if cpu else (a.loop_s / b.loop_s)
            for a, b in zip(results[mode], results["plain"], strict=True)
        )

    none_median = statistics.median(median_step(s, None, False) for s in results["none"])
    rounds, steps = len(results["none"]), len(results["none"][0].step_s)
    delivered = sum(s.delivered for s in results.get("live", []))
    print(
        f"\n{rounds} rounds x {steps} steps per mode; median step without profiler {none_median * 1000:.2f} ms; "
        f"one window ({WARMUP} warm-up + {ACTIVE} active steps) every {every} steps; live server got {delivered} traces"
    )
    print("Ratios of median step time, wall (training-thread CPU in parentheses):")
    print("  outside/none: steps that neither warm up, record nor export, against no profiler")
    print("  all/plain:    every step, against plain torch.profiler")
    print(
        "  loop/plain:   whole loop wall time (whole-process CPU incl. background gzip/upload and exit flush)"
    )
    print("prof.step() on the training thread: longest in window steps (torch's stop+export) and elsewhere;")
    print("  median outside windows; median of the step that saves a window; total per round")
    print("other CPU: process CPU not spent on the training thread (gzip, upload, setup, exit), per window")
    print(
        f"{'mode':<6} {'outside/none':>17} {'all/plain':>17} {'loop/plain':>17} {'max window':>11} {'max other':>10}"
        f" {'med other':>10} {'med save':>9} {'total':>8} {'other CPU':>9}"
    )
    for mode in results:
        window_calls, other_calls, saves = [0.0], [0.0], []
        for sample in results[mode]:
            for i, dt in enumerate(sample.call_s):
                (window_calls if in_window(i, every) else other_calls).append(dt)
                if i >= SKIP and (i - SKIP) % every == every - 1:
                    saves.append(dt)
        total = statistics.median(sum(sample.call_s) for sample in results[mode])
        windows = max(
            1,
            sum(
                1
                for i in range(len(results[mode][0].call_s))
                if i >= SKIP and (i - SKIP) % every == every - 1
            ),
        )
        background = statistics.median(
            max(0.0, sample.loop_cpu_s - sum(sample.cpu_s)) / windows for sample in results[mode]
        )
        cols = [
            f"{paired(mode, 'none', True):.4f} ({paired(mode, 'none', True, True):.4f})",
            f"{paired(mode, 'plain', None):.4f} ({paired(mode, 'plain', None, True):.4f})",
            f"{loop_ratio(mode):.4f} ({loop_ratio(mode, True):.4f})",
        ]
        print(
            f"{mode:<6} {cols[0]:>17} {cols[1]:>17} {cols[2]:>17} {max(window_calls) * 1e3:>8.1f} ms"
            f" {max(other_calls) * 1e3:>7.2f} ms {statistics.median(other_calls) * 1e6:>7.1f} us"
            f" {statistics.median(saves or [0.0]) * 1e3:>6.1f} ms {total * 1e3:>5.1f} ms {background * 1e3:>6.1f} ms"
        )


if __name__ == "__main__":
    raise SystemExit(main())
