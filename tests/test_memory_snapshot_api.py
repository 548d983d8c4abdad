"""A trace's memory snapshot on the server (``traces.snapshots``, ``web.api_snapshots``): stored beside the
trace, downloaded as the same bytes, and checked without being unpickled: anything that is not a data-only
pickle with a dict at its top is refused with a precise 4xx and leaves nothing behind. SQLite and PostgreSQL."""

from __future__ import annotations

import collections
import gzip
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app
from support.memory_snapshots import snapshot_shaped
from support.server import bearer, logged_in, row_counts, store_files, synthetic_trace, upload

OCTET = {"Content-Type": "application/octet-stream"}


def _trace(client: TestClient, token: str) -> int:
    resp = upload(client, synthetic_trace(), token=token, project="p", run="r", rank=3)
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"])


def _post(client: TestClient, trace_id: int, body: bytes, token: str, **headers: str) -> Any:
    return client.post(
        f"/api/v1/traces/{trace_id}/memory-snapshot",
        content=body,
        headers={**OCTET, **bearer(token), **headers},
    )


def test_a_snapshot_is_stored_beside_its_trace_and_downloads_as_sent(
    client: TestClient, app: FastAPI, upload_token: str, read_token: str
) -> None:
    trace_id = _trace(client, upload_token)
    assert (
        client.get(f"/api/v1/traces/{trace_id}", headers=bearer(read_token)).json()["memory_snapshot_url"]
        is None
    )
    body = pickle.dumps(snapshot_shaped())
    resp = _post(client, trace_id, body, upload_token)
    assert resp.status_code == 201, resp.text
    out = resp.json()
    assert out["size_bytes"] == len(body) and out["protocol"] == pickle.DEFAULT_PROTOCOL
    assert out["filename"] == f"p_r_rank3_{trace_id}.memory_snapshot.pickle"
    assert out["viewer"] == "https://pytorch.org/memory_viz"
    url = client.get(f"/api/v1/traces/{trace_id}", headers=bearer(read_token)).json()["memory_snapshot_url"]
    assert url == out["download_url"] == f"/api/v1/traces/{trace_id}/memory-snapshot"
    got = client.get(url, headers=bearer(read_token))
    assert got.status_code == 200 and got.content == body
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["content-disposition"] == f'attachment; filename="{out["filename"]}"'
    assert got.headers["x-content-sha256"] == out["sha256"]
    # the same bytes again: a replay; other bytes: a conflict, the first kept
    assert _post(client, trace_id, body, upload_token).status_code == 200
    other = _post(client, trace_id, pickle.dumps(snapshot_shaped(60)), upload_token)
    assert other.status_code == 409 and "already has a different memory snapshot" in other.text
    assert client.get(url, headers=bearer(read_token)).content == body
    # the trace page links it; the link downloads with the page's cookie
    page = logged_in(app, read_token)
    html = page.get(f"/traces/{trace_id}").text
    assert f'href="/traces/{trace_id}/memory-snapshot"' in html and "https://pytorch.org/memory_viz" in html
    assert page.get(f"/traces/{trace_id}/memory-snapshot").content == body


def test_a_trace_without_a_snapshot_has_no_link_and_404(
    client: TestClient, app: FastAPI, upload_token: str, read_token: str
) -> None:
    trace_id = _trace(client, upload_token)
    resp = client.get(f"/api/v1/traces/{trace_id}/memory-snapshot", headers=bearer(read_token))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    assert "memory-snapshot" not in logged_in(app, read_token).get(f"/traces/{trace_id}").text


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this would run on pickle.load",))


REFUSED = {
    "a class (GLOBAL/REDUCE)": (pickle.dumps({"segments": [], "x": _Evil()}), 422, "not plain data"),
    "an OrderedDict": (pickle.dumps(collections.OrderedDict(a=1)), 422, "not a dict"),
    "a list at the top": (pickle.dumps([snapshot_shaped()]), 422, "not a dict"),
    "protocol 0 (text)": (pickle.dumps(snapshot_shaped(), protocol=0), 422, "pickle header"),
    "JSON": (b'{"segments": [], "device_traces": []}', 422, "pickle header"),
    "cut short": (pickle.dumps(snapshot_shaped())[:-20], 422, "cut short"),
    "bytes after STOP": (pickle.dumps(snapshot_shaped()) + b"\x00junk", 422, "follow its end"),
    "too short": (b"\x80\x04}.", 422, "too short"),
    "a gzip": (gzip.compress(pickle.dumps(snapshot_shaped())), 422, "pickle header"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_is_not_a_data_only_pickle_is_refused_and_nothing_kept(
    client: TestClient, app: FastAPI, upload_token: str, case: str
) -> None:
    trace_id = _trace(client, upload_token)
    rows, files = row_counts(app), store_files(app)
    body, status, words = REFUSED[case]
    resp = _post(client, trace_id, body, upload_token)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == "invalid_memory_snapshot" and words in resp.text
    assert (row_counts(app), store_files(app)) == (rows, files)


def test_wrong_media_other_teams_and_read_tokens_are_refused(
    client: TestClient, app: FastAPI, upload_token: str, read_token: str, make_token: Any
) -> None:
    trace_id = _trace(client, upload_token)
    stranger = make_token("upload", "other-team")
    rows, files = row_counts(app), store_files(app)
    body = pickle.dumps(snapshot_shaped())
    assert (
        _post(client, trace_id, body, upload_token, **{"Content-Type": "application/json"}).status_code == 415
    )
    assert _post(client, trace_id, body, upload_token, **{"Content-Encoding": "gzip"}).status_code == 415
    assert _post(client, trace_id, body, read_token).status_code == 403
    assert _post(client, trace_id + 10_000, body, upload_token).status_code == 404
    assert _post(client, trace_id, body, stranger).status_code == 404  # not yours reads as missing
    assert (row_counts(app), store_files(app)) == (rows, files)


@pytest.fixture
def tight_client(server_settings: Settings, app: FastAPI, admin_token: str) -> Iterator[TestClient]:
    tight = create_app(server_settings.model_copy(update={"max_upload_bytes": 64 * 1024}))
    with TestClient(tight, headers=bearer(admin_token)) as test_client:
        yield test_client
    tight.state.db.dispose()


def test_a_snapshot_over_the_upload_limit_is_413(
    tight_client: TestClient, app: FastAPI, admin_token: str
) -> None:
    trace_id = _trace(tight_client, admin_token)
    rows, files = row_counts(app), store_files(app)
    body = pickle.dumps(snapshot_shaped(5_000))
    assert len(body) > 64 * 1024
    resp = _post(tight_client, trace_id, body, admin_token)
    assert resp.status_code == 413, resp.text
    chunked = tight_client.post(  # no Content-Length: stopped while it streams
        f"/api/v1/traces/{trace_id}/memory-snapshot",
        content=iter([body[i : i + 8192] for i in range(0, len(body), 8192)]),
        headers={**OCTET, **bearer(admin_token)},
    )
    assert chunked.status_code == 413
    assert (row_counts(app), store_files(app)) == (rows, files)
