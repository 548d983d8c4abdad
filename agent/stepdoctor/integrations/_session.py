"""What both framework callbacks share: a profiling session opened at train start, stepped by a
hook, closed at train end (or by the agent's ``atexit`` if training dies first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepdoctor.guard import guarded
from stepdoctor.metadata import LOADER_FIELDS, loader_settings
from stepdoctor.profiler import NoopProfile, Profile, profile


class Session:
    """Holds the arguments of :func:`stepdoctor.profile` until the trainer knows its DataLoader."""

    def __init__(self, project: str | None, run: str | None, options: dict[str, Any]) -> None:
        if "loader" in options or "metadata" in options:
            raise TypeError("the callback records the trainer's DataLoader and settings itself")
        self.project, self.run, self.options = project, run, options
        self.prof: Profile | NoopProfile | None = None

    @guarded()
    def start(self, loader: Mapping[str, Any] | None, framework: dict[str, Any]) -> None:
        if self.prof is not None:
            return
        self.prof = profile(
            self.project, self.run, loader=loader, metadata={"framework": framework}, **self.options
        )
        self.prof.start()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()  # guarded inside; a counter compare outside capture windows

    @guarded()
    def stop(self) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()


def merged_loader_settings(loader: Any, known: Mapping[str, Any]) -> dict[str, Any]:
    """The DataLoader's own settings, with what the trainer knows filling the gaps (a wrapped or
    re-created loader can hide its batch size behind a batch sampler)."""
    settings = loader_settings(loader) if loader is not None else {"type": "unknown"}
    for name in LOADER_FIELDS:
        if settings.get(name) is None and known.get(name) is not None:
            settings[name] = known[name]
    return settings
