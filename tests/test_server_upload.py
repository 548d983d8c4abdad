"""Upload protocol: streaming store, idempotent replay, project/run creation, download."""

from __future__ import annotations

import gzip
import hashlib
import json
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from stepdoctor_server.core.models import Project, Run, Trace
from support.server import (
    row_counts,
    small_trace_bytes,
    store_analysis,
    store_files,
    synthetic_trace,
    upload,
)


def _trace_row(app: FastAPI, trace_id: int) -> Trace:
    with app.state.db.session() as session:
        trace = session.get(Trace, trace_id)
        assert trace is not None
        return trace


def test_upload_stores_original_bytes_and_pending_row(
    app: FastAPI, client: TestClient, upload_token: str
) -> None:
    body = small_trace_bytes()
    metadata = {
        "rank": 3,
        "world_size": 8,
        "tags": ["bs256", "amp"],
        "window": {"index": 2, "first_step": 10, "last_step": 14},
    }
    response = upload(
        client, body, token=upload_token, project="resnet", run="bs256", rank=3, metadata=metadata
    )

    assert response.status_code == 201, response.text
    created = response.json()
    assert set(created) == {"id", "run_id", "status"} and created["status"] == "pending"
    trace = _trace_row(app, created["id"])
    assert trace.run_id == created["run_id"]
    assert (trace.rank, trace.window_index, trace.first_step, trace.last_step) == (3, 2, 10, 14)
    assert trace.size_bytes == len(body)
    assert trace.sha256 == hashlib.sha256(body).hexdigest()
    assert trace.meta["world_size"] == 8
    assert app.state.store.path(trace.storage_key).read_bytes() == body
    assert not any(name.startswith("tmp/") and name.endswith(".part") for name in store_files(app))
    with app.state.db.session() as session:
        run = session.get(Run, trace.run_id)
        assert run is not None and run.tags == ["bs256", "amp"]
        project = session.get(Project, run.project_id)
        assert project is not None and project.name == "resnet" and run.name == "bs256"


def test_replay_with_same_idempotency_key_returns_same_trace(app: FastAPI, client: TestClient) -> None:
    key = uuid.uuid4().hex
    first = upload(client, synthetic_trace(), idempotency_key=key)
    rows, files = row_counts(app), store_files(app)
    replay = upload(client, synthetic_trace(), idempotency_key=key)

    assert first.status_code == 201 and replay.status_code == 200
    assert replay.json() == first.json()
    assert row_counts(app) == rows and store_files(app) == files
    other = upload(client, synthetic_trace(), idempotency_key=uuid.uuid4().hex)
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


def test_concurrent_first_uploads_share_project_and_run(app: FastAPI, client: TestClient) -> None:
    """Ranks of a new run upload at once: one project, one run, every trace kept."""
    body = synthetic_trace(200)
    with ThreadPoolExecutor(max_workers=6) as pool:
        responses = list(
            pool.map(lambda r: upload(client, body, project="ddp", run="job1", rank=r), range(6))
        )

    assert [r.status_code for r in responses] == [201] * 6
    assert len({r.json()["run_id"] for r in responses}) == 1
    with app.state.db.session() as session:
        ranks = sorted(t.rank for t in session.scalars(select(Trace)))
        assert ranks == list(range(6))
        assert len(session.scalars(select(Run)).all()) == 1


def test_concurrent_replays_store_one_trace(app: FastAPI, client: TestClient) -> None:
    key = uuid.uuid4().hex
    body = synthetic_trace(100)
    with ThreadPoolExecutor(max_workers=4) as pool:
        responses = list(pool.map(lambda _: upload(client, body, idempotency_key=key), range(4)))

    assert sorted(r.status_code for r in responses) == [200, 200, 200, 201]
    assert len({r.json()["id"] for r in responses}) == 1
    assert row_counts(app)["traces"] == 1
    assert len([f for f in store_files(app) if not f.startswith("tmp/")]) == 1


def test_plain_json_and_metadata_query_param_are_accepted(app: FastAPI, client: TestClient) -> None:
    raw = synthetic_trace(5, compress=False)
    response = client.post(
        "/api/v1/traces",
        params={"project": "p", "run": "r", "metadata": json.dumps({"tags": ["nightly"], "rank": 1})},
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 201, response.text
    trace = _trace_row(app, response.json()["id"])
    assert trace.rank == 1 and trace.filename.endswith(".pt.trace.json")
    assert app.state.store.path(trace.storage_key).read_bytes() == raw
    run = client.get(f"/api/v1/runs/{trace.run_id}").json()
    assert run["tags"] == ["nightly"]


def test_gzip_magic_is_sniffed_without_content_encoding(app: FastAPI, client: TestClient) -> None:
    body = synthetic_trace(5)
    response = upload(client, body, gzipped=False)
    assert response.status_code == 201
    assert _trace_row(app, response.json()["id"]).filename.endswith(".pt.trace.json.gz")


def test_tags_accumulate_on_the_run(client: TestClient) -> None:
    first = upload(client, synthetic_trace(), rank=0, metadata={"tags": ["a", "b"]})
    upload(client, synthetic_trace(), rank=1, metadata={"tags": {"gpu": "a100"}})
    run = client.get(f"/api/v1/runs/{first.json()['run_id']}").json()
    assert run["tags"] == ["a", "b", "gpu=a100"]


def test_download_returns_original_bytes_with_viewer_filename(client: TestClient, read_token: str) -> None:
    body = small_trace_bytes()
    created = upload(client, body, project="bert", run="lr-3e4", rank=7).json()

    response = client.get(
        f"/api/v1/traces/{created['id']}/download", headers={"Authorization": f"Bearer {read_token}"}
    )

    assert response.status_code == 200
    assert response.content == body
    assert response.headers["x-content-sha256"] == hashlib.sha256(body).hexdigest()
    disposition = response.headers["content-disposition"]
    assert f'filename="bert_lr-3e4_rank7_{created["id"]}.pt.trace.json.gz"' in disposition
    events = json.loads(gzip.decompress(response.content))["traceEvents"]
    assert isinstance(events, list) and events


def test_trace_status_includes_analysis_when_done(app: FastAPI, client: TestClient) -> None:
    created = upload(client, synthetic_trace()).json()
    pending = client.get(f"/api/v1/traces/{created['id']}").json()
    assert pending["status"] == "pending" and pending["analysis"] is None

    report = {"schema_version": 1, "primary": {"kind": "input", "share": 0.6}}
    # The current engine's report (store_analysis's default): an older one would be redone.
    store_analysis(app, created["id"], report, primary_kind="input", primary_share=0.6, duration_ms=5)
    done = client.get(f"/api/v1/traces/{created['id']}").json()
    assert done["status"] == "done"
    assert done["analysis"]["report"] == report and done["primary_kind"] == "input"
