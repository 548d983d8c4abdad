"""Step-series upload on the server: stored once, read back as the engine's run timeline, bad
chunks refused with nothing kept (``POST /api/v1/series``, ``runs/series.py``)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.run.timeline import MEMORY_COLUMNS, run_timeline
from support.series_chunks import chunk, padded, with_header
from support.server import bearer, logged_in, row_counts, synthetic_trace, upload


def send(client: TestClient, data: bytes, token: str, *, project: str = "proj", run: str = "run1") -> Any:
    return client.post(
        "/api/v1/series",
        params={"project": project, "run": run},
        content=data,
        headers={**bearer(token), "Content-Type": "application/octet-stream"},
    )


def test_a_runs_chunks_are_stored_and_read_back_as_the_engines_timeline(
    app: FastAPI, client: TestClient, upload_token: str, read_token: str
) -> None:
    window = {"first_step": 102, "last_step": 104, "reason": "schedule"}
    sent = [
        chunk("a1", 0, 0, 100),
        chunk("a1", 1, 100, 100, profiled=[[100, 104]], windows=[window]),
        chunk("a1", 2, 200, 100),
        chunk("a1", 3, 300, 0, final=True),
    ]
    for data in sent[::-1]:  # any order: chunks of one process may arrive out of order after retries
        answer = send(client, data, upload_token)
        assert answer.status_code == 201, answer.text
    run_id = answer.json()["run_id"]
    detail = client.get(f"/api/v1/runs/{run_id}", headers=bearer(read_token))
    assert detail.status_code == 200, detail.text
    body = detail.json()
    assert body["run_timeline"] == run_timeline(sent).to_dict()
    assert body["run_timeline"]["steps"] == 300 and body["run_timeline"]["missing_steps"] == 0
    assert body["run_timeline"]["windows"] == [window]
    assert body["liveness"] == "finished"
    # the run lists and the run page say so; a run without a series says nothing
    assert send(client, chunk("z1", 0, 0, 10), upload_token, run="live").status_code == 201
    assert upload(client, synthetic_trace(), project="proj", run="traces-only").status_code == 201
    with logged_in(app, read_token) as page:
        listing = page.get("/runs").text
        assert "traces-only" in listing and listing.count('class="liveness ') == 2
        assert listing.count('class="liveness finished"') == 1 and listing.count('class="liveness live"') == 1
        finished = page.get(f"/runs/{run_id}").text
        assert 'id="liveness"' in finished and 'http-equiv="refresh"' not in finished
        live_id = next(r["id"] for r in client.get("/api/v1/runs").json()["items"] if r["name"] == "live")
        live = page.get(f"/runs/{live_id}").text  # follows the run: reloads while it is live
        assert '<meta http-equiv="refresh" content="30">' in live and "The run is live" in live


def test_the_same_chunk_twice_is_stored_once(app: FastAPI, client: TestClient, upload_token: str) -> None:
    data = chunk("b1", 0, 0, 50)
    first = send(client, data, upload_token)
    rows = row_counts(app)
    again = send(client, data, upload_token)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == {**first.json(), "replay": True}
    assert row_counts(app) == rows and rows["series_chunks"] == 1


def _nan(data: bytes) -> bytes:
    return with_header(data, t_end=math.nan)


BAD = {
    "not finite": (lambda: _nan(chunk("c1", 0, 0, 10)), 422, "not a finite number"),
    "steps go back": (lambda: chunk("c1", 0, 0, 10, mem_steps=[5, 3]), 422, "increasing steps"),
    "ranges go back": (lambda: chunk("c1", 0, 0, 10, profiled=[[6, 7], [2, 3]]), 422, "increasing order"),
    "not a chunk": (lambda: b"{}", 422, "bad magic bytes"),
    # a column entry without its length (the engine unpacked it and raised ValueError: a 500)
    "short column": (
        lambda: with_header(
            chunk("c1", 0, 0, 10),
            columns=[["wall_ns", "<i8"], ["data_ns", "<i8", 10]] + [[c, "<i8", 1] for c in MEMORY_COLUMNS],
        ),
        422,
        "[name, dtype, length]",
    ),
    "oversized": (lambda: padded(chunk("c1", 0, 0, 10), 5000), 413, "size limit of 4096 bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_chunk_is_refused_naming_the_problem_and_nothing_is_kept(
    app: FastAPI, client: TestClient, upload_token: str, case: str
) -> None:
    app.state.settings.max_series_chunk_bytes = 4096
    make, status, words = BAD[case]
    rows = row_counts(app)
    answer = send(client, make(), upload_token, project="fresh", run="new")
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]
    assert row_counts(app) == rows  # not even the project or the run


def test_a_chunk_overlapping_a_stored_one_is_refused(
    app: FastAPI, client: TestClient, upload_token: str
) -> None:
    assert send(client, chunk("d1", 0, 0, 100), upload_token).status_code == 201
    rows = row_counts(app)
    for data in (chunk("d1", 1, 50, 100), chunk("d1", 0, 0, 100, wall_ms=30.0)):
        answer = send(client, data, upload_token)
        assert answer.status_code == 422, answer.text
        assert "steps 0-99" in answer.json()["error"]["message"]
    assert row_counts(app) == rows
    # another process of the run (a restart numbers its steps from 0 again) is no overlap
    assert send(client, chunk("d2", 0, 0, 100), upload_token).status_code == 201


def test_a_read_token_cannot_upload_a_chunk(app: FastAPI, client: TestClient, read_token: str) -> None:
    rows = row_counts(app)
    assert send(client, chunk("e1", 0, 0, 10), read_token).status_code == 403
    assert row_counts(app) == rows


def test_a_kept_timeline_is_shown_while_the_sweep_redoes_it_and_a_get_never_writes_it(
    app: FastAPI, client: TestClient, upload_token: str, read_token: str
) -> None:
    """The page and API never wait for a live run's timeline to be redone: they show the kept one
    and the ``refresh_run_timelines`` sweep (a job) redoes it once older than
    ``run_timeline_refresh_s``; the exact answer (``check``, regressions: ``fresh_within_s=0``) is
    computed when asked. A GET only reads: ``run_timelines`` is left as it was."""
    from sqlalchemy import select, update

    from stepdoctor_server.core.models import RunTimelineCache, utcnow
    from stepdoctor_server.runs.series import refresh_run_timelines, run_timeline_of

    db = app.state.db
    db.settings.run_timeline_refresh_s = 30.0

    def kept() -> list[tuple[int, str, Any]]:
        with db.session(read_only=True) as session:
            rows = session.execute(
                select(RunTimelineCache.run_id, RunTimelineCache.basis, RunTimelineCache.updated_at)
            )
            return [tuple(row) for row in rows]

    def shown() -> int:
        """The API's steps, asserting that the GET left ``run_timelines`` as it was."""
        before = kept()
        steps = client.get(f"/api/v1/runs/{run_id}", headers=read).json()["run_timeline"]["steps"]
        assert kept() == before, "a GET wrote the kept run timeline"
        return int(steps)

    run_id = send(client, chunk("f1", 0, 0, 100), upload_token).json()["run_id"]
    read = bearer(read_token)
    assert shown() == 100 and kept() == []  # computed for the answer, not kept by the GET
    assert refresh_run_timelines(db) == [run_id] and len(kept()) == 1  # the sweep keeps it
    assert send(client, chunk("f1", 1, 100, 100), upload_token).status_code == 201
    assert shown() == 100  # the kept one, at once
    assert refresh_run_timelines(db) == []  # younger than run_timeline_refresh_s: left as it is
    assert shown() == 100
    with db.session() as session:  # as if it were kept an hour ago
        session.execute(
            update(RunTimelineCache)
            .where(RunTimelineCache.run_id == run_id)
            .values(updated_at=utcnow() - timedelta(hours=1))
        )
    assert refresh_run_timelines(db) == [run_id]
    assert shown() == 200
    assert refresh_run_timelines(db) == []  # current: nothing to redo
    assert send(client, chunk("f1", 2, 200, 100), upload_token).status_code == 201
    before = kept()
    with db.session(read_only=True) as session:  # exact, as a GET's check asks: computed, not kept
        exact = run_timeline_of(session, run_id)
        assert exact is not None and exact.steps == 300
    assert kept() == before
