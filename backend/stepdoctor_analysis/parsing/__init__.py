"""Kineto Chrome trace -> columnar ``RankTrace``, in bounded memory, in five steps.

Traces of 1-2 GB are normal, so the file is never held as Python dicts:

- ``reading``: the file or stream is decompressed (gzip by magic number, ISA-L when installed) in blocks;
- ``splitting``: the ``traceEvents`` array is cut into chunks of about 512 KB at event boundaries;
- ``schema``: each chunk is decoded in place by msgspec into small tagged Structs (only the fields we
  use; metadata, other phases and, unless correlation ids are missing, flows decode to empty Structs).
  The ``args`` read are declared once, in ``schema.ARGS``, which generates the decoders and dtypes;
- ``columns``: the Structs are folded into numpy columns, and dropped;
- ``assembly``: the chunks' columns are joined, put on one ns clock, sorted, and correlation ids
  missing in old traces are recovered from flow events.

Peak memory is the columns plus a few chunks, whatever the file size. ``forked``: where the caller
allows it, a forked second process decodes the chunks it reaches first, and the two builders merge
into the same trace. Every format generation of
anchors §1 is accepted: fractional-µs Kineto, float ns-resolution, 2021 ``Operator/Runtime/Kernel/
Memcpy/Memset`` categories, ``ac2g``/``async_cpu_to_gpu``/``async``/``launch`` flows (used to recover a
missing correlation id), AMD ``hip*`` runtime calls, Triton's ``cuLaunchKernel`` (``cuda_driver``),
CPU-only traces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loading import DEFAULT_MAX_BYTES, job_files, job_order, load_job, load_trace, start_trace

__all__ = ["DEFAULT_MAX_BYTES", "job_files", "job_order", "load_job", "load_trace", "start_trace"]


def __getattr__(name: str) -> Any:
    """The entry points, imported on first use (``loading``): a sibling such as ``logdir`` is then
    imported without numpy and the parser (``stepdoctor analyze --help`` imported both after
    ``logdir`` moved into this package)."""
    if name == "start_trace":  # forks before numpy and the parser are imported (``forking``)
        from .forking import start_trace

        return start_trace
    if name in __all__:
        from . import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
