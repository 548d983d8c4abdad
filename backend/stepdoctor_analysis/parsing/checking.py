"""The upload's check of a trace: the parser's own splitter, decoder and per-event checks, fed
the decompressed text as it streams in, with the columns dropped after each chunk.

Whatever ``load_trace`` would refuse later in a worker (not JSON, NaN or Infinity, a string that is
not UTF-8, a lone surrogate escape, a time out of range, a number too large for its column, no
events) is refused here, with the same one-line TraceError, before the upload is accepted: the
two cannot disagree because they run the same code. Memory stays bounded by the names seen and a
few chunks of text, whatever the trace's size.
"""

from __future__ import annotations

from .assembly import _int_or_none, no_events
from .columns import Builder
from .schema import Event
from .splitting import StreamParser

__all__ = ["TraceCheck"]


class _CheckingBuilder(Builder):
    """A ``Builder`` that runs every per-chunk check, then forgets the chunk's columns."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.had_rows = False

    def _absorb(self, events: list[Event], first: int) -> None:
        super()._absorb(events, first)
        self._drop()

    def absorb_flows(self, events: list[Event]) -> None:
        super().absorb_flows(events)
        self.flows.clear()

    def _drop(self) -> None:
        self.had_rows = self.had_rows or bool(self.host or self.gpu or self.mem)
        for table in (self.host, self.gpu, self.mem, self.oom_mem, self.flows):
            table.clear()
        for pieces in self.sparse.values():
            pieces.clear()


class TraceCheck:
    """Feed it decompressed text in blocks of any size, then call ``finish``; raises TraceError."""

    def __init__(self, name: str = "trace") -> None:
        self._builder = _CheckingBuilder(name)
        self._parser = StreamParser(self._builder, name)

    def feed(self, text: bytes) -> None:
        self._parser.feed(text)

    def finish(self) -> None:
        self._parser.finish()
        self._builder._drop()
        if not self._builder.had_rows:
            raise no_events(self._builder.source)

    def distributed(self) -> tuple[int | None, int | None]:
        """(rank, world size) from the trace's ``distributedInfo``, read as ``load_trace`` reads them."""
        dist = self._builder.top.get("distributedInfo")
        dist = dist if isinstance(dist, dict) else {}
        return _int_or_none(dist.get("rank")), _int_or_none(dist.get("world_size"))
