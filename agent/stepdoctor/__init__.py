"""stepdoctor: find out why your PyTorch training step is slow.

import stepdoctor
with stepdoctor.profile(project="resnet50", run="bs256") as prof:
    for batch in loader:
        train_step(batch)
        prof.step()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stepdoctor.version import __version__

if TYPE_CHECKING:
    from stepdoctor.profiler import NoopProfile, Profile, profile

__all__ = ["NoopProfile", "Profile", "__version__", "profile"]
_PROFILER_NAMES = frozenset({"NoopProfile", "Profile", "profile"})


def __getattr__(name: str) -> Any:
    """The profiler loads on first use: the ``stepdoctor`` console script (``analyze``, ``serve``)
    lives in this package and would otherwise pay ~45 ms for the agent's machinery on every run."""
    if name in _PROFILER_NAMES:
        from stepdoctor import profiler

        return getattr(profiler, name)
    raise AttributeError(f"module 'stepdoctor' has no attribute {name!r}")
