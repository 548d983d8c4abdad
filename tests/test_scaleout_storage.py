"""The trace store on a real S3 server (SeaweedFS on loopback) and the parser reading streams.

Uploads, downloads, the TensorBoard export and the worker all go through ``TraceStore``; with
``STEPDOCTOR_STORAGE_URL=s3://...`` nothing may touch a local trace directory except the upload's
own stage file, which must be gone once the upload is answered.
"""

from __future__ import annotations

import gzip
import io
import os
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis import parsing as parse
from stepdoctor_server.core.models import Analysis, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.traces.storage import LocalStore, S3Store, StagedFile, make_store
from support.s3 import s3_env, s3_server  # noqa: F401 - fixtures
from support.server import FIXTURE_TRACES, drain, row_counts, synthetic_trace, upload

pytestmark = pytest.mark.usefixtures("s3_env")

RANK0 = FIXTURE_TRACES / "hta" / "trace_filter" / "sampled_rank-0.json.gz"
RANK1 = FIXTURE_TRACES / "hta" / "trace_filter" / "sampled_rank-1.json.gz"


@pytest.fixture
def server_settings(db_url: str, tmp_path: Path, s3_env: str) -> Settings:  # noqa: F811
    """The suite's settings, with traces in a fresh S3 prefix."""
    return Settings(data_dir=tmp_path / "data", database_url=db_url, workers=0, storage_url=s3_env)


def _stage(store: S3Store | LocalStore, data: bytes) -> StagedFile:
    store.temp_dir.mkdir(parents=True, exist_ok=True)
    path = store.temp_dir / f"{os.getpid()}-{os.urandom(16).hex()}.part"
    path.write_bytes(data)
    return StagedFile(temp_path=path, size_bytes=len(data), sha256="")


def test_s3_store_put_stream_delete(server_settings: Settings) -> None:
    store = make_store(server_settings)
    assert isinstance(store, S3Store)
    data = RANK0.read_bytes()
    key = store.new_key(1, ".json.gz")
    staged = _stage(store, data)
    store.commit(staged, key)
    assert not staged.temp_path.exists() and store.exists(key)
    assert store.list_keys() == [key]
    with store.open(key) as reader:  # streamed in pieces, never a local file
        pieces = iter(lambda: reader.read(100_000), b"")
        assert b"".join(pieces) == data
    store.delete(key)
    store.delete(key)  # deleting twice is fine
    assert not store.exists(key) and store.list_keys() == []
    with pytest.raises(FileNotFoundError):
        store.open(key).read(1)


def test_parser_reads_an_object_stream_like_the_file(server_settings: Settings) -> None:
    store = make_store(server_settings)
    key = store.new_key(1, ".json.gz")
    store.commit(_stage(store, RANK1.read_bytes()), key)
    from_file = parse.load_trace(RANK1)
    with store.open(key) as reader:
        from_stream = parse.load_trace(reader, name="rank1.json.gz")
    assert from_stream.source == "rank1.json.gz"
    assert len(from_stream.gpu) == len(from_file.gpu) > 0
    assert len(from_stream.host) == len(from_file.host) > 0
    assert (from_stream.gpu.ts == from_file.gpu.ts).all()


def test_parser_takes_a_stream_returning_short_reads() -> None:
    """Any file-like works, also one whose reads return less than asked (sockets, pipes)."""

    class Trickle(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.buf = io.BytesIO(data)

        def read(self, n: int = -1) -> bytes:
            return self.buf.read(min(n, 777) if n > 0 else 777)

    for path in (RANK0, FIXTURE_TRACES / "hta" / "critical_path" / "simple_add"):
        if path.is_dir():
            path = next(path.glob("*.json.gz"))
        expected = parse.load_trace(path)
        got = parse.load_trace(Trickle(path.read_bytes()), name=path.name)  # type: ignore[arg-type]
        assert len(got.gpu) == len(expected.gpu) and len(got.host) == len(expected.host)


def test_upload_analyse_download_and_export_through_s3(client: TestClient, app: FastAPI) -> None:
    bodies = {0: RANK0.read_bytes(), 1: RANK1.read_bytes()}
    ids = {}
    for rank, body in bodies.items():
        resp = upload(client, body, run="s3run", rank=rank, metadata={"host": "node1"})
        assert resp.status_code == 201, resp.text
        ids[rank] = resp.json()["id"]
    store = app.state.store
    assert isinstance(store, S3Store) and len(store.list_keys()) == 2
    # Nothing stays on the API host: the stage files were uploaded and removed.
    assert list(store.temp_dir.glob("*.part")) == []
    assert drain(app) == 2  # the worker streams each trace from S3
    with app.state.db.session() as session:
        assert {t.status for t in session.query(Trace).all()} == {"done"}
        assert session.query(Analysis).count() == 2
    for rank, trace_id in ids.items():
        resp = client.get(f"/api/v1/traces/{trace_id}/download")
        assert resp.status_code == 200
        assert resp.content == bodies[rank]
        assert resp.headers["content-length"] == str(len(bodies[rank]))
        assert "attachment" in resp.headers["content-disposition"]
    run_id = client.get(f"/api/v1/traces/{ids[0]}").json()["run_id"]
    resp = client.get(f"/api/v1/runs/{run_id}/tensorboard.zip")
    assert resp.status_code == 200
    with zipfile.ZipFile(io.BytesIO(resp.content)) as zf:
        assert sorted(zf.read(n) for n in zf.namelist()) == sorted(bodies.values())


_PLAIN = synthetic_trace(20, compress=False)
_EVENT_3 = b'"ts": 30, "dur": 5'  # the fourth event's times


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (_EVENT_3, b'"ts": NaN, "dur": 5'),
        (b'"aten::op3"', b'"aten::\\ud800"'),
        (_EVENT_3, b'"ts": 1e308, "dur": 5'),
        (b'"pid": 1', b'"pid": ' + b"9" * 30),
    ],
    ids=["nan", "lone-surrogate", "ts-1e308", "pid-30-digits"],
)
def test_a_trace_the_worker_cannot_read_never_reaches_s3(
    client: TestClient, app: FastAPI, old: bytes, new: bytes
) -> None:
    """Refused at the door (422) on the S3 store too: no row, no object, no stage file left; the
    next good upload is stored and analysed."""
    store = app.state.store
    assert isinstance(store, S3Store) and old in _PLAIN
    rows, keys = row_counts(app), store.list_keys()
    refused = upload(client, gzip.compress(_PLAIN.replace(old, new, 1), mtime=0), run="bad")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_trace", refused.text
    assert row_counts(app) == rows and store.list_keys() == keys
    assert [p for p in store.temp_dir.glob("*") if p.is_file()] == []
    good = upload(client, gzip.compress(_PLAIN, mtime=0), run="good")
    assert good.status_code == 201, good.text
    assert drain(app) == 1
    assert client.get(f"/api/v1/traces/{good.json()['id']}").json()["status"] == "done"


def test_presigned_download_redirects_to_the_same_bytes(
    client: TestClient, app: FastAPI, server_settings: Settings
) -> None:
    app.state.store = make_store(server_settings.model_copy(update={"storage_presign_downloads": True}))
    body = RANK0.read_bytes()
    trace_id = upload(client, body, run="presign").json()["id"]
    resp = client.get(f"/api/v1/traces/{trace_id}/download", follow_redirects=False)
    assert resp.status_code == 307
    location = resp.headers["location"]
    assert "X-Amz-Signature=" in location
    assert httpx.get(location, timeout=30).content == body


def test_missing_object_is_410(client: TestClient, app: FastAPI) -> None:
    trace_id = upload(client, RANK0.read_bytes(), run="gone").json()["id"]
    with app.state.db.session() as session:
        key = session.get(Trace, trace_id).storage_key  # type: ignore[union-attr]
    app.state.store.delete(key)
    assert client.get(f"/api/v1/traces/{trace_id}/download").status_code == 410
    drain(app)
    reason = client.get(f"/api/v1/traces/{trace_id}").json()["status_reason"]
    assert reason == "internal error: the trace file is missing from the store"


def test_partial_uploads_of_dead_or_idle_writers_are_removed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "traces")
    store.temp_dir.mkdir(parents=True)
    dead_pid = 2**22 + 12345  # above pid_max on Linux: no such process
    dead = store.temp_dir / f"{dead_pid}-{'a' * 32}.part"
    live = store.temp_dir / f"{os.getpid()}-{'b' * 32}.part"
    idle = store.temp_dir / f"{os.getpid()}-{'c' * 32}.part"
    legacy = store.temp_dir / f"{'d' * 32}.part"  # older name without pid: age decides
    other = store.temp_dir / "notes.txt"
    for path in (dead, live, idle, legacy, other):
        path.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(idle, (old, old))
    assert store.cleanup_partials(max_idle_s=600) == 2
    assert sorted(p.name for p in store.temp_dir.iterdir()) == sorted([live.name, legacy.name, other.name])
