"""A trace's memory snapshot in the S3 trace store (SeaweedFS on loopback): stored as its own object beside
the trace, streamed back as the same bytes, 410 when the object is gone, no local file left behind."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.models import MemorySnapshot, Trace
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.traces.storage import S3Store
from support.memory_snapshots import snapshot_shaped
from support.s3 import s3_env, s3_server  # noqa: F401 - fixtures
from support.server import synthetic_trace, upload

pytestmark = pytest.mark.usefixtures("s3_env")


@pytest.fixture
def server_settings(db_url: str, tmp_path: Path, s3_env: str) -> Settings:  # noqa: F811
    """The suite's settings, with traces in a fresh S3 prefix."""
    return Settings(data_dir=tmp_path / "data", database_url=db_url, workers=0, storage_url=s3_env)


def test_a_snapshot_is_an_object_beside_its_trace_and_streams_back(client: TestClient, app: FastAPI) -> None:
    store = app.state.store
    assert isinstance(store, S3Store)
    trace_id = upload(client, synthetic_trace(), run="s3").json()["id"]
    body = pickle.dumps(snapshot_shaped(2_000))
    sent = client.post(
        f"/api/v1/traces/{trace_id}/memory-snapshot",
        content=body,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert sent.status_code == 201, sent.text
    with app.state.db.session() as session:
        trace = session.get(Trace, trace_id)
        snapshot = session.query(MemorySnapshot).filter_by(trace_id=trace_id).one()
        assert trace is not None
        keys = (trace.storage_key, snapshot.storage_key)
    assert set(keys) <= set(store.list_keys()) and keys[1].endswith(".snapshot.pickle")
    assert not [p for p in store.temp_dir.glob("*") if p.is_file()]  # the stage file went to S3
    got = client.get(f"/api/v1/traces/{trace_id}/memory-snapshot")
    assert got.status_code == 200 and got.content == body
    assert got.headers["content-type"] == "application/octet-stream"
    assert (
        got.headers["content-disposition"]
        == f'attachment; filename="proj_s3_rank0_{trace_id}.memory_snapshot.pickle"'
    )
    store.delete(keys[1])
    assert client.get(f"/api/v1/traces/{trace_id}/memory-snapshot").status_code == 410
