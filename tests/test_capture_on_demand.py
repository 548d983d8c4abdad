"""Capture on demand: a live run's capture request (``runs.capture``, ``web/api_capture.py``) reaches
the agent's polling thread (``stepdoctor.on_demand``), which captures the next window of a real CPU
loop, says why in the trace's metadata, and acknowledges.

The API tests run on SQLite and PostgreSQL. The end-to-end tests start ``stepdoctor serve`` (once
for the module) and a CPU torch loop in subprocesses; the poll interval and the backoff are checked
by counting the requests on the server's side (its ``/metrics``, or a small counting server), never
by timing.
A run is made live by one step-series chunk sent the way the agent sends its series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from support.capture import cpu_loop, http_polls, make_live, mint_token, sqlite_env, wait_for
from support.server import bearer, logged_in, serve_subprocess, small_trace_bytes, upload

# -- the API -------------------------------------------------------------------------------------


def test_a_live_run_takes_one_pending_request_which_its_agent_polls_and_acknowledges(
    client: TestClient, upload_token: str, read_token: str
) -> None:
    run_id = make_live(client, upload_token, "proj", "live")
    first = client.post(f"/api/v1/runs/{run_id}/capture-requests")
    assert first.status_code == 201, first.text
    request = first.json()
    assert request["status"] == "pending" and request["created"] is True and request["trace_id"] is None
    again = client.post(f"/api/v1/runs/{run_id}/capture-requests", headers=bearer(upload_token))
    assert (
        again.status_code == 200 and again.json()["id"] == request["id"] and again.json()["created"] is False
    )
    # a read token may look, not ask, and not poll
    assert (
        client.post(f"/api/v1/runs/{run_id}/capture-requests", headers=bearer(read_token)).status_code == 403
    )
    assert (
        client.get(
            "/api/v1/capture-requests", params={"project": "proj", "run": "live"}, headers=bearer(read_token)
        ).status_code
        == 403
    )

    polled = client.get(
        "/api/v1/capture-requests", params={"project": "proj", "run": "live"}, headers=bearer(upload_token)
    )
    assert polled.status_code == 200
    assert [r["id"] for r in polled.json()["requests"]] == [request["id"]]
    # an agent may poll before its run exists: nothing pending
    none = client.get(
        "/api/v1/capture-requests", params={"project": "proj", "run": "not-yet"}, headers=bearer(upload_token)
    )
    assert none.status_code == 200 and none.json() == {"requests": []}

    ack = client.post(
        f"/api/v1/capture-requests/{request['id']}/ack",
        json={"trace_key": "window-key-1", "rank": 0},
        headers=bearer(upload_token),
    )
    assert ack.status_code == 200 and ack.json()["status"] == "captured" and ack.json()["trace_id"] is None
    assert client.get(
        "/api/v1/capture-requests", params={"project": "proj", "run": "live"}, headers=bearer(upload_token)
    ).json() == {"requests": []}
    # acknowledging again (a lost answer) changes nothing
    twice = client.post(
        f"/api/v1/capture-requests/{request['id']}/ack", json={"detail": "late"}, headers=bearer(upload_token)
    )
    assert (
        twice.status_code == 200 and twice.json()["status"] == "captured" and twice.json()["detail"] is None
    )

    # the window's upload arrives: the request names its trace
    trace = upload(
        client,
        small_trace_bytes(),
        token=upload_token,
        project="proj",
        run="live",
        idempotency_key="window-key-1",
    )
    assert trace.status_code in (200, 201, 202), trace.text
    listed = client.get(f"/api/v1/runs/{run_id}/capture-requests", headers=bearer(read_token)).json()["items"]
    assert [(r["id"], r["status"], r["trace_id"]) for r in listed] == [
        (request["id"], "captured", trace.json()["id"])
    ]

    # answered, the run takes a new request
    second = client.post(f"/api/v1/runs/{run_id}/capture-requests")
    assert second.status_code == 201 and second.json()["id"] != request["id"]


def test_requests_are_refused_for_runs_that_are_not_live_or_not_ours(
    client: TestClient, upload_token: str, make_token: Any
) -> None:
    finished = make_live(client, upload_token, "proj", "done", final=True)
    refused = client.post(f"/api/v1/runs/{finished}/capture-requests")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "run_not_live"
    # a run without a step series has no agent to hear it
    plain = upload(client, small_trace_bytes(), token=upload_token, project="proj", run="traces-only").json()
    assert client.post(f"/api/v1/runs/{plain['run_id']}/capture-requests").status_code == 409

    other_upload = make_token("upload", team_name="other-team")
    theirs = make_live(client, other_upload, "proj", "theirs")
    assert client.post(f"/api/v1/runs/{theirs}/capture-requests").status_code == 404
    mine = make_live(client, upload_token, "proj", "mine")
    request = client.post(f"/api/v1/runs/{mine}/capture-requests").json()
    stranger = client.post(
        f"/api/v1/capture-requests/{request['id']}/ack", json={"trace_key": "k"}, headers=bearer(other_upload)
    )
    assert stranger.status_code == 404
    # no body: another team's request is still 404 (nothing told about it), one's own a 422
    assert (
        client.post(f"/api/v1/capture-requests/{request['id']}/ack", headers=bearer(other_upload)).status_code
        == 404
    )
    nobody = client.post(f"/api/v1/capture-requests/{request['id']}/ack", headers=bearer(upload_token))
    assert nobody.status_code == 422 and "body" in nobody.json()["error"]["message"]
    for body in ({}, {"trace_key": "k", "detail": "both"}, {"trace_key": ""}, {"detail": "x" * 501}):
        bad = client.post(
            f"/api/v1/capture-requests/{request['id']}/ack", json=body, headers=bearer(upload_token)
        )
        assert bad.status_code == 422, body
    assert client.get(f"/api/v1/runs/{mine}/capture-requests").json()["items"][0]["status"] == "pending"
    failed = client.post(
        f"/api/v1/capture-requests/{request['id']}/ack",
        json={"detail": "the window could not be written: disk full"},
    )
    assert failed.json()["status"] == "failed" and "disk full" in failed.json()["detail"]


def test_the_run_page_offers_capture_now_to_uploaders_while_the_run_is_live(
    app: FastAPI, client: TestClient, upload_token: str, read_token: str, admin_token: str
) -> None:
    run_id = make_live(client, upload_token, "proj", "page")
    admin = logged_in(app, admin_token)
    assert 'id="capture-now"' in admin.get(f"/runs/{run_id}").text
    reader = logged_in(app, read_token)
    assert 'id="capture-now"' not in reader.get(f"/runs/{run_id}").text
    assert reader.post(f"/runs/{run_id}/capture").status_code == 403
    # the dashboard's CSRF defence: a cookie-borne POST from another origin is refused
    forged = admin.post(f"/runs/{run_id}/capture", headers={"Origin": "https://evil.example"})
    assert (
        forged.status_code == 403
        and client.get(f"/api/v1/runs/{run_id}/capture-requests").json()["items"] == []
    )

    clicked = admin.post(f"/runs/{run_id}/capture", follow_redirects=False)
    assert clicked.status_code == 303 and clicked.headers["location"] == f"/runs/{run_id}#capture"
    shown = admin.get(f"/runs/{run_id}").text
    assert "Capture requested at <time" in shown and "already pending" not in shown
    assert 'http-equiv="refresh"' in shown and "A capture was requested: this page reloads" in shown
    again = admin.post(f"/runs/{run_id}/capture", follow_redirects=False)
    assert again.headers["location"] == f"/runs/{run_id}?capture=pending#capture"
    assert "A capture is already pending." in admin.get(again.headers["location"]).text
    assert len(client.get(f"/api/v1/runs/{run_id}/capture-requests").json()["items"]) == 1

    finished = make_live(client, upload_token, "proj", "page-done", final=True)
    assert 'id="capture-now"' not in admin.get(f"/runs/{finished}").text
    assert admin.post(f"/runs/{finished}/capture").status_code == 409


# -- end to end: a real server, a real CPU loop --------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """One ``stepdoctor serve`` for the module's end-to-end tests: (its URL, an upload token, an
    admin token). Each test has a run of its own, and a test's loop has exited before the next starts
    (the poll counter is the server's, over every run)."""
    env = sqlite_env(tmp_path_factory.mktemp("capture-server"))
    with serve_subprocess(env) as server:
        yield server.url, mint_token(env, "upload"), mint_token(env, "admin")


@pytest.mark.slow
def test_a_request_reaches_a_running_cpu_loop_through_a_real_server(
    tmp_path: Path, served: tuple[str, str, str]
) -> None:
    url, agent_token, admin = served
    with httpx.Client(base_url=url, headers=bearer(admin), timeout=60) as api:
        run_id = make_live(api, agent_token, "capture", "demand")
        polled = http_polls(url, admin)
        with cpu_loop(tmp_path, url, agent_token, "demand", poll_s=0.2) as loop:
            wait_for("a first poll", lambda: http_polls(url, admin) > polled, loop)
            made = api.post(f"/api/v1/runs/{run_id}/capture-requests")
            assert made.status_code == 201, made.text
            request_id = made.json()["id"]

            def captured() -> dict[str, Any] | None:
                items = api.get(f"/api/v1/runs/{run_id}/capture-requests").json()["items"]
                mine = next(r for r in items if r["id"] == request_id)
                return mine if mine["status"] != "pending" and mine["trace_id"] is not None else None

            answer = wait_for("the captured trace", captured, loop)
            summary, _ = loop.stop()
    assert answer["status"] == "captured" and answer["detail"] is None
    trace = api_get(url, admin, f"/api/v1/traces/{answer['trace_id']}")
    capture = trace["metadata"]["capture"]
    assert capture["reason"] == "on_demand" and capture["request_id"] == request_id
    assert trace["metadata"]["window"]["reason"] == "on_demand"
    assert summary["captured"] == 1  # the only window: the schedule never opens one


def api_get(server: str, token: str, path: str) -> Any:
    resp = httpx.get(f"{server}{path}", headers=bearer(token), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
def test_polls_come_at_most_once_per_interval(tmp_path: Path, served: tuple[str, str, str]) -> None:
    """Every poll answered 200 with nothing pending. Between two reads of the server's own request
    counter, ``t`` seconds apart, the agent may have polled at most ``t / interval + 1`` times (each
    poll starts ``interval`` after the previous one ended, however long the polls take); a loop
    polling as fast as it can would make dozens a second."""
    url, agent_token, admin = served
    interval = 0.2
    with httpx.Client(base_url=url, timeout=60) as api:
        make_live(api, agent_token, "capture", "steady")
    before = http_polls(url, admin)  # the module's server: earlier tests' loops polled it too
    with cpu_loop(tmp_path, url, agent_token, "steady", poll_s=interval) as loop:
        wait_for("a first poll", lambda: http_polls(url, admin) > before, loop)
        started = time.monotonic()  # before the first read: the window covers both reads
        first = http_polls(url, admin)
        seen: list[tuple[int, float]] = []

        def six_more() -> bool:
            seen.append((http_polls(url, admin) - first, time.monotonic() - started))
            return seen[-1][0] >= 6

        wait_for("six more polls", six_more, loop)
        summary, _ = loop.stop()
    assert summary["steps"] > 0 and summary["captured"] == 0
    for polls, window_s in seen:
        assert polls <= window_s / interval + 1, (polls, window_s)


class _Failing(BaseHTTPRequestHandler):
    """Answers every capture poll with 503 and counts them (the server's side of the backoff)."""

    polls: ClassVar[list[float]] = []
    status: ClassVar[int] = 503

    def do_GET(self) -> None:
        if self.path.startswith("/api/v1/capture-requests"):
            type(self).polls.append(time.monotonic())
        body = b'{"error": {"code": "unavailable", "message": "down for maintenance"}}'
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # traces and series are refused the same way
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.slow
def test_polls_back_off_while_the_server_fails(tmp_path: Path) -> None:
    """A server answering 503: after the k-th failed poll the next waits at least interval * 2**k, so
    the server sees its 1st and 5th polls at least interval * (2 + 4 + 8 + 16) apart (at one poll per
    interval they would be 4 intervals apart), and training goes on unharmed."""
    interval = 0.05
    _Failing.polls, _Failing.status = [], 503
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with cpu_loop(
            tmp_path, url, "sdt_test", "failing", poll_s=interval, STEPDOCTOR_FLUSH_TIMEOUT="0.5"
        ) as loop:
            wait_for("five polls", lambda: len(_Failing.polls) >= 5, loop, timeout=180)
            summary, _ = loop.stop()
    finally:
        httpd.shutdown()
        httpd.server_close()
    polls = list(_Failing.polls)
    assert summary["steps"] > 0 and summary["captured"] == 0
    assert polls[4] - polls[0] >= interval * (2 + 4 + 8 + 16), [round(t - polls[0], 2) for t in polls]


@pytest.mark.slow
def test_a_server_without_capture_requests_is_polled_once(tmp_path: Path) -> None:
    """A server that answers the poll 404 (an older stepdoctor, or another service): the agent asks
    once and no more while the loop goes on, and says nothing about it on stderr."""
    _Failing.polls, _Failing.status = [], 404
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with cpu_loop(
            tmp_path, url, "sdt_test", "old-server", poll_s=0.05, STEPDOCTOR_FLUSH_TIMEOUT="2"
        ) as loop:
            wait_for("a first poll", lambda: len(_Failing.polls) >= 1, loop)
            time.sleep(1.5)  # 30 intervals in which a poller that did not stop would ask again
            summary, _ = loop.stop()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(_Failing.polls) == 1 and summary["steps"] > 0
    said = [line for line in loop.out_path.read_text().splitlines() if line.startswith("stepdoctor:")]
    assert any("captured for capture/old-server" in line for line in said), said
    assert not any("on demand" in line or "capture-requests" in line for line in said), said
