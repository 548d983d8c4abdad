"""Tiny real CPU training loops, recorded with torch.profiler, each built to have one bottleneck.

These give labelled traces for the diagnosis tests without a GPU. The input-bound loops calibrate
the loader's delay against the measured compute step, so the label holds on slow, fast and busy
machines alike: loading one batch takes 1.5× a training step, which a single process cannot hide
and four workers (each producing a batch every 1.5 steps, so 2.7 batches per step) can. Two
workers (1.33 per step) were too thin a margin: when forking them was slow (a test session that
had already imported pandas), their late start still showed in the profiled steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

WAIT, WARMUP, ACTIVE = 2, 1, 4
BATCH = 8


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _record(path: Path, steps: Iterator[None]) -> Path:
    """Run ``steps`` (one item per training step) under the profiler and export one trace."""
    return _record_windows(lambda _window: path, steps, repeat=1)[0]


def _record_windows(path_of: Callable[[int], Path], steps: Iterator[None], *, repeat: int) -> list[Path]:
    """``repeat`` capture windows of one process, as the agent's ``repeat=N`` takes them: window
    ``i`` is exported to ``path_of(i)``."""
    schedule = torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=repeat)
    written: list[Path] = []

    def export(prof: torch.profiler.profile) -> None:
        written.append(path_of(len(written)))
        prof.export_chrome_trace(str(written[-1]))

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=schedule,
        profile_memory=True,
        record_shapes=True,
        on_trace_ready=export,
    ) as prof:
        for _ in range((WAIT + WARMUP + ACTIVE) * repeat):
            next(steps)
            prof.step()
    return written


def compute_bound_windows(directory: Path, *, repeat: int = 3) -> list[Path]:
    """One process, ``repeat`` capture windows of the compute-bound loop, named as TensorBoard's
    profiler names them (``{host}_{pid}.{n}.pt.trace.json``): windows of one worker, not ranks."""
    model, opt = _mlp()
    x, y = torch.randn(512, 256), torch.randn(512, 256)

    def steps() -> Iterator[None]:
        while True:
            _train_step(model, opt, x, y)
            yield

    directory.mkdir(parents=True, exist_ok=True)
    return _record_windows(lambda i: directory / f"host_1234.{i + 1}.pt.trace.json", steps(), repeat=repeat)


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample costs ``delay`` seconds (I/O or decoding stand-in) and the batch is 256×256."""

    def __init__(self, delay: float, rows: int = 32) -> None:
        self.delay, self.rows = delay, rows

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.randn(self.rows, 256), torch.randn(self.rows, 256)


def _compute_step_seconds() -> float:
    """The fastest of a few steps: an unloaded machine's speed, so workers never fall behind it."""
    model, opt = _mlp()
    x, y = torch.randn(BATCH * 32, 256), torch.randn(BATCH * 32, 256)
    _train_step(model, opt, x, y)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        _train_step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
    return min(times)


def input_bound(path: Path, *, num_workers: int = 0) -> Path:
    """A loader whose batch costs 1.5 compute steps; ``num_workers=0`` waits for it every step.

    In-process (``num_workers=0``) the delay follows the last measured step, so a machine that
    slows down mid-recording keeps the 1.5 ratio; workers get the calibrated value at fork.
    """
    dataset = SlowDataset(1.5 * _compute_step_seconds() / BATCH)
    kwargs: dict[str, object] = {"num_workers": num_workers}
    if num_workers:
        kwargs |= {"prefetch_factor": 4, "persistent_workers": True}
    loader = DataLoader(dataset, batch_size=BATCH, **kwargs)  # type: ignore[arg-type]
    model, opt = _mlp()

    def steps() -> Iterator[None]:
        for x, y in loader:
            t0 = time.perf_counter()
            _train_step(model, opt, x.flatten(0, 1), y.flatten(0, 1))
            if not num_workers:
                dataset.delay = 1.5 * (time.perf_counter() - t0) / BATCH
            yield

    return _record(path, steps())


def compute_bound(path: Path) -> Path:
    """Big matmuls on data already in memory."""
    model, opt = _mlp()
    x, y = torch.randn(512, 256), torch.randn(512, 256)

    def steps() -> Iterator[None]:
        while True:
            _train_step(model, opt, x, y)
            yield

    return _record(path, steps())


def overhead_bound(path: Path) -> Path:
    """Hundreds of tiny elementwise ops per step: dispatch overhead, not arithmetic."""
    w = torch.randn(16, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1e-3)

    def steps() -> Iterator[None]:
        while True:
            h = w
            for _ in range(150):
                h = torch.tanh(h * 1.001 + 0.01)
            opt.zero_grad(set_to_none=True)
            h.sum().backward()
            opt.step()
            yield

    return _record(path, steps())


def memory_bound(path: Path) -> Path:
    """Large per-step temporaries (allocate, fill, copy, concatenate 32 MB tensors), little math."""
    model, opt = _mlp()
    x, y = torch.randn(8, 256), torch.randn(8, 256)

    def steps() -> Iterator[None]:
        while True:
            buf = torch.zeros(8 << 20)
            dup = buf.clone()
            both = torch.cat([buf, dup])
            del buf, dup, both
            _train_step(model, opt, x, y)
            yield

    return _record(path, steps())


def kept_graph_loop(path: Path, *, keep_graph: bool = True) -> Path:
    """Training steps that also evaluate a held-out batch with autograd on and log that loss.

    ``keep_graph``: the log keeps the loss tensor itself (``history.append(val_loss)``), so each
    step's evaluation graph, with the activations it saved, survives the step: a leak of about
    3 MB per step. Otherwise it keeps ``val_loss.item()`` (the fix) and memory returns to the
    same level at every step's end.
    """
    return _record(path, _kept_graph_steps(keep_graph))


def kept_graph_windows(directory: Path, *, keep_graph: bool = True, repeat: int = 3) -> list[Path]:
    """``kept_graph_loop`` in one process over ``repeat`` capture windows (TensorBoard's file names,
    so they read as windows of one worker): the leak goes on between windows too."""
    directory.mkdir(parents=True, exist_ok=True)
    return _record_windows(
        lambda i: directory / f"host_1234.{i + 1}.pt.trace.json", _kept_graph_steps(keep_graph), repeat=repeat
    )


def _kept_graph_steps(keep_graph: bool) -> Iterator[None]:
    model, opt = _mlp()
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    x_val, y_val = torch.randn(1024, 256), torch.randn(1024, 256)
    history: list[object] = []
    while True:
        _train_step(model, opt, x, y)
        val_loss = torch.nn.functional.mse_loss(model(x_val), y_val)
        history.append(val_loss if keep_graph else val_loss.item())
        yield


def activation_heavy_loop(path: Path) -> Path:
    """A deep, narrow MLP on a large batch: its saved activations (each of 16 tanh outputs, 4096 x 256
    floats: 64 MiB) dwarf its parameters (16 x 256 x 256 floats: 4 MiB), so activations dominate the
    memory at the peak."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(16):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4096, 256), torch.randn(4096, 256)

    def steps() -> Iterator[None]:
        while True:
            _train_step(model, opt, x, y)
            yield

    return _record(path, steps())


def host_memory_loop(spool: Path, *, keep: bool, windows: int = 0) -> None:
    """64 steps under the agent with its step series sampling host memory (RSS) at every step and no
    capture window (``windows``: that many 2-step windows, 20 steps apart); each step makes a 2 MiB
    tensor and, with ``keep``, keeps it (a leak of 2 MiB per step). Run it in a fresh process: one
    that freed memory before reuses it before its RSS grows."""
    import stepdoctor
    from stepdoctor.series import SeriesSettings

    settings = SeriesSettings(memory_every_s=0.0, anomaly_capture=False)
    kept: list[torch.Tensor] = []
    skip_first, repeat = (5, windows) if windows else (10_000, None)
    with stepdoctor.profile(
        "mem",
        "run",
        spool=spool,
        series_settings=settings,
        skip_first=skip_first,
        wait=20,
        warmup=1,
        active=2,
        repeat=repeat,
    ) as prof:
        for _ in range(64):
            t = torch.ones(512 * 1024)  # 2 MiB, written so its pages are resident
            if keep:
                kept.append(t)
            prof.step()


def host_memory_run(spool: Path, *, keep: bool, windows: int = 0) -> Path:
    """``host_memory_loop`` in a fresh process (a process that freed memory earlier reuses it before
    its RSS grows); returns the run's spool folder (its step series, and its traces with ``windows``)."""
    run_fresh(f"host_memory_loop(Path({str(spool)!r}), keep={keep}, windows={windows})")
    return spool / "mem" / "run"


def run_fresh(call: str, *, timeout: float = 300) -> None:
    """Run ``call`` (Python, with this module's names and ``Path`` in scope) in a new process.

    torch adds host memory allocated while a profiler records to a process-wide total that frees made
    after recording never lower: a loop that keeps tensors past its windows would inflate every later
    CPU trace of the same test process (its weights would read as gigabytes of parameters)."""
    tests = str(Path(__file__).parent.parent)
    code = f"import sys; from pathlib import Path; sys.path.insert(0, {tests!r}); from support.cpu_loops import *; {call}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")} | {
        "STEPDOCTOR_RAISE_ERRORS": "1"
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=timeout)


ADAM_MLP_PARAM_BYTES = (256 * 512 + 512 + 512 * 256 + 256) * 4


def adam_agent_loop(spool: Path, *, memory_timeline: bool) -> None:
    """A 256-512-256 MLP trained with Adam on a 256-row batch under the agent: one 3-step window
    (``ADAM_MLP_PARAM_BYTES`` of weights), with or without torch's memory timeline in the trace."""
    import stepdoctor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    with stepdoctor.profile(
        "local",
        "timeline",
        spool=spool,
        memory_timeline=memory_timeline,
        skip_first=2,
        warmup=1,
        active=3,
        flush_timeout=10.0,
        series=False,
    ) as prof:
        for _ in range(8):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            prof.step()


LOOPS: dict[str, Callable[[Path], Path]] = {
    "input": input_bound,
    "input_workers": lambda p: input_bound(p, num_workers=4),
    "compute": compute_bound,
    "launch": overhead_bound,
    "memory": memory_bound,
}
