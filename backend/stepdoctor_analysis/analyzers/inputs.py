"""Input pipeline: time the training loop spends waiting in ``DataLoader.__next__``.

``enumerate(DataLoader)#…__next__`` spans mark the wait on the training thread; with worker
processes that wait is only the part the workers could not prefetch. The iterator class in the
name tells single-process loading (``_SingleProcessDataLoaderIter``: the main thread does all the
loading, i.e. ``num_workers=0``) from worker processes. HTA has no input analysis; TensorBoard
flags DataLoader > 5% of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.arrays import distinct
from ..model.trace import RankTrace, Step
from . import timeline as tl
from .breakdown import dataloader_mask


@dataclass(frozen=True)
class LoaderSettings:
    """What the run metadata says about the DataLoader (all optional)."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    cpu_count: int | None = None
    local_world_size: int | None = None


@dataclass(frozen=True)
class InputStats:
    loader_ns_per_step: float = 0.0
    loader_per_step: list[int] = field(default_factory=list)
    calls_per_step: float = 0.0
    single_process: bool = False
    multi_process: bool = False
    iterators: list[str] = field(default_factory=list)
    max_wait_ns: int = 0
    intervals: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.empty(0, np.int64), np.empty(0, np.int64))
    )


def analyze_inputs(trace: RankTrace, steps: list[Step]) -> InputStats:
    h = trace.host
    if not len(h) or not steps:
        return InputStats()
    mask = dataloader_mask(trace)
    if not mask.any():
        return InputStats()
    starts, ends = tl.step_windows(steps)
    ivs = tl.host_union(trace, mask)
    per = tl.per_step(ivs, starts, ends)
    in_steps = mask & tl.host_in_steps(trace, steps)
    names = sorted({trace.strings[int(i)] for i in distinct(h.name[mask])})
    return InputStats(
        loader_ns_per_step=tl.mean_or_zero(per),
        loader_per_step=[int(x) for x in per],
        calls_per_step=int(np.count_nonzero(in_steps)) / len(steps),
        single_process=any("SingleProcess" in n for n in names),
        multi_process=any("MultiProcessing" in n for n in names),
        iterators=[n.split("#", 1)[-1] for n in names],
        max_wait_ns=int(h.dur[in_steps].max()) if in_steps.any() else 0,
        intervals=ivs,
    )


def loader_settings(metadata: dict[str, Any] | None) -> LoaderSettings:
    """Read loader settings from run metadata; accepts ``dataloader``/``loader`` sub-objects or top-level keys."""
    md = metadata or {}
    sub = md.get("dataloader") or md.get("loader") or {}
    src: dict[str, Any] = {**md, **sub} if isinstance(sub, dict) else dict(md)

    def _int(key: str) -> int | None:
        v = src.get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def _bool(key: str) -> bool | None:
        v = src.get(key)
        return v if isinstance(v, bool) else None

    return LoaderSettings(
        num_workers=_int("num_workers"),
        pin_memory=_bool("pin_memory"),
        persistent_workers=_bool("persistent_workers"),
        prefetch_factor=_int("prefetch_factor"),
        cpu_count=_int("cpu_available") or _int("cpu_count"),  # the process's CPUs (affinity) first
        local_world_size=_int("local_world_size"),
    )


def suggested_workers(settings: LoaderSettings) -> int:
    """Workers per training process: the CPUs each process may use, less one for the main loop, capped at 8."""
    if settings.cpu_count:
        per_proc = settings.cpu_count // max(1, settings.local_world_size or 1)
        guess = max(1, min(8, per_proc - 1))
    else:
        guess = 4
    if settings.num_workers:  # already using workers: double them, within the same cap
        guess = max(guess, min(2 * settings.num_workers, 16))
    return guess
