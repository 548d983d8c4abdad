"""Validation of an upload while it streams in: request headers, names, metadata, and the body.

The body check is deliberately cheap (full parsing happens later, in the worker): gzip is
decompressed incrementally under a cap on the decompressed size (a gzip bomb stops at the cap, not
at the end), a truncated or corrupt gzip stream is refused, and the JSON text must start with ``{``,
end with ``}`` and contain a ``"traceEvents"`` key. Every refusal is an ApiError with one clear line.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from stepdoctor_server.errors import ApiError

GZIP_MAGIC = b"\x1f\x8b"
NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
IDEMPOTENCY_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
ACCEPTED_CONTENT_TYPES = frozenset(
    {"application/json", "application/gzip", "application/x-gzip", "application/octet-stream"}
)
_TRACE_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:')
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
    if not NAME_RE.match(value):
        raise ApiError(
            422,
            "invalid_name",
            f"invalid {kind} name {value[:140]!r}: use 1-128 characters of [A-Za-z0-9._-], not starting with '.'",
        )
    return value


def validate_idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not IDEMPOTENCY_KEY_RE.match(value):
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


def parse_metadata(text: str | None, *, max_bytes: int) -> UploadMetadata:
    """Parse ``X-Stepdoctor-Metadata`` (or the ``metadata`` query parameter): a JSON object."""
    if text is None or text.strip() == "":
        return UploadMetadata(raw={})
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ApiError(422, "invalid_metadata", f"metadata exceeds {max_bytes} bytes")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ApiError(422, "invalid_metadata", f"metadata is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ApiError(422, "invalid_metadata", f"metadata must be a JSON object, not {type(raw).__name__}")
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
    )


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
        if not isinstance(item, str) or not 0 < len(item) <= MAX_TAG_CHARS:
            raise ApiError(
                422, "invalid_metadata", f"each tag must be a string of 1-{MAX_TAG_CHARS} characters"
            )
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
        self.decompressed_bytes += len(text)
        if self.decompressed_bytes > self.max_decompressed:
            raise ApiError(
                413,
                "decompressed_too_large",
                f"trace decompresses to more than {self.max_decompressed} bytes "
                "(STEPDOCTOR_MAX_DECOMPRESSED_BYTES); refusing a possible gzip bomb",
            )
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
            if _TRACE_EVENTS_KEY.search(window):
                self._found_key = True
                self._scan_tail = b""
            else:
                self._scan_tail = window[-64:]
        end = text.rstrip(_WHITESPACE)
        if end:
            self._last_byte = end[-1:]

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
        if self._last_byte != b"}":
            raise ApiError(
                400,
                "truncated_json",
                "trace JSON is incomplete: it does not end with '}' (truncated upload?)",
            )
