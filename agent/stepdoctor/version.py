"""The agent's version, in a module of its own: the package's ``__init__`` and the modules it loads
(metadata, transport) all read it, and none of them may import the package's ``__init__``, which
re-exports the profiler (that import would close a circle)."""

from __future__ import annotations

__version__ = "0.1.0"
