"""Real CPU training loops run under ``stepdoctor.profile`` for the step-series tests.

Each step is a small matmul plus a sleep, so its length is set by the sleep (steady on a busy
machine) and a slowdown can be injected at chosen steps.
"""

from __future__ import annotations

import time
from collections.abc import Container
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import stepdoctor


class SlowSamples(Dataset[torch.Tensor]):
    """Each sample takes ``sample_s`` to load: a data wait the series must see."""

    def __init__(self, n: int, sample_s: float) -> None:
        self.n, self.sample_s = n, sample_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.sample_s:
            time.sleep(self.sample_s)
        return torch.full((16,), float(i))


def run_loop(
    spool: Path,
    run: str,
    steps: int,
    *,
    step_s: float = 0.005,
    slow: Container[int] = (),
    slow_s: float = 0.2,
    sample_s: float = 0.0,
    batch_size: int = 2,
    **profile_kwargs: Any,
) -> Any:
    """Train ``steps`` steps; steps in ``slow`` sleep ``slow_s`` instead of ``step_s``. Returns the
    (stopped) profile."""
    loader = DataLoader(SlowSamples(steps * batch_size, sample_s), batch_size=batch_size)
    model = torch.nn.Linear(16, 16)
    prof = stepdoctor.profile("proj", run, spool=spool, **profile_kwargs)
    assert prof.watch(loader) is loader
    with prof:
        for i, x in enumerate(loader):
            model(x).sum().backward()
            time.sleep(slow_s if i in slow else step_s)
            prof.step()
    return prof
