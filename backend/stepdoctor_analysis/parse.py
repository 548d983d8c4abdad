"""The parser's front door, kept so ``from stepdoctor_analysis import parse`` callers need no change.

The parser itself lives in ``parsing/`` (reading, splitting, schema, columns, assembly); see its
docstring. The underscored names are the parts other modules build on: ``trim`` reuses the reader and
the chunk splitter, ``bench/analysis_speed.py`` the event type and the column builder. Tuning knobs
(chunk and block sizes, the inflate library) are set on the module that reads them, not here.
"""

from __future__ import annotations

from .errors import TraceError, TraceTooLarge
from .parsing import DEFAULT_MAX_BYTES, load_job, load_trace
from .parsing.columns import Builder as _Builder
from .parsing.reading import decompressed_blocks as _decompressed_blocks
from .parsing.schema import Event as _Event
from .parsing.splitting import StreamParser as _StreamParser

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TraceError",
    "TraceTooLarge",
    "_Builder",
    "_Event",
    "_StreamParser",
    "_decompressed_blocks",
    "load_job",
    "load_trace",
]
