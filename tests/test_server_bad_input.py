"""Every kind of bad upload gets a precise 4xx JSON error and leaves nothing behind.

After each refusal the database holds exactly the rows it held before (every table counted) and
the trace store exactly the files (temp files included), and the server still answers.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app
from support.server import bearer, row_counts, store_files, synthetic_trace, upload

MAX_UPLOAD = 256 * 1024
MAX_DECOMPRESSED = 2 * 1024 * 1024


@pytest.fixture
def tight_app(server_settings: Settings, app: FastAPI) -> Iterator[FastAPI]:
    """The test app with small caps so over-size and bomb cases stay cheap (same database)."""
    settings = server_settings.model_copy(
        update={"max_upload_bytes": MAX_UPLOAD, "max_decompressed_bytes": MAX_DECOMPRESSED}
    )
    tight = create_app(settings)
    yield tight
    tight.state.db.dispose()


@pytest.fixture
def tight_client(tight_app: FastAPI, admin_token: str) -> Iterator[TestClient]:
    with TestClient(tight_app, headers=bearer(admin_token)) as test_client:
        yield test_client


def _bomb() -> bytes:
    """Valid gzip of a trace that inflates far beyond the cap (about 1000:1, 4x the cap)."""
    raw = b'{"traceEvents": [' + b" " * (8 * 1024 * 1024) + b"]}"
    return gzip.compress(raw, compresslevel=9)


def _incompressible_trace(size: int) -> bytes:
    """A well-formed gzip trace whose compressed size is about ``size`` bytes."""
    pad = random.Random(0).randbytes(size).hex()
    return gzip.compress(json.dumps({"traceEvents": [{"ph": "i"}], "pad": pad}).encode(), 1)


def _chunks(data: bytes, size: int = 32 * 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


VALID = synthetic_trace(50)
_PLAIN = synthetic_trace(50, compress=False)


def _edited(old: bytes, new: bytes, *, prefix: bytes = b"") -> bytes:
    """The valid trace with the first occurrence of ``old`` replaced (gzip, as the agent sends)."""
    assert old in _PLAIN
    return gzip.compress(prefix + _PLAIN.replace(old, new, 1), mtime=0)


_EVENT_3 = b'"ts": 30, "dur": 5'  # the fourth event's times (synthetic_trace: ts = i * 10)
# What the worker's parser cannot read: each must be refused at upload, naming what is wrong.
UNREADABLE: list[tuple[str, bytes, str]] = [
    ("nan-ts", _edited(_EVENT_3, b'"ts": NaN, "dur": 5'), "not valid JSON"),
    ("infinity-dur", _edited(_EVENT_3, b'"ts": 30, "dur": Infinity'), "not valid JSON"),
    ("lone-surrogate-name", _edited(b'"aten::op3"', b'"aten::\\ud800"'), "not valid JSON"),
    ("surrogate-bytes-name", _edited(b'"aten::op3"', b'"aten::\xed\xa0\x80"'), "not valid UTF-8"),
    ("invalid-utf8-name", _edited(b'"aten::op3"', b'"aten::\xff"'), "not valid UTF-8"),
    ("ts-1e308", _edited(_EVENT_3, b'"ts": 1e308, "dur": 5'), "'ts' 1e+308 \u00b5s, out of range"),
    ("ts-30-digits", _edited(_EVENT_3, b'"ts": ' + b"9" * 30 + b', "dur": 5'), "'ts' 1e+30"),
    ("dur-1e308", _edited(_EVENT_3, b'"ts": 30, "dur": 1e308'), "'dur' 1e+308 \u00b5s, out of range"),
    ("dur-30-digits", _edited(_EVENT_3, b'"ts": 30, "dur": ' + b"9" * 30), "'dur' 1e+30"),
    ("pid-30-digits", _edited(b'"pid": 1', b'"pid": ' + b"9" * 30), "too large for its field"),
    (
        "args-nested-100k-deep",
        _edited(b'"dur": 5}', b'"dur": 5, "args": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"),
        "nested too deeply",
    ),
]

# (id, request kwargs for support.server.upload, expected status, expected error code)
CASES: list[tuple[str, dict[str, Any], int, str]] = [
    ("malformed-json", {"body": b"this is not json at all", "gzipped": False}, 422, "invalid_trace"),
    ("json-array", {"body": b"[1, 2, 3]", "gzipped": False}, 422, "invalid_trace"),
    ("json-without-traceEvents", {"body": b'{"events": []}', "gzipped": False}, 422, "invalid_trace"),
    ("malformed-gzip-payload", {"body": gzip.compress(b"garbage bytes")}, 422, "invalid_trace"),
    ("truncated-gzip", {"body": VALID[: len(VALID) // 2]}, 400, "truncated_gzip"),
    ("corrupt-gzip", {"body": VALID[:12] + b"\xff" * 40 + VALID[52:]}, 400, "invalid_gzip"),
    ("declared-gzip-not-gzip", {"body": b'{"traceEvents": []}'}, 400, "invalid_gzip"),
    (
        "truncated-plain-json",
        {"body": b'{"traceEvents": [{"ph": "X"', "gzipped": False},
        400,
        "truncated_json",
    ),
    ("empty-body", {"body": b"", "gzipped": False}, 400, "empty_body"),
    ("gzip-bomb", {"body": _bomb()}, 413, "decompressed_too_large"),
    ("over-size-with-length", {"body": _incompressible_trace(MAX_UPLOAD)}, 413, "payload_too_large"),
    (
        "wrong-content-type",
        {"body": VALID, "headers": {"Content-Type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
    (
        "form-content-type",
        {"body": VALID, "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        415,
        "unsupported_media_type",
    ),
    (
        "brotli-encoding",
        {"body": VALID, "headers": {"Content-Encoding": "br"}},
        415,
        "unsupported_media_type",
    ),
    ("path-like-project", {"body": VALID, "project": "../../etc"}, 422, "invalid_name"),
    ("slash-in-run", {"body": VALID, "run": "a/b"}, 422, "invalid_name"),
    ("dot-leading-run", {"body": VALID, "run": ".hidden"}, 422, "invalid_name"),
    ("odd-characters", {"body": VALID, "project": "proj ect;rm -rf"}, 422, "invalid_name"),
    ("unicode-name", {"body": VALID, "run": "rün"}, 422, "invalid_name"),
    ("too-long-name", {"body": VALID, "run": "r" * 129}, 422, "invalid_name"),
    ("negative-rank", {"body": VALID, "rank": -1}, 422, "invalid_request"),
    (
        "metadata-not-json",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": "{nope"}},
        422,
        "invalid_metadata",
    ),
    (
        "metadata-not-object",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": "[1]"}},
        422,
        "invalid_metadata",
    ),
    (
        "metadata-too-big",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": json.dumps({"x": "y" * 9000})}},
        422,
        "invalid_metadata",
    ),
    ("bad-tags", {"body": VALID, "metadata": {"tags": [1, 2]}}, 422, "invalid_metadata"),
    ("bad-window", {"body": VALID, "metadata": {"window": {"index": "zero"}}}, 422, "invalid_metadata"),
    (
        "bad-idempotency-key",
        {"body": VALID, "idempotency_key": "spaces are bad"},
        422,
        "invalid_idempotency_key",
    ),
    # Found by attacking the service (#12): each was a 500, a broken run, or bytes kept forever.
    ("trailing-newline-project", {"body": VALID, "project": "abc\n"}, 422, "invalid_name"),
    ("trailing-newline-run", {"body": VALID, "run": "r1\n"}, 422, "invalid_name"),
    ("newline-idempotency-key", {"body": VALID, "idempotency_key": "k1\n"}, 422, "invalid_idempotency_key"),
    ("nul-in-tag", {"body": VALID, "metadata": {"tags": ["a\u0000b"]}}, 422, "invalid_metadata"),
    ("newline-in-tag", {"body": VALID, "metadata": {"tags": ["a\nb"]}}, 422, "invalid_metadata"),
    ("nul-in-metadata", {"body": VALID, "metadata": {"host": "x\u0000"}}, 422, "invalid_metadata"),
    ("nul-in-metadata-key", {"body": VALID, "metadata": {"a\u0000": 1}}, 422, "invalid_metadata"),
    ("control-in-metadata", {"body": VALID, "metadata": {"cmd": "\u001b[31m"}}, 422, "invalid_metadata"),
    (
        "lone-surrogate-in-metadata",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"x": "\\ud800"}'}},
        422,
        "invalid_metadata",
    ),
    (
        "nan-in-metadata",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"loss": NaN}'}},
        422,
        "invalid_metadata",
    ),
    (
        "infinity-in-metadata",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"lr": -Infinity}'}},
        422,
        "invalid_metadata",
    ),
    (
        "overflowing-float-in-metadata",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"lr": 1e400}'}},
        422,
        "invalid_metadata",
    ),
    (
        "huge-int-in-metadata",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"seed": ' + "9" * 30 + "}"}},
        422,
        "invalid_metadata",
    ),
    (
        "metadata-nested-3000-deep",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"a": ' + "[" * 3000 + "]" * 3000 + "}"}},
        422,
        "invalid_metadata",
    ),
    (
        "metadata-nested-20-deep",
        {"body": VALID, "headers": {"X-Stepdoctor-Metadata": '{"a": ' + "[" * 20 + "]" * 20 + "}"}},
        422,
        "invalid_metadata",
    ),
    ("traceEvents-a-number", {"body": b'{"traceEvents": 5}', "gzipped": False}, 422, "invalid_trace"),
    ("traceEvents-empty", {"body": gzip.compress(b'{"traceEvents": []}')}, 422, "invalid_trace"),
    (
        "traceEvents-empty-spaced",
        {"body": b'{"traceEvents" :  [ \n ] }', "gzipped": False},
        422,
        "invalid_trace",
    ),
    ("traceEvents-of-numbers", {"body": b'{"traceEvents": [1, 2]}', "gzipped": False}, 422, "invalid_trace"),
    ("traceEvents-a-string", {"body": b'{"traceEvents": "[{}]"}', "gzipped": False}, 422, "invalid_trace"),
    ("traceEvents-null", {"body": b'{"a": 1, "traceEvents": null}', "gzipped": False}, 422, "invalid_trace"),
    # What the worker's parser cannot read (#20): refused at the door by the same parser.
    *((name, {"body": body}, 422, "invalid_trace") for name, body, _ in UNREADABLE),
    (
        "content-length-and-chunked",
        {"body": VALID, "headers": {"Content-Length": str(len(VALID)), "Transfer-Encoding": "chunked"}},
        400,
        "ambiguous_length",
    ),
]


# Cases after which the next good upload is also analysed (a worker's drain), not only accepted.
_ANALYSED_AFTER = {name for name, _, _ in UNREADABLE} | {"content-length-and-chunked"}


@pytest.mark.parametrize(("case", "kwargs", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_upload_is_refused_cleanly(
    tight_app: FastAPI, tight_client: TestClient, case: str, kwargs: dict[str, Any], status: int, code: str
) -> None:
    # One good upload first, so "unchanged" is checked against a non-empty state.
    assert upload(tight_client, VALID, run="baseline").status_code == 201
    rows_before, files_before = row_counts(tight_app), store_files(tight_app)

    kwargs = dict(kwargs)
    response = upload(tight_client, kwargs.pop("body"), **kwargs)

    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert body["error"]["message"] and "\n" not in body["error"]["message"]
    assert "Traceback" not in response.text
    assert row_counts(tight_app) == rows_before
    assert store_files(tight_app) == files_before
    assert tight_client.get("/readyz").status_code == 200
    after = upload(tight_client, VALID, run="after")
    assert after.status_code == 201
    if case in _ANALYSED_AFTER:
        from support.server import drain

        drain(tight_app)
        assert tight_client.get(f"/api/v1/traces/{after.json()['id']}").json()["status"] == "done"


@pytest.mark.parametrize(("body", "says"), [c[1:] for c in UNREADABLE], ids=[c[0] for c in UNREADABLE])
def test_upload_refuses_what_the_worker_parser_cannot_read(
    tight_app: FastAPI, tight_client: TestClient, body: bytes, says: str
) -> None:
    """The upload check and the worker's parser are the same code: the same one-line reason, naming
    the event (#3 of 50) for values out of range; the next good upload is analysed."""
    from stepdoctor_analysis.errors import TraceError
    from stepdoctor_analysis.parsing import load_trace
    from support.server import drain

    rows_before, files_before = row_counts(tight_app), store_files(tight_app)
    response = upload(tight_client, body)
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert says in message and message.startswith("trace: ")
    if "out of range" in message:
        assert "(event #3)" in message
    with pytest.raises(TraceError) as worker_says:
        load_trace(io.BytesIO(body), name="trace")
    assert str(worker_says.value) == message
    assert row_counts(tight_app) == rows_before and store_files(tight_app) == files_before

    good = upload(tight_client, VALID, run="after")
    assert good.status_code == 201
    drain(tight_app)
    trace = tight_client.get(f"/api/v1/traces/{good.json()['id']}").json()
    assert trace["status"] == "done", trace


def test_byte_order_mark_is_read_alike_at_upload_and_by_the_worker(
    tight_app: FastAPI, tight_client: TestClient
) -> None:
    """A UTF-8 BOM before the JSON (Windows tools write one) is skipped in both places: accepted and analysed."""
    from support.server import drain

    for body, gzipped in ((gzip.compress(b"\xef\xbb\xbf" + _PLAIN), True), (b"\xef\xbb\xbf" + _PLAIN, False)):
        response = upload(tight_client, body, gzipped=gzipped, run=f"bom-{gzipped}")
        assert response.status_code == 201, response.text
        drain(tight_app)
        trace = tight_client.get(f"/api/v1/traces/{response.json()['id']}").json()
        assert trace["status"] == "done", trace


def test_over_size_streamed_body_without_length_is_cut_off(
    tight_app: FastAPI, tight_client: TestClient
) -> None:
    """Chunked upload (no Content-Length): the cap is enforced while streaming, temp file removed."""
    rows_before, files_before = row_counts(tight_app), store_files(tight_app)
    data = _incompressible_trace(MAX_UPLOAD)
    assert len(data) > MAX_UPLOAD
    response = upload(tight_client, _chunks(data))  # type: ignore[arg-type]
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert row_counts(tight_app) == rows_before
    assert store_files(tight_app) == files_before


def test_bad_pagination_values_are_422_json(client: TestClient) -> None:
    for query in (
        "limit=0",
        "limit=201",
        "limit=abc",
        "cursor=%%%",
        "cursor=bm9wZQ",
        "sort=size",
        "since=yesterday",
        "primary_kind=slow",
        "project=../x",
    ):
        response = client.get(f"/api/v1/runs?{query}")
        assert response.status_code == 422, query
        error = response.json()["error"]
        assert error["code"] in {"invalid_request", "invalid_cursor", "invalid_name"}, query
        assert error["message"], query


@pytest.mark.parametrize("route", ["traces", "memory-snapshot", "series"])
@pytest.mark.parametrize(
    ("declared", "status", "code"),
    [("twelve", 400, "invalid_content_length"), (str(MAX_UPLOAD + 1), 413, None)],
)
def test_every_upload_route_judges_the_declared_length_before_reading(
    tight_client: TestClient,
    app: FastAPI,
    admin_token: str,
    route: str,
    declared: str,
    status: int,
    code: str | None,
) -> None:
    """The three routes share one check (``web.uploads.check_declared_length``): a Content-Length
    that is not a number is 400, one over the limit 413, and nothing is kept either way."""
    trace_id = upload(tight_client, synthetic_trace(), token=admin_token).json()["id"]
    rows, files = row_counts(app), store_files(app)
    url, params, kind = {
        "traces": ("/api/v1/traces", {"project": "proj", "run": "run1", "rank": 0}, "application/json"),
        "memory-snapshot": (f"/api/v1/traces/{trace_id}/memory-snapshot", {}, "application/octet-stream"),
        "series": ("/api/v1/series", {"project": "proj", "run": "run1"}, "application/octet-stream"),
    }[route]
    tight_settings = tight_client.app.state.settings  # type: ignore[attr-defined]
    if route == "series" and code is None:  # the series limit is its own
        declared = str(tight_settings.max_series_chunk_bytes + 1)
    answer = tight_client.post(
        url, params=params, content=b"{}", headers={"Content-Type": kind, "Content-Length": declared}
    )
    assert answer.status_code == status, answer.text
    if code is not None:
        assert answer.json()["error"]["code"] == code, answer.text
    assert (row_counts(app), store_files(app)) == (rows, files)
