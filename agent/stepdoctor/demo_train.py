"""A short CPU training loop instrumented with stepdoctor, for demos and tests.

``python -m stepdoctor.demo_train --run before --workers 0`` is visibly input-bound: each sample
waits ``--sample-ms`` (storage latency) and burns ``--cpu-ms`` (decoding) in ``__getitem__``, which
the training thread pays itself; ``--workers 2`` moves that to DataLoader worker processes that
load the next batches while the model trains, so the same model trains faster.
Run both to get a before/after pair. Server, token, project and spool come from the usual
``STEPDOCTOR_*`` variables or the flags below.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stepdoctor
from stepdoctor.cli import configure_logging


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic images whose loading is slow like real reading + decoding: ``io_ms`` of waiting
    (storage latency, a sleep) and ``cpu_ms`` of busy work (decode, augment) per sample."""

    def __init__(
        self, size: int, io_ms: float, cpu_ms: float = 0.2, features: int = 3 * 16 * 16, classes: int = 10
    ) -> None:
        self.size, self.features, self.classes = size, features, classes
        self.io_s, self.cpu_s = io_ms / 1000.0, cpu_ms / 1000.0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.io_s:
            time.sleep(self.io_s)
        deadline = time.perf_counter() + self.cpu_s
        checksum = index
        while time.perf_counter() < deadline:  # plain Python "decoding": CPU time, no profiler events
            checksum = (checksum * 1103515245 + 12345) & 0x7FFFFFFF
        generator = torch.Generator().manual_seed(index)
        return torch.rand(self.features, generator=generator), torch.tensor(checksum % self.classes)


def make_model(features: int = 3 * 16 * 16, hidden: int = 256, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def make_loader(
    workers: int, batch_size: int, steps: int, sample_ms: float, cpu_ms: float = 0.0
) -> DataLoader[Any]:
    dataset = SlowDataset(size=batch_size * steps, io_ms=sample_ms, cpu_ms=cpu_ms)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=False,
        prefetch_factor=2 if workers else None,
        persistent_workers=False,
    )


def train(prof: Any, loader: DataLoader[Any], model: nn.Module) -> list[float]:
    """One pass over ``loader``; returns each step's wall time in seconds (data wait included)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    times: list[float] = []
    last = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        prof.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stepdoctor.demo_train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run", required=True, help="run name, e.g. workers0")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sample-ms", type=float, default=1.0, help="storage latency per sample (a sleep)")
    parser.add_argument("--cpu-ms", type=float, default=0.1, help="CPU work per sample (decode, augment)")
    parser.add_argument("--project", default=None, help="default: $STEPDOCTOR_PROJECT or 'demo'")
    parser.add_argument("--server", default=None)
    parser.add_argument("--token", default=None)
    parser.add_argument("--spool", default=None)
    parser.add_argument("--skip-first", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--active", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2, help="capture windows (0: until the end)")
    parser.add_argument("--every", type=int, default=None)
    parser.add_argument("--flush-timeout", type=float, default=None)
    parser.add_argument("--http-timeout", type=float, default=30.0)
    parser.add_argument("--backoff-base", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--hidden", type=int, default=1536, help="MLP width: the compute per step")
    parser.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(bare=True)
    torch.manual_seed(0)
    # The model is tiny: one intra-op thread keeps OpenMP spin-waits from starving the data loading
    # on small machines, so the before/after difference is the DataLoader's, not the scheduler's.
    torch.set_num_threads(args.threads)
    loader = make_loader(args.workers, args.batch_size, args.steps, args.sample_ms, args.cpu_ms)
    tags = dict(tag.split("=", 1) for tag in args.tag if "=" in tag)
    tags.setdefault("demo", "workers")
    with stepdoctor.profile(
        project=args.project or os.environ.get("STEPDOCTOR_PROJECT") or "demo",
        run=args.run,
        server=args.server,
        token=args.token,
        spool=args.spool,
        loader=loader,
        tags=tags,
        skip_first=args.skip_first,
        warmup=args.warmup,
        active=args.active,
        repeat=args.repeat,
        every=args.every,
        flush_timeout=args.flush_timeout,
        http_timeout=args.http_timeout,
        backoff_base=args.backoff_base,
    ) as prof:
        times = train(prof, loader, make_model(hidden=args.hidden))
    # No step time of our own here: the analysis of the profiled steps gives the one figure the
    # demo and the dashboard show (a wall-clock mean over every step would be a second, different one).
    print(f"demo_train: run={args.run} workers={args.workers} steps={len(times)} done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
