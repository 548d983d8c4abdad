"""Tokens: hashed at rest, scoped, and a team sees only its own objects."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from stepdoctor_server.core.models import Token, utcnow
from support.server import bearer, row_counts, synthetic_trace, upload

READ_ENDPOINTS = [
    "/api/v1/projects",
    "/api/v1/runs",
    "/api/v1/runs/{run_id}",
    "/api/v1/runs/{run_id}/traces",
    "/api/v1/traces/{trace_id}",
    "/api/v1/traces/{trace_id}/download",
]


@pytest.fixture
def uploaded(client: TestClient) -> dict[str, int]:
    created = upload(client, synthetic_trace()).json()
    return {"trace_id": created["id"], "run_id": created["run_id"]}


def test_tokens_are_stored_only_as_sha256(app: FastAPI, admin_token: str) -> None:
    with app.state.db.session() as session:
        stored = session.scalars(select(Token)).all()
    assert stored and all(admin_token not in (t.hash, t.prefix, t.name) for t in stored)
    assert hashlib.sha256(admin_token.encode()).hexdigest() in {t.hash for t in stored}


def test_missing_wrong_and_revoked_tokens_get_401(app: FastAPI, client: TestClient, read_token: str) -> None:
    anonymous = {"Authorization": ""}
    for headers in (anonymous, bearer("sdt_not-a-real-token"), {"Authorization": "Basic dTpw"}):
        response = client.get("/api/v1/runs", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.get("/api/v1/runs", headers=bearer(read_token)).status_code == 200
    with app.state.db.session() as session:
        token = session.scalars(select(Token).where(Token.scope == "read")).one()
        token.revoked_at = utcnow()
    assert client.get("/api/v1/runs", headers=bearer(read_token)).status_code == 401


def test_upload_token_cannot_read(client: TestClient, upload_token: str, uploaded: dict[str, int]) -> None:
    for template in READ_ENDPOINTS:
        response = client.get(template.format(**uploaded), headers=bearer(upload_token))
        assert response.status_code == 403, template
        assert response.json()["error"]["code"] == "forbidden"


def test_read_token_cannot_upload(app: FastAPI, client: TestClient, read_token: str) -> None:
    before = row_counts(app)
    response = upload(client, synthetic_trace(), token=read_token)
    assert response.status_code == 403
    assert row_counts(app) == before


def test_other_teams_objects_answer_404(
    client: TestClient, make_token: Callable[..., str], uploaded: dict[str, int]
) -> None:
    outsider = make_token("admin", team_name="other-team")
    for template in READ_ENDPOINTS[2:]:
        response = client.get(template.format(**uploaded), headers=bearer(outsider))
        assert response.status_code == 404, template
        assert response.json()["error"]["code"] == "not_found"
    assert client.get("/api/v1/runs", headers=bearer(outsider)).json()["items"] == []
    assert client.get("/api/v1/projects", headers=bearer(outsider)).json()["items"] == []
    # The same project/run names in another team are a different project and run.
    theirs = upload(client, synthetic_trace(), token=outsider).json()
    assert theirs["run_id"] != uploaded["run_id"]


def test_idempotency_keys_are_per_team(client: TestClient, make_token: Callable[..., str]) -> None:
    outsider = make_token("upload", team_name="other-team")
    mine = upload(client, synthetic_trace(), idempotency_key="k1")
    theirs = upload(client, synthetic_trace(), idempotency_key="k1", token=outsider)
    assert mine.status_code == theirs.status_code == 201
    assert mine.json()["id"] != theirs.json()["id"]


def test_only_health_needs_no_token(app: FastAPI, read_token: str, admin_token: str) -> None:
    with TestClient(app) as anonymous:
        assert anonymous.get("/healthz").json() == {"status": "ok"}
        assert anonymous.get("/readyz").json() == {"status": "ok"}
        assert anonymous.get("/api/v1/runs").status_code == 401
        # Metrics count every team's traces: an admin token, as Prometheus' bearer_token sends it.
        assert anonymous.get("/metrics").status_code == 401
        assert anonymous.get("/metrics", headers=bearer(read_token)).status_code == 403
        assert anonymous.get("/metrics", headers=bearer(admin_token)).status_code == 200
