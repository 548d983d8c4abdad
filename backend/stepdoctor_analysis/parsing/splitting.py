"""Decompressed text -> header, ``traceEvents`` chunks cut at event boundaries, and tail.

The array is cut into chunks of about 512 KB: a boundary is a ``}`` followed by ``,`` and ``{``; a
wrong cut (inside a string or a nested value) leaves the chunk unbalanced, so it fails to decode and
an earlier candidate is tried. Each chunk is decoded in place (no copy of the text) and handed to
the builder, so peak memory is the columns plus a few chunks, whatever the file size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import TraceError
from .schema import EVENTS_DECODER, LAX_DECODER, LEAN_DECODER, Event, LaxEvent, tighten

if TYPE_CHECKING:
    from .columns import Builder

_CHUNK = 512 << 10  # event text decoded at a time (at least)
# Bounded memory whatever the text holds: more than this much text that cannot be cut into events
# (a giant string or value, deep nesting, a huge header or tail) is refused, not buffered.
_MAX_UNCUT = 64 << 20
# Once that much text waits uncut, whitespace runs are collapsed as blocks arrive, so a trace
# padded with gigabytes of whitespace costs memory for its events only. Only runs of 1 KiB+ are
# touched: outside strings JSON ignores them; inside one they could only be an absurd name.
_COLLAPSE_AFTER = 2 << 20
_LONG_WHITESPACE = re.compile(rb"[ \t\r\n]{1024,}")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_SPLIT_ANY = re.compile(rb"\}\s*,\s*\{")
_ARRAY_END = re.compile(rb'\]\s*(?:,\s*"|\})')  # the events' ']' is followed by a key or the end
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark


class Diverged(Exception):
    """A chunk cut without decoding (``StreamParser.skip``) would have been cut elsewhere: the
    processes sharing the trace no longer agree on its chunks (``forked`` parses it alone)."""


class StreamParser:
    """Cuts the decompressed text into header, event chunks and tail.

    ``skip(k)``: chunk ``k`` (0-based) is another process's (``forked``): it is cut where the chunk
    would be, at the first candidate, and dropped undecoded; ``on_chunk(k)`` runs after each chunk
    this parser absorbs, the tail included.
    """

    def __init__(
        self,
        builder: Builder,
        name: str,
        skip: Callable[[int], bool] | None = None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        self.b = builder
        self.name = name
        self.buf = bytearray()
        self.header: bytes | None = None
        self.key = b""  # the '"traceEvents":' text cut from between header and events
        self.whole = False  # give up cutting: decode everything at the end
        self.failed_at = 0  # buffer size at the last failed cut
        self.decoder = LEAN_DECODER  # switched to EVENTS_DECODER once flows turn out to be needed
        self.searched = 0  # the header search resumes here (no rescanning: linear time)
        self.begun = False  # a leading byte order mark was looked for (``_skip_bom``)
        self.skip = skip
        self.on_chunk = on_chunk
        self.chunks = 0  # chunks cut so far

    def run(self, blocks: Iterator[bytes]) -> None:
        for block in blocks:
            self.feed(block)
        self.finish()

    def feed(self, block: bytes) -> None:
        """Take the next block of decompressed text (any size); decode the whole events it completes."""
        try:
            self._feed(block)
        except UnicodeDecodeError as exc:
            raise self._not_utf8(exc) from None
        except RecursionError:  # msgspec recurses per nesting level
            raise self._too_deep() from None

    def _feed(self, block: bytes) -> None:
        if len(self.buf) > _COLLAPSE_AFTER:
            block = b" " if not block.strip() else _LONG_WHITESPACE.sub(b" ", block)
        self.buf += block
        if len(self.buf) > _MAX_UNCUT:
            raise TraceError(
                f"{self.name}: more than {_MAX_UNCUT >> 20} MiB of text that is not a sequence of "
                "trace events (a giant string or value, or nesting too deep); refusing it"
            )
        if not self.begun and not self._skip_bom(final=False):
            return
        if self.header is None and not self.whole:
            self._find_header()
        if self.header is not None and not self.whole and len(self.buf) >= _CHUNK:
            self._cut_chunks()

    def finish(self) -> None:
        """The text ended: decode what is left and the top-level fields after the events."""
        if not self.begun:
            self._skip_bom(final=True)
        try:
            self._finish()
        except UnicodeDecodeError as exc:
            raise self._not_utf8(exc) from None
        except RecursionError:
            raise self._too_deep() from None

    def _too_deep(self) -> TraceError:
        return TraceError(f"{self.name}: JSON nested too deeply to be a trace")

    def _not_utf8(self, exc: UnicodeDecodeError) -> TraceError:
        """msgspec raises UnicodeDecodeError (not a DecodeError) for a string that is not UTF-8:
        invalid bytes, or a surrogate (U+D800-DFFF) encoded as bytes."""
        return TraceError(f"{self.name}: a string is not valid UTF-8 text ({exc.reason})")

    def _skip_bom(self, *, final: bool) -> bool:
        """Drop a leading UTF-8 byte order mark (some editors and Windows tools write one), so the
        upload check and the worker read such a file alike; False while too few bytes arrived to tell."""
        if len(self.buf) < len(BOM) and not final and BOM.startswith(bytes(self.buf)):
            return False
        self.begun = True
        if self.buf.startswith(BOM):
            del self.buf[: len(BOM)]
        return True

    def _find_header(self) -> None:
        m = _EVENTS_KEY.search(self.buf, self.searched)
        if m is None:
            self.searched = max(0, len(self.buf) - 64)  # the key may straddle two blocks
            return
        header = bytes(self.buf[: m.start()])
        try:
            msgspec.json.decode(header + b'"_": 0}')
        except msgspec.DecodeError:
            self.whole = True  # the key sat somewhere odd; let the full decoder judge
            return
        self.header = header
        self.key = bytes(self.buf[m.start() : m.end() - 1])
        # Keep the array's '[': the buffer always starts with '[' so chunks decode in place.
        del self.buf[: m.end() - 1]

    def _cut_chunks(self) -> None:
        """Decode all whole events buffered so far, in place (no copy of the text)."""
        if len(self.buf) <= self.failed_at:
            return
        if self.skip is not None and self.skip(self.chunks):
            self._drop_chunk()
            return
        for cut in self._split_candidates(len(self.buf)):
            comma = self.buf.index(b",", cut + 1)
            saved = self.buf[cut + 1]
            self.buf[cut + 1] = 0x5D  # ']' closes the chunk; the bytes up to the comma are dropped after
            with memoryview(self.buf) as view:
                events = self._decode_events(view[: cut + 2])
            if events is None:
                if self.skip is not None:  # the other process cut here, undecoded
                    raise Diverged
                self.buf[cut + 1] = saved
                continue
            self.b.absorb(events)
            del events
            if self.b.flows_skipped:
                with memoryview(self.buf) as view:
                    self._absorb_flows(view[: cut + 2])
            self._drop_through(comma)
            self._absorbed()
            return
        self._note_failure()

    def _drop_chunk(self) -> None:
        """Cut another process's chunk where it cuts it (the first candidate), without decoding it."""
        cut = next(self._split_candidates(len(self.buf), tries=1), None)
        if cut is None:
            self._note_failure()
            return
        self._drop_through(self.buf.index(b",", cut + 1))
        self.chunks += 1

    def _drop_through(self, comma: int) -> None:
        """The chunk before ``comma`` is done: the buffer starts a new array there."""
        del self.buf[:comma]
        self.buf[0] = 0x5B  # '['
        self.failed_at = 0

    def _absorbed(self) -> None:
        if self.on_chunk is not None:
            self.on_chunk(self.chunks)
        self.chunks += 1

    def _note_failure(self) -> None:
        """No cut worked (a giant event, or odd nesting): wait for more text (up to _MAX_UNCUT)."""
        self.failed_at = len(self.buf) + _CHUNK

    def _split_candidates(self, before: int, tries: int = 3) -> Iterator[int]:
        """Up to ``tries`` positions of a ``}`` followed by ``,`` and ``{``, latest first.

        A cut inside a string or a nested value makes the chunk fail to decode (unbalanced or
        unterminated), so the caller then tries the next candidate.
        """
        pos, found, lo = before, 0, max(1, before - _CHUNK)
        while found < tries:
            pos = self.buf.rfind(b"}", lo, pos)
            if pos < 0:
                return
            if _SPLIT_ANY.match(self.buf, pos):
                found += 1
                yield pos

    def _absorb_flows(self, data: memoryview) -> None:
        """The chunk just absorbed needs its flow events: decode it in full, and the rest of the trace."""
        self.decoder = EVENTS_DECODER
        events = self._decode_events(data)
        self.b.flows_skipped = False
        if events is not None:
            self.b.absorb_flows(events)

    def _decode_events(self, data: bytes | memoryview) -> list[Event] | None:
        """Decode ``[ ... ]`` holding whole events; None when the text is not a whole number of events."""
        try:
            return self.decoder.decode(data)
        except msgspec.DecodeError as exc:
            if not isinstance(exc, msgspec.ValidationError):
                return None
        try:
            return tighten(LAX_DECODER.decode(data))
        except msgspec.ValidationError as exc:
            raise TraceError(f"{self.name}: malformed event ({_short(exc)})") from None
        except msgspec.DecodeError:
            return None

    def _finish(self) -> None:
        if self.header is None:
            self._decode_whole(bytes(self.buf))
            return
        rest, self.buf = self.buf, bytearray()  # take the text over: a copy is fresh memory to fault in
        # The events array ends at one of the last ']'; the tail after it must close the object.
        # Only a ']' followed by another key or the closing '}' can end it: Kineto's "logs" array after
        # the events holds many "cpp:983] ..." lines, each a ']' skipped here without decoding.
        pos, tries = len(rest), 0
        while tries < 64:
            pos = rest.rfind(b"]", 0, pos)
            if pos < 0:
                break
            if not _ARRAY_END.match(rest, pos):
                continue
            tries += 1
            tail = rest[pos + 1 :].strip().lstrip(b",").strip()
            try:
                msgspec.json.decode(b"{" + tail if tail != b"}" else b"{}")  # cheap: no header
                top = msgspec.json.decode(self.header + (tail if tail != b"}" else b'"_": 0}'))
            except msgspec.DecodeError:
                continue
            with memoryview(rest) as view:
                events = self._decode_events(view[: pos + 1])
            if events is None:
                continue
            self.b.absorb(events)
            if self.b.flows_skipped:
                with memoryview(rest) as view:
                    self._absorb_flows(view[: pos + 1])
            self.b.set_top(top if isinstance(top, dict) else {})
            self._absorbed()
            return
        # No clean end: let the decoder name the problem.
        raise TraceError(f"{self.name}: not valid JSON ({_json_error(self.header + self.key + rest)})")

    def _decode_whole(self, text: bytes) -> None:
        try:
            top = msgspec.json.decode(text, type=dict[str, Any])
        except msgspec.ValidationError:
            raise TraceError(f"{self.name}: not a Chrome trace (top level is not a JSON object)") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{self.name}: not valid JSON ({_short(exc)})") from None
        raw = top.pop("traceEvents", None)
        if not isinstance(raw, list):
            raise TraceError(f"{self.name}: no 'traceEvents' list; not a Chrome/Kineto trace")
        try:
            events = tighten(msgspec.convert(raw, type=list[LaxEvent], strict=False))
        except msgspec.ValidationError as exc:
            raise TraceError(f"{self.name}: malformed event ({_short(exc)})") from None
        del raw
        self.b.absorb(events)
        self.b.set_top(top)
        self._absorbed()


def _json_error(text: bytes) -> str:
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return _short(exc)
    return "unexpected structure"


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200]
