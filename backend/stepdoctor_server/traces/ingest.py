"""Validation of an upload while it streams in: request headers, names, metadata, and the body.

The body is checked while it streams in: gzip is decompressed incrementally under a cap on the
decompressed size and on the compression ratio (a gzip bomb stops after a few MiB of output, not at
the cap), a truncated or corrupt gzip stream is refused, and the JSON text must start with ``{``,
end with ``}`` and hold a ``"traceEvents"`` key whose value is an array starting with an event
object. The text then goes through the worker's own parser (``parsing.checking.TraceCheck``: the
same splitter, decoder and per-event checks, no columns kept), so whatever the worker could not
read (NaN, a string that is not UTF-8, a lone surrogate, a time out of range) is a 422 naming the
event and field, never a 201 that fails later. Every refusal is an ApiError with one clear line.

Names are checked by full match (``re.fullmatch``: ``$`` would let a trailing newline through) and
metadata is checked for what breaks storage later: depth, non-finite numbers, NUL and control
characters, lone surrogates (PostgreSQL's ``jsonb`` refuses them all).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from stepdoctor_analysis.errors import TraceError
from stepdoctor_analysis.parsing.checking import TraceCheck
from stepdoctor_server.core.errors import ApiError

GZIP_MAGIC = b"\x1f\x8b"
# Always used with ``fullmatch``: ``^...$`` accepts a trailing newline ("abc\n").
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
IDEMPOTENCY_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
ACCEPTED_CONTENT_TYPES = frozenset(
    {"application/json", "application/gzip", "application/x-gzip", "application/octet-stream"}
)
_TRACE_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:')
# Real Kineto traces compress 10-25:1; beyond this ratio (once past the floor) a body is a bomb.
MAX_COMPRESSION_RATIO = 200
RATIO_CHECK_AFTER = 32 << 20  # decompressed bytes before the ratio is judged (small files vary)
MAX_METADATA_DEPTH = 8
# C0 controls and DEL except tab/newline/CR, plus lone surrogates: jsonb and most viewers refuse them.
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_TAG_BAD_CHARS = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
# Decompress at most this much per zlib call so memory stays flat whatever the ratio.
_OUT_CHUNK = 1 << 20
_WHITESPACE = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"
MAX_TAGS = 64
MAX_TAG_CHARS = 128


def validate_name(kind: str, value: str | None) -> str:
    """Project and run names end up in file names and URLs, so they are a small safe alphabet."""
    if value is None or value == "":
        raise ApiError(422, "invalid_name", f"missing {kind} name (query parameter '{kind}')")
    if not NAME_RE.fullmatch(value):
        raise ApiError(
            422,
            "invalid_name",
            f"invalid {kind} name {value[:140]!r}: use 1-128 characters of [A-Za-z0-9._-], not starting with '.'",
        )
    return value


def validate_idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not IDEMPOTENCY_KEY_RE.fullmatch(value):
        raise ApiError(
            422, "invalid_idempotency_key", "Idempotency-Key must be 1-128 characters of [A-Za-z0-9_-]"
        )
    return value


def check_content_type(content_type: str | None, content_encoding: str | None) -> bool | None:
    """Refuse what we cannot read (415); return True if the body is declared gzip, None to sniff."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media not in ACCEPTED_CONTENT_TYPES:
        shown = media or "none"
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {shown!r} not accepted: send the trace as application/json "
            "(with Content-Encoding: gzip when compressed) or application/gzip",
        )
    encoding = (content_encoding or "").strip().lower()
    if encoding in {"", "identity"}:
        return True if media in {"application/gzip", "application/x-gzip"} else None
    if encoding in {"gzip", "x-gzip"}:
        return True
    raise ApiError(
        415, "unsupported_media_type", f"Content-Encoding {encoding!r} not supported: use gzip or none"
    )


@dataclass
class UploadMetadata:
    """The parts of the agent's metadata the server indexes; ``raw`` is stored as sent."""

    raw: dict[str, Any]
    rank: int | None = None
    window_index: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    tags: list[str] = field(default_factory=list)
    world_size: int | None = None  # the agent's; only a positive integer counts


def parse_metadata(text: str | None, *, max_bytes: int) -> UploadMetadata:
    """Parse ``X-Stepdoctor-Metadata`` (or the ``metadata`` query parameter): a JSON object."""
    if text is None or text.strip() == "":
        return UploadMetadata(raw={})
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ApiError(422, "invalid_metadata", f"metadata exceeds {max_bytes} bytes")
    try:
        raw = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except ValueError as exc:
        raise ApiError(422, "invalid_metadata", f"metadata is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(
            422, "invalid_metadata", f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels"
        ) from None
    if not isinstance(raw, dict):
        raise ApiError(422, "invalid_metadata", f"metadata must be a JSON object, not {type(raw).__name__}")
    check_json_value(raw, "metadata")
    window = raw.get("window") or {}
    if not isinstance(window, dict):
        raise ApiError(422, "invalid_metadata", "metadata.window must be an object")
    return UploadMetadata(
        raw=raw,
        rank=_optional_int(raw, "rank", minimum=0),
        window_index=_optional_int(window, "index", minimum=0, label="window.index"),
        first_step=_optional_int(window, "first_step", label="window.first_step"),
        last_step=_optional_int(window, "last_step", label="window.last_step"),
        tags=normalize_tags(raw.get("tags")),
        world_size=ws
        if isinstance(ws := raw.get("world_size"), int) and not isinstance(ws, bool) and ws > 0
        else None,
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (only finite numbers are accepted)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def check_json_value(value: Any, where: str) -> None:
    """Refuse what JSON allows but storage does not: deep nesting, huge integers, NUL, controls.

    Iterative (no recursion), so a hostile document cannot exhaust the stack here either.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise ApiError(
                422, "invalid_metadata", f"{where} is nested deeper than {MAX_METADATA_DEPTH} levels"
            )
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if abs(item) >= 2**63:
                raise ApiError(422, "invalid_metadata", f"{path} is an integer out of the 64-bit range")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ApiError(422, "invalid_metadata", f"{path} is not a finite number")
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(str(key), f"{path} key")
                stack.append((child, f"{path}.{str(key)[:40]}", depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
        else:
            raise ApiError(422, "invalid_metadata", f"{path} has an unsupported type")


def _check_text(text: str, path: str) -> None:
    if _BAD_CHARS.search(text):
        raise ApiError(422, "invalid_metadata", f"{path} contains a NUL, control character or lone surrogate")


def check_tag(tag: str, what: str = "tag") -> str:
    """A tag is one printable line: control characters (NUL above all) break filters and headers."""
    if not 0 < len(tag) <= MAX_TAG_CHARS or _TAG_BAD_CHARS.search(tag):
        raise ApiError(
            422,
            "invalid_metadata" if what == "tag" else "invalid_request",
            f"each {what} must be 1-{MAX_TAG_CHARS} printable characters",
        )
    return tag


def _optional_int(
    obj: dict[str, Any], key: str, *, minimum: int | None = None, label: str = ""
) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    name = label or key
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(422, "invalid_metadata", f"metadata.{name} must be an integer")
    if minimum is not None and value < minimum:
        raise ApiError(422, "invalid_metadata", f"metadata.{name} must be >= {minimum}")
    if abs(value) >= 2**31:
        raise ApiError(422, "invalid_metadata", f"metadata.{name} is out of range")
    return value


def normalize_tags(value: Any) -> list[str]:
    """Tags as a list of strings: a list as is, a mapping as ``key=value``, a string as one tag."""
    if value is None:
        return []
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, dict):
        items = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, list):
        items = value
    else:
        raise ApiError(422, "invalid_metadata", "metadata.tags must be a list of strings")
    tags: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ApiError(
                422, "invalid_metadata", f"each tag must be a string of 1-{MAX_TAG_CHARS} characters"
            )
        check_tag(item)
        if item not in tags:
            tags.append(item)
    if len(tags) > MAX_TAGS:
        raise ApiError(422, "invalid_metadata", f"at most {MAX_TAGS} tags")
    return tags


class BodyInspector:
    """Fed the raw body chunk by chunk; raises ApiError as soon as the body is known to be bad.

    ``gzipped=None`` sniffs the gzip magic from the first bytes. Concatenated gzip members are
    accepted (as ``gzip`` itself does); anything else after the end of the stream is refused.
    """

    def __init__(self, *, gzipped: bool | None, max_decompressed_bytes: int) -> None:
        self.gzipped = gzipped
        self.max_decompressed = max_decompressed_bytes
        self.compressed_bytes = 0
        self.decompressed_bytes = 0
        self._decided = False
        self._head = b""  # raw bytes kept until we know whether this is gzip
        self._decomp: Any = None
        self._member_done = False
        self._started_json = False
        self._found_key = False
        self._scan_tail = b""  # overlap so a key split across chunks is still found
        self._last_byte = b""
        # After the key: b"[" while waiting for the array, b"{" for its first event, b"" when seen.
        self._expect = b"["
        self._parse_check = TraceCheck("trace")  # the worker's parser, columns dropped

    # -- raw bytes -------------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> None:
        self.compressed_bytes += len(chunk)
        if not self._decided:
            self._head += chunk
            if len(self._head) < 2:
                return
            chunk, self._head = self._head, b""
            self._decide(chunk)
        if self.gzipped:
            self._feed_gzip(chunk)
        else:
            self._feed_text(chunk)

    def _decide(self, first: bytes) -> None:
        self._decided = True
        is_gzip = first.startswith(GZIP_MAGIC)
        if self.gzipped and not is_gzip:
            raise ApiError(400, "invalid_gzip", "Content-Encoding is gzip but the body is not gzip data")
        self.gzipped = is_gzip

    def _feed_gzip(self, data: bytes) -> None:
        while data:
            if self._member_done:
                if data.strip(b"\x00") == b"":  # zero padding after the stream is harmless
                    return
                if not data.startswith(GZIP_MAGIC[: len(data)]):
                    raise ApiError(400, "invalid_gzip", "unexpected data after the end of the gzip stream")
                self._member_done = False
                self._decomp = None
            if self._decomp is None:
                self._decomp = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            data = self._decompress(data)

    def _decompress(self, data: bytes) -> bytes:
        """Inflate ``data`` in bounded pieces; return bytes that belong to the next gzip member."""
        decomp = self._decomp
        try:
            while data:
                out = decomp.decompress(data, _OUT_CHUNK)
                data = decomp.unconsumed_tail
                if out:
                    self._feed_text(out)
                if decomp.eof:
                    self._member_done = True
                    return bytes(decomp.unused_data) + data
        except zlib.error as exc:
            raise ApiError(400, "invalid_gzip", f"corrupt gzip data: {exc}") from None
        return b""

    # -- decompressed JSON text ------------------------------------------------------------------
    def _feed_text(self, text: bytes) -> None:
        self._inspect_text(text)
        if self._started_json:
            with _as_api_error():
                self._parse_check.feed(text)

    def _inspect_text(self, text: bytes) -> None:
        self.decompressed_bytes += len(text)
        if self.decompressed_bytes > self.max_decompressed:
            raise ApiError(
                413,
                "decompressed_too_large",
                f"trace decompresses to more than {self.max_decompressed} bytes "
                "(STEPDOCTOR_MAX_DECOMPRESSED_BYTES); refusing a possible gzip bomb",
            )
        self._check_ratio()
        if not self._started_json:
            if self.decompressed_bytes == len(text) and text.startswith(_BOM):
                text = text[len(_BOM) :]
            stripped = text.lstrip(_WHITESPACE)
            if not stripped:
                return
            if not stripped.startswith(b"{"):
                raise ApiError(
                    422,
                    "invalid_trace",
                    "body is not a Chrome trace: expected a JSON object starting with '{'",
                )
            self._started_json = True
        if not self._found_key:
            window = self._scan_tail + text
            found = _TRACE_EVENTS_KEY.search(window)
            if found:
                self._found_key = True
                self._scan_tail = b""
                self._check_events_start(window[found.end() :])
            else:
                self._scan_tail = window[-64:]
        elif self._expect:
            self._check_events_start(text)
        end = text.rstrip(_WHITESPACE)
        if end:
            self._last_byte = end[-1:]

    def _check_ratio(self) -> None:
        """Stop inflating as soon as the output is implausibly large for its input (cheap: the
        check runs per inflated MiB, so a bomb costs a few MiB of CPU, not the whole cap)."""
        if not self.gzipped or self.decompressed_bytes <= RATIO_CHECK_AFTER:
            return
        if self.decompressed_bytes > MAX_COMPRESSION_RATIO * max(self.compressed_bytes, 1):
            raise ApiError(
                413,
                "implausible_compression",
                f"trace inflates more than {MAX_COMPRESSION_RATIO}:1 (real traces compress about 10-25:1); "
                "refusing a possible gzip bomb",
            )

    def _check_events_start(self, text: bytes) -> None:
        """The value of ``traceEvents`` must be an array whose first item is an event object."""
        for wanted in (b"[", b"{"):
            if self._expect != wanted:
                continue
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            if text[:1] != wanted:
                what = "an array" if wanted == b"[" else "a non-empty array of event objects"
                raise ApiError(
                    422, "invalid_trace", f"body is not a Chrome trace: 'traceEvents' is not {what}"
                )
            text = text[1:]
            self._expect = b"{" if wanted == b"[" else b""

    def finish(self) -> None:
        """Call after the last chunk: refuse truncated gzip, empty bodies and incomplete JSON."""
        if self._head:  # fewer than 2 bytes in total
            head, self._head = self._head, b""
            self._decide(head)
            if self.gzipped:
                self._feed_gzip(head)
            else:
                self._feed_text(head)
        if self.compressed_bytes == 0:
            raise ApiError(400, "empty_body", "request body is empty: send the trace JSON (gzip allowed)")
        if self.gzipped and not self._member_done:
            raise ApiError(
                400,
                "truncated_gzip",
                f"gzip stream is truncated: it ended after {self.compressed_bytes} bytes "
                "before the end-of-stream marker",
            )
        if not self._started_json:
            raise ApiError(422, "invalid_trace", "body holds no JSON: expected a Chrome trace object")
        if not self._found_key:
            raise ApiError(422, "invalid_trace", "body is not a Chrome trace: no 'traceEvents' key found")
        if self._expect and self._last_byte == b"}":
            raise ApiError(
                422, "invalid_trace", "body is not a Chrome trace: 'traceEvents' holds no event objects"
            )
        if self._last_byte != b"}":
            raise ApiError(
                400,
                "truncated_json",
                "trace JSON is incomplete: it does not end with '}' (truncated upload?)",
            )
        with _as_api_error():
            self._parse_check.finish()

    def distributed(self) -> tuple[int | None, int | None]:
        """(rank, world size) the trace's ``distributedInfo`` gives; after ``finish``."""
        return self._parse_check.distributed()


def check_rank(rank: int | None, world_size: int | None, *, source: str) -> None:
    """Refuse a rank outside ``[0, world_size)`` (422): the run's ranks index its processes."""
    if rank is not None and world_size is not None and not 0 <= rank < world_size:
        raise ApiError(
            422,
            "rank_out_of_range",
            f"rank {rank} is outside [0, {world_size}): the world size {world_size} is {source}",
        )


@contextmanager
def _as_api_error() -> Iterator[None]:
    """The parser's TraceError (one line, naming the event and field) as the upload's 422."""
    try:
        yield
    except TraceError as exc:
        raise ApiError(422, "invalid_trace", str(exc)) from None
