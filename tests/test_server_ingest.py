"""Streaming body checks in isolation: chunk boundaries, gzip members, bomb cut-off."""

from __future__ import annotations

import gzip
import json

import pytest

from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.traces.ingest import BodyInspector, normalize_tags, parse_metadata

TRACE = json.dumps(
    {"schemaVersion": 1, "traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1}] * 50}
).encode()


def _inspect(body: bytes, chunk: int, *, gzipped: bool | None = None, cap: int = 1 << 30) -> BodyInspector:
    inspector = BodyInspector(gzipped=gzipped, max_decompressed_bytes=cap)
    for i in range(0, len(body), chunk):
        inspector.feed(body[i : i + chunk])
    inspector.finish()
    return inspector


@pytest.mark.parametrize("chunk", [1, 2, 7, 13, 4096])
def test_any_chunking_accepts_plain_and_gzip(chunk: int) -> None:
    assert _inspect(TRACE, chunk).decompressed_bytes == len(TRACE)
    inspector = _inspect(gzip.compress(TRACE), chunk)
    assert inspector.gzipped and inspector.decompressed_bytes == len(TRACE)


def test_concatenated_gzip_members_and_bom_are_accepted() -> None:
    half = len(TRACE) // 2
    body = gzip.compress(b"\xef\xbb\xbf" + TRACE[:half]) + gzip.compress(TRACE[half:])
    assert _inspect(body, 100).decompressed_bytes == len(TRACE) + 3


def test_trailing_garbage_after_gzip_is_refused() -> None:
    with pytest.raises(ApiError) as err:
        _inspect(gzip.compress(TRACE) + b"extra", 64)
    assert err.value.code == "invalid_gzip"


def test_bomb_stops_at_the_cap_not_at_the_end() -> None:
    cap = 1 << 20
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * (64 << 20) + b"]}", 9)
    inspector = BodyInspector(gzipped=True, max_decompressed_bytes=cap)
    with pytest.raises(ApiError) as err:
        inspector.feed(bomb)
    assert err.value.status == 413 and err.value.code == "decompressed_too_large"
    # Inflated in bounded pieces: it stopped within one piece of the cap, not after 64 MiB.
    assert inspector.decompressed_bytes <= cap + (1 << 20)


def test_key_must_be_a_key_not_just_text() -> None:
    with pytest.raises(ApiError) as err:
        _inspect(b'{"name": "traceEvents"}', 5)
    assert err.value.code == "invalid_trace"


def test_metadata_parsing() -> None:
    meta = parse_metadata('{"rank": 2, "window": {"index": 1, "first_step": 5}, "tags": "x"}', max_bytes=8192)
    assert (meta.rank, meta.window_index, meta.first_step, meta.last_step, meta.tags) == (
        2,
        1,
        5,
        None,
        ["x"],
    )
    assert parse_metadata(None, max_bytes=10).raw == {}
    with pytest.raises(ApiError):
        parse_metadata('{"rank": true}', max_bytes=8192)
    assert normalize_tags(["a", "b", "a"]) == ["a", "b"]
    assert normalize_tags({"k": 1}) == ["k=1"]
