"""Catalog: projects, runs (filters, sorts, keyset pages) and a run's traces."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis import ENGINE_VERSION
from stepdoctor_server.core.models import Project, Run
from support.server import TeamInfo, synthetic_trace, upload

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
KINDS = ["input", "compute", "memory"]


@pytest.fixture
def runs(app: FastAPI, team: TeamInfo) -> list[dict[str, Any]]:
    """25 runs in two projects with known timestamps, tags and kinds (inserted directly)."""
    made: list[dict[str, Any]] = []
    with app.state.db.session() as session:
        projects = [Project(team_id=team.id, name=name) for name in ("alpha", "beta")]
        session.add_all(projects)
        session.flush()
        for i in range(25):
            # Pairs share created_at so ties are broken by id.
            created = T0 + timedelta(hours=i // 2)
            run = Run(
                project_id=projects[i % 2].id,
                name=f"run-{i:02d}",
                tags=["even"] if i % 2 == 0 else ["odd", f"t{i}"],
                created_at=created,
                updated_at=created + timedelta(minutes=25 - i),
                primary_kind=KINDS[i % 3],
            )
            session.add(run)
            session.flush()
            made.append(
                {
                    "id": run.id,
                    "name": run.name,
                    "created_at": created,
                    "updated_at": run.updated_at,
                    "project": projects[i % 2].name,
                    "tags": run.tags,
                    "kind": run.primary_kind,
                }
            )
    return made


def _walk(client: TestClient, query: str, limit: int) -> list[int]:
    ids: list[int] = []
    cursor = None
    for _ in range(100):
        params = f"{query}&limit={limit}" + (f"&cursor={cursor}" if cursor else "")
        page = client.get(f"/api/v1/runs?{params}")
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["items"]) <= limit
        ids += [item["id"] for item in body["items"]]
        cursor = body["next"]
        if cursor is None:
            return ids
    raise AssertionError("pagination did not end")


@pytest.mark.parametrize("sort", ["-created_at", "created_at", "updated_at", "-updated_at", "name", "-name"])
def test_pages_cover_every_run_once_in_sort_order(
    client: TestClient, runs: list[dict[str, Any]], sort: str
) -> None:
    key = sort.lstrip("-")
    expected = [r["id"] for r in sorted(runs, key=lambda r: (r[key], r["id"]), reverse=sort.startswith("-"))]
    assert _walk(client, f"sort={sort}", limit=7) == expected


def test_filters(client: TestClient, runs: list[dict[str, Any]]) -> None:
    def ids(query: str) -> set[int]:
        return set(_walk(client, query, limit=50))

    assert ids("project=alpha") == {r["id"] for r in runs if r["project"] == "alpha"}
    assert ids("tag=even") == {r["id"] for r in runs if "even" in r["tags"]}
    assert ids("tag=t7") == {r["id"] for r in runs if "t7" in r["tags"]}
    assert ids("tag=missing") == set()
    assert ids("primary_kind=memory") == {r["id"] for r in runs if r["kind"] == "memory"}
    since, until = T0 + timedelta(hours=3), T0 + timedelta(hours=6)
    window = f"since={since.isoformat().replace('+', '%2B')}&until={until.isoformat().replace('+', '%2B')}"
    assert ids(window) == {r["id"] for r in runs if since <= r["created_at"] < until}
    assert ids(f"project=beta&tag=odd&{window}") == {
        r["id"] for r in runs if r["project"] == "beta" and since <= r["created_at"] < until
    }


def test_cursor_is_bound_to_its_sort(client: TestClient, runs: list[dict[str, Any]]) -> None:
    cursor = client.get("/api/v1/runs?sort=name&limit=3").json()["next"]
    assert cursor
    response = client.get(f"/api/v1/runs?sort=-created_at&cursor={cursor}")
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_cursor"


def test_projects_list_counts_runs(client: TestClient, runs: list[dict[str, Any]]) -> None:
    body = client.get("/api/v1/projects").json()
    assert [(p["name"], p["run_count"]) for p in body["items"]] == [("alpha", 13), ("beta", 12)]
    first = client.get("/api/v1/projects?limit=1").json()
    second = client.get(f"/api/v1/projects?limit=1&cursor={first['next']}").json()
    assert [p["name"] for p in first["items"] + second["items"]] == ["alpha", "beta"]
    assert second["next"] is None


def test_run_detail_carries_diagnosis_and_trace_counts(app: FastAPI, client: TestClient) -> None:
    created = [upload(client, synthetic_trace(), rank=r).json() for r in range(3)]
    run_id = created[0]["run_id"]
    diagnosis = {"primary": {"kind": "input", "share": 0.4}, "ranks": 3}
    with app.state.db.session() as session:
        run = session.get(Run, run_id)
        assert run is not None
        run.diagnosis, run.primary_kind, run.diagnosis_engine_version = diagnosis, "input", ENGINE_VERSION

    detail = client.get(f"/api/v1/runs/{run_id}").json()
    assert detail["diagnosis"] == diagnosis and detail["primary_kind"] == "input"
    assert detail["trace_status"] == {"pending": 3} and detail["trace_count"] == 3

    page1 = client.get(f"/api/v1/runs/{run_id}/traces?limit=2").json()
    page2 = client.get(f"/api/v1/runs/{run_id}/traces?limit=2&cursor={page1['next']}").json()
    listed = page1["items"] + page2["items"]
    assert [t["id"] for t in listed] == [c["id"] for c in created]
    assert [t["rank"] for t in listed] == [0, 1, 2] and page2["next"] is None


def test_unknown_run_is_404(client: TestClient) -> None:
    response = client.get("/api/v1/runs/999999")
    assert response.status_code == 404
    assert response.json() == {"error": {"code": "not_found", "message": "run 999999 not found"}}
