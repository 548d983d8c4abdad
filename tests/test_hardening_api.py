"""Hardening of the REST API (#12), on SQLite and PostgreSQL: ids, dates, cursors, tags,
idempotency, re-analysis scope and priority, report privacy, token expiry and revocation."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, text, update
from sqlalchemy.exc import ProgrammingError

from stepdoctor_server import cli
from stepdoctor_server.core.models import Token, Trace, utcnow
from stepdoctor_server.core.settings import get_settings
from stepdoctor_server.jobs.claims import REANALYSIS_PRIORITY, claim_row
from support.server import bearer, drain, row_counts, store_analysis, store_files, synthetic_trace, upload

BIG_IDS = (0, -1, 2**31, 2**31 + 5, 2**63 - 1, 2**63, 2**64)


def _uploaded(client: TestClient, run: str = "r1", **kwargs: object) -> dict[str, int]:
    response = upload(client, synthetic_trace(5), run=run, **kwargs)  # type: ignore[arg-type,unused-ignore]
    assert response.status_code == 201, response.text
    return dict(response.json())


def _id_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path template) of every API route with an id in its path (from the OpenAPI)."""
    routes = []
    for path, operations in app.openapi()["paths"].items():
        if "{" in path:
            routes += [(method.upper(), path) for method in operations]
    return routes


def test_out_of_range_ids_are_404_on_every_id_route(app: FastAPI, client: TestClient) -> None:
    _uploaded(client)
    routes = _id_routes(app)
    assert len(routes) >= 8  # traces, runs, reanalyze, deep, downloads...
    for method, template in routes:
        for ident in BIG_IDS:
            path = template.split("{")[0] + str(ident) + template.split("}", 1)[1]
            response = client.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["error"]["code"] == "not_found"
    for base, other in ((2**31, 1), (1, 2**63), (2**64, 2**64)):
        response = client.get(f"/api/v1/compare?base={base}&other={other}")
        assert response.status_code == 404, response.text


def test_out_of_range_ids_are_404_on_dashboard_pages(app: FastAPI, read_token: str) -> None:
    with TestClient(app) as browser:
        login = browser.post("/login", data={"token": read_token, "next": "/"}, follow_redirects=False)
        assert login.status_code == 303
        for page in ("/runs/{}", "/traces/{}", "/projects/{}", "/compare?base={}&other=1"):
            for ident in (2**31, 2**63, 2**64):
                response = browser.get(page.format(ident))
                assert response.status_code == 404, (page, ident, response.status_code)


def _cursor(*parts: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(parts)).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "query",
    [
        "since=0001-01-01T00:00:00%2B05:00",
        "until=9999-12-31T23:59:59-05:00",
        "tag=a%00b",
        "tag=x%0A",
        "cursor=" + _cursor("-created_at", "2026-01-01T00:00:00+00:00", 2**63),
        "cursor=" + _cursor("-created_at", "2026-01-01T00:00:00+00:00", -5),
        "cursor=" + _cursor("-created_at", "0001-01-01T00:00:00+05:00", 1),
        "sort=name&cursor=" + _cursor("name", "a\u0000b", 1),
        "sort=name&cursor=" + _cursor("name", 12, 1),
    ],
)
def test_edge_filters_and_forged_cursors_are_422(client: TestClient, query: str) -> None:
    _uploaded(client, metadata={"tags": ["ok"]})
    response = client.get(f"/api/v1/runs?{query}")
    # A NUL is refused for every URL (400) before the route; the rest by the route's checks (422).
    assert response.status_code == (400 if "%00" in query else 422), response.text
    assert response.json()["error"]["code"] in {"invalid_request", "invalid_cursor"}
    assert client.get("/api/v1/runs?tag=ok").json()["items"]  # the filter itself still works


def test_projects_cursor_out_of_range_is_422(client: TestClient) -> None:
    response = client.get("/api/v1/projects?cursor=" + _cursor("name", "p", 2**40))
    assert response.status_code == 422


# -- idempotency ---------------------------------------------------------------------------------


def test_reused_idempotency_key_with_another_request_is_422(app: FastAPI, client: TestClient) -> None:
    body = synthetic_trace(5)
    first = upload(client, body, idempotency_key="k-1")
    assert first.status_code == 201
    assert upload(client, body, idempotency_key="k-1").status_code == 200  # a true replay
    before_rows, before_files = row_counts(app), store_files(app)
    for kwargs in (
        {"body": synthetic_trace(6)},  # another body
        {"body": body, "run": "other-run"},
        {"body": body, "project": "other-project"},
        {"body": body, "rank": 3},
    ):
        sent = dict(kwargs)
        response = upload(client, sent.pop("body"), idempotency_key="k-1", **sent)  # type: ignore[arg-type,unused-ignore]
        assert response.status_code == 422, (kwargs, response.text)
        assert response.json()["error"]["code"] == "idempotency_key_reused"
    assert row_counts(app) == before_rows and store_files(app) == before_files


# -- re-analysis: admin only, behind fresh uploads ----------------------------------------------


def test_reanalysis_needs_admin_and_waits_behind_fresh_uploads(
    app: FastAPI, client: TestClient, upload_token: str, make_token: Callable[..., str]
) -> None:
    old = [_uploaded(client, run="old") for _ in range(3)]
    run_id = old[0]["run_id"]
    with app.state.db.session() as session:  # as if analysed long ago
        session.execute(update(Trace).values(status="done"))
    for path in (f"/api/v1/runs/{run_id}/reanalyze", f"/api/v1/traces/{old[0]['id']}/reanalyze"):
        refused = client.post(path, headers=bearer(upload_token))
        assert refused.status_code == 403, refused.text
    assert client.post(f"/api/v1/runs/{run_id}/reanalyze").status_code == 202

    other_team = make_token("upload", "another-team")
    fresh = upload(client, synthetic_trace(5), token=other_team, run="fresh")
    assert fresh.status_code == 201
    postgres = app.state.settings.database_url.get_secret_value().startswith("postgresql")
    with app.state.db.session() as session:
        first = claim_row(session, Trace, "test:1:0", postgres=postgres)
    assert first == fresh.json()["id"]  # the newest trace, yet first: the backlog waits


@pytest.mark.only_db("postgresql")  # procrastinate runs on PostgreSQL only
def test_reanalysis_jobs_are_deferred_behind_uploads_in_procrastinate(
    app: FastAPI, client: TestClient
) -> None:
    """On PostgreSQL the job engine is procrastinate: it fetches higher ``priority`` first."""
    jobs_of = text("SELECT priority FROM procrastinate_jobs WHERE args->>'trace_id' = :id ORDER BY id")
    trace = _uploaded(client)
    with app.state.db.session() as session:
        try:
            fresh = session.execute(jobs_of, {"id": str(trace["id"])}).scalars().all()
        except ProgrammingError:
            pytest.skip("this database has no procrastinate schema")
        session.execute(text("UPDATE procrastinate_jobs SET status = 'succeeded'"))
        session.execute(update(Trace).values(status="done"))
    assert fresh == [0]
    assert client.post(f"/api/v1/traces/{trace['id']}/reanalyze").status_code == 202
    with app.state.db.session() as session:
        assert session.execute(jobs_of, {"id": str(trace["id"])}).scalars().all() == [0, REANALYSIS_PRIORITY]


@pytest.mark.only_db("postgresql")  # procrastinate runs on PostgreSQL only
def test_a_flooding_team_does_not_delay_another_teams_upload_in_procrastinate(
    app: FastAPI, client: TestClient, make_token: Callable[..., str]
) -> None:
    """procrastinate's own fetch function hands out a quiet team's upload right after the flood's
    first job, not after the whole backlog; a re-analysis comes after every upload."""
    with app.state.db.session() as session:
        session.execute(text("UPDATE procrastinate_jobs SET status = 'succeeded' WHERE status = 'todo'"))
        session.execute(update(Trace).values(status="done"))
    flood = [_uploaded(client, run="flood")["id"] for _ in range(5)]
    quiet = upload(client, synthetic_trace(5), token=make_token("upload", "quiet-team"), run="one")
    order = []
    with app.state.db.session() as session:
        worker = session.execute(
            text("INSERT INTO procrastinate_workers DEFAULT VALUES RETURNING id")
        ).scalar()
        fetch = text("SELECT id, args FROM procrastinate_fetch_job_v2(ARRAY['analysis']::varchar[], :w)")
        while (row := session.execute(fetch, {"w": worker}).one()).id is not None:
            order.append(int(row.args["trace_id"]))
        session.rollback()  # leave the jobs as they were for the other tests
    assert order[:2] == [flood[0], quiet.json()["id"]]
    assert order[2:] == flood[1:]


def test_a_flooding_team_does_not_delay_another_teams_upload(
    app: FastAPI, client: TestClient, make_token: Callable[..., str]
) -> None:
    flood = [_uploaded(client, run="flood")["id"] for _ in range(6)]
    postgres = app.state.settings.database_url.get_secret_value().startswith("postgresql")
    with app.state.db.session() as session:
        assert claim_row(session, Trace, "w:1", postgres=postgres) == flood[0]  # the flood runs
    other = upload(client, synthetic_trace(5), token=make_token("upload", "quiet-team"), run="one")
    with app.state.db.session() as session:
        second = claim_row(session, Trace, "w:2", postgres=postgres)
        third = claim_row(session, Trace, "w:3", postgres=postgres)
    assert second == other.json()["id"]  # the newest trace, but its team had nothing running
    assert third == flood[1]  # then the flood again, oldest first


# -- privacy -------------------------------------------------------------------------------------


def test_report_source_is_the_file_name_never_a_server_path(app: FastAPI, client: TestClient) -> None:
    trace = _uploaded(client)
    server_path = str(app.state.settings.traces_dir / "team1" / "2026-11" / "abc.json.gz")
    filename = store_analysis(app, trace["id"], {"source": server_path, "primary": {}}, engine_version="x")
    for path, pick in (
        (f"/api/v1/traces/{trace['id']}", lambda j: j["analysis"]["report"]),
        (f"/api/v1/traces/{trace['id']}/report", lambda j: j["report"]),
    ):
        response = client.get(path)
        assert response.status_code == 200
        assert pick(response.json())["source"] == filename
        assert str(app.state.settings.data_dir) not in response.text


def test_ratio_bomb_is_refused_before_the_decompressed_cap(app: FastAPI, client: TestClient) -> None:
    raw = b'{"traceEvents": [{"ph": "i"},' + b" " * (48 << 20) + b"]}"
    body = gzip.compress(raw, 9)
    before_rows, before_files = row_counts(app), store_files(app)
    response = upload(client, body)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "implausible_compression"
    assert row_counts(app) == before_rows and store_files(app) == before_files


# -- tokens --------------------------------------------------------------------------------------


def test_expired_and_revoked_tokens_are_refused(app: FastAPI, client: TestClient, read_token: str) -> None:
    assert client.get("/api/v1/runs", headers=bearer(read_token)).status_code == 200
    with app.state.db.session() as session:
        session.execute(update(Token).where(Token.scope == "read").values(expires_at=utcnow() - timedelta(1)))
    expired = client.get("/api/v1/runs", headers=bearer(read_token))
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]


@pytest.fixture
def cli_env(server_settings: object, monkeypatch: pytest.MonkeyPatch, app: FastAPI) -> Iterator[None]:
    """The CLI (which reads the environment) on the test database."""
    monkeypatch.setenv("STEPDOCTOR_DATA_DIR", str(app.state.settings.data_dir))
    monkeypatch.setenv("STEPDOCTOR_DATABASE_URL", app.state.settings.database_url.get_secret_value())
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_token_create_expiry_list_last_use_and_revoke(
    app: FastAPI, cli_env: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert (
        cli.main(
            ["token", "create", "--team", "ops", "--create-team", "--scope", "read", "--expires-in", "30d"]
        )
        == 0
    )
    out = capsys.readouterr().out
    token = out.strip().splitlines()[-1]
    assert "valid until" in out
    with app.state.db.session() as session:
        row = session.scalars(select(Token).where(Token.prefix == token[:10])).one()
        token_id = row.id
        assert row.expires_at is not None and row.last_used_at is None
    with TestClient(app) as anyone:
        assert anyone.get("/api/v1/runs", headers=bearer(token)).status_code == 200
        assert cli.main(["token", "list", "--team", "ops"]) == 0
        listing = capsys.readouterr().out
        assert "EXPIRES" in listing and "LAST USED" in listing and "active" in listing
        line = next(x for x in listing.splitlines() if x.strip().startswith(str(token_id)))
        assert line.count(utcnow().strftime("%Y-%m-%d")) == 2  # created and last used today

        login = anyone.post("/login", data={"token": token, "next": "/"}, follow_redirects=False)
        assert login.status_code == 303 and anyone.get("/").status_code == 200

        assert cli.main(["token", "revoke", str(token_id), "--team", "ops"]) == 0
        assert "revoked token" in capsys.readouterr().out
        assert anyone.get("/api/v1/runs", headers=bearer(token)).status_code == 401
        # The dashboard session of a revoked token ends too.
        assert anyone.get("/", follow_redirects=False).status_code == 303
    assert cli.main(["token", "list", "--team", "ops"]) == 0
    assert "revoked" in capsys.readouterr().out
    assert cli.main(["token", "revoke", "999999", "--team", "ops"]) == 2
    assert capsys.readouterr().err.strip() == "stepdoctor token: team 'ops' has no token #999999"
    with pytest.raises(SystemExit) as bad:
        cli.main(["token", "create", "--team", "ops", "--expires-in", "soon"])
    assert bad.value.code == 2
    assert "invalid duration" in capsys.readouterr().err


def test_last_used_is_written_at_most_once_a_minute(
    app: FastAPI, client: TestClient, read_token: str
) -> None:
    client.get("/api/v1/runs", headers=bearer(read_token))
    with app.state.db.session() as session:
        first = session.scalars(select(Token.last_used_at).where(Token.scope == "read")).one()
    client.get("/api/v1/runs", headers=bearer(read_token))
    with app.state.db.session() as session:
        again = session.scalars(select(Token.last_used_at).where(Token.scope == "read")).one()
    assert first is not None and again == first


def test_legacy_names_with_a_newline_still_export(app: FastAPI, client: TestClient) -> None:
    """Rows stored before full-match validation may end in a newline: the zip header stays valid."""
    from stepdoctor_server.core.models import Project, Run

    trace = _uploaded(client)
    with app.state.db.session() as session:
        session.execute(update(Project).values(name="abc\n"))
        session.execute(update(Run).values(name="r1\n"))
    response = client.get(f"/api/v1/runs/{trace['run_id']}/tensorboard.zip")
    assert response.status_code == 200
    assert response.headers["content-disposition"] == 'attachment; filename="abc__r1__tensorboard.zip"'


def _gzip_stored_name(data: bytes) -> str:
    """The FNAME field of a gzip header (RFC 1952 §2.3): the name the compressor recorded."""
    assert data[:2] == b"\x1f\x8b" and data[3] & 0x08, "no FNAME in the gzip header"
    pos = 10
    if data[3] & 0x04:  # FEXTRA comes first
        pos += 2 + int.from_bytes(data[10:12], "little")
    return data[pos : data.index(b"\0", pos)].decode("latin-1")


def test_trimmed_download_names_itself_and_errors_name_the_trace_not_storage(
    app: FastAPI, client: TestClient
) -> None:
    from support.fixtures import HTA_TRACES

    body = (HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz").read_bytes()
    made = upload(client, body, project="p", run="r").json()
    with app.state.db.session() as session:
        key = session.scalar(select(Trace.storage_key).where(Trace.id == made["id"]))
    cut = client.get(f"/api/v1/traces/{made['id']}/download?steps=552")
    assert cut.status_code == 200, cut.text
    filename = cut.headers["content-disposition"].split('filename="', 1)[1].rstrip('"')
    assert filename.endswith("_steps552.pt.trace.json.gz")
    assert _gzip_stored_name(cut.content) == filename.removesuffix(".gz")  # not stepdoctor-trim-*.json

    missing = client.get(f"/api/v1/traces/{made['id']}/download?steps=12")
    assert missing.status_code == 422
    message = missing.json()["error"]["message"]
    assert message == f"trace {made['id']}: no step in 12-12; the trace has steps 551-552"
    assert key.rsplit("/", 1)[-1].split(".")[0] not in message

    # ?steps= is checked before the store is asked: a bad range is 422 even with the file gone,
    # and so, once the trace is analysed, is a range its stored report shows it does not have.
    drain(app)
    app.state.store.path(key).unlink()
    bad = client.get(f"/api/v1/traces/{made['id']}/download?steps=9-1")
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_steps"
    absent = client.get(f"/api/v1/traces/{made['id']}/download?steps=12")
    assert absent.status_code == 422, absent.text
    assert absent.json()["error"]["message"] == message  # the cut's own wording, without the file
    assert client.get(f"/api/v1/traces/{made['id']}/download?steps=552").status_code == 410
