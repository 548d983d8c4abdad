"""What both framework callbacks share: a profiling session opened at train start, stepped by a
hook, closed at train end (or by the agent's ``atexit`` if training dies first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepdoctor.guard import guarded
from stepdoctor.integrations.trackers import Reporter, start_reporter
from stepdoctor.metadata import LOADER_FIELDS, loader_settings
from stepdoctor.profiler import NoopProfile, Profile, profile


class Session:
    """Holds the arguments of :func:`stepdoctor.profile` until the trainer knows its DataLoader.

    Besides :func:`stepdoctor.profile`'s keywords it takes the tracker options
    (:mod:`stepdoctor.integrations.trackers`): ``read_token`` (a token that may read the verdict,
    default the upload token), ``tracker_interval`` and ``tracker_timeout`` (seconds).
    """

    def __init__(self, project: str | None, run: str | None, options: dict[str, Any]) -> None:
        if "loader" in options or "metadata" in options:
            raise TypeError("the callback records the trainer's DataLoader and settings itself")
        options = dict(options)
        self.read_token: str | None = options.pop("read_token", None)
        self.tracker_interval: float = options.pop("tracker_interval", 30.0)
        self.tracker_timeout: float = options.pop("tracker_timeout", 30.0)
        self.project, self.run, self.options = project, run, options
        self.prof: Profile | NoopProfile | None = None
        self.reporter: Reporter | None = None

    @guarded()
    def start(self, loader: Mapping[str, Any] | None, framework: dict[str, Any]) -> None:
        if self.prof is not None:
            return
        self.prof = profile(
            self.project, self.run, loader=loader, metadata={"framework": framework}, **self.options
        )
        self.prof.start()
        self.reporter = start_reporter(self.prof, read_token=self.read_token, interval=self.tracker_interval)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()  # guarded inside; a counter compare outside capture windows

    @guarded()
    def stop(self, *, clean: bool = True) -> None:
        """``clean=False``: training ended with an exception (the run then reads stopped, not finished)."""
        prof, self.prof = self.prof, None
        reporter, self.reporter = self.reporter, None
        if prof is not None:
            prof.stop(clean=clean)  # delivers the last windows first
        if reporter is not None:
            reporter.close(self.tracker_timeout)


def merged_loader_settings(loader: Any, known: Mapping[str, Any]) -> dict[str, Any]:
    """The DataLoader's own settings, with what the trainer knows filling the gaps (a wrapped or
    re-created loader can hide its batch size behind a batch sampler)."""
    settings = loader_settings(loader) if loader is not None else {"type": "unknown"}
    for name in LOADER_FIELDS:
        if settings.get(name) is None and known.get(name) is not None:
            settings[name] = known[name]
    return settings
