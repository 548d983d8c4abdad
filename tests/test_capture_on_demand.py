"""Capture on demand: a live run's capture request (``runs.capture``, ``web/api_capture.py``) reaches
the agent's polling thread (``stepdoctor.on_demand``), which captures the next window of a real CPU
loop, says why in the trace's metadata, and acknowledges.

The API tests run on SQLite and PostgreSQL. The end-to-end tests start ``stepdoctor serve`` and a
CPU torch loop in subprocesses; the poll interval and the backoff are checked by counting the
requests on the server's side (its ``/metrics``, or a small counting server), never by timing.
A run is made live by one step-series chunk sent the way the agent sends its series.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi.testclient import TestClient

from support import series_chunks
from support.server import bearer, cli_token, migrated_sqlite_env, serve_subprocess, small_trace_bytes, upload

LOOP = Path(__file__).parent / "support" / "capture_loop.py"


def make_live(
    client: TestClient | httpx.Client, token: str, project: str, run: str, *, final: bool = False
) -> int:
    """One step-series chunk for ``project/run`` (a heartbeat now), as the agent's series sends it."""
    data = series_chunks.chunk(uuid.uuid4().hex[:12], 0, 0, 5, final=final)
    resp = client.post(
        "/api/v1/series",
        params={"project": project, "run": run},
        content=data,
        headers={**bearer(token), "Content-Type": "application/octet-stream"},
    )
    assert resp.status_code == 201, resp.text
    return int(resp.json()["run_id"])


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


# -- end to end: a real server, a real CPU loop --------------------------------------------------


@dataclass
class Loop:
    process: subprocess.Popen[str]
    stop_file: Path
    out_path: Path
    started: float

    def stop(self, timeout: float = 180.0) -> tuple[dict[str, Any], float]:
        """Ask the loop to finish; (what it printed, seconds it ran in all)."""
        self.stop_file.touch()
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        elapsed = time.monotonic() - self.started
        text = self.out_path.read_text()
        assert self.process.returncode == 0, text[-3000:]
        assert "Traceback" not in text and "internal error" not in text, text[-3000:]
        summary = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
        return summary, elapsed


@contextmanager
def cpu_loop(
    tmp_path: Path, server: str, token: str, run: str, *, poll_s: float, **env: str
) -> Iterator[Loop]:
    """``tests/support/capture_loop.py`` under ``stepdoctor.profile`` (no scheduled window), pointed at
    ``server``, until the test stops it (at most 10 minutes)."""
    stop_file = tmp_path / f"stop-{run}"
    out_path = tmp_path / f"loop-{run}.log"
    agent_env = {
        "STEPDOCTOR_SERVER": server,
        "STEPDOCTOR_TOKEN": token,
        "STEPDOCTOR_SPOOL": str(tmp_path / f"spool-{run}"),
        "STEPDOCTOR_FLUSH_TIMEOUT": "30",
        "STEPDOCTOR_RAISE_ERRORS": "1",
        **env,
    }
    cmd = [sys.executable, str(LOOP), "--project", "capture", "--run", run, "--poll-s", str(poll_s)]
    cmd += ["--stop-file", str(stop_file)]
    with out_path.open("w") as out:
        process = subprocess.Popen(
            cmd, env={**os.environ, **agent_env}, stdout=out, stderr=subprocess.STDOUT, text=True
        )
    loop = Loop(process, stop_file, out_path, time.monotonic())
    try:
        yield loop
    finally:
        if process.poll() is None:
            stop_file.touch()
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for(what: str, check: Any, loop: Loop, timeout: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if loop.process.poll() is not None:
            raise AssertionError(
                f"the loop exited while waiting for {what}:\n{loop.out_path.read_text()[-3000:]}"
            )
        assert time.monotonic() < deadline, (
            f"no {what} after {timeout} s:\n{loop.out_path.read_text()[-3000:]}"
        )
        time.sleep(0.5)


def http_polls(server: str, admin: str) -> int:
    """GET /api/v1/capture-requests answered so far, from the server's own request counter."""
    text = httpx.get(f"{server}/metrics", headers=bearer(admin), timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("stepdoctor_http_requests_total{")
            and 'route="/api/v1/capture-requests"' in line
            and 'method="GET"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


@pytest.mark.slow
def test_a_request_reaches_a_running_cpu_loop_through_a_real_server(tmp_path: Path) -> None:
    env = migrated_sqlite_env(tmp_path / "server")
    with serve_subprocess(env) as server:
        agent_token, admin = cli_token(env, "upload"), cli_token(env, "admin")
        with httpx.Client(base_url=server.url, headers=bearer(admin), timeout=60) as api:
            run_id = make_live(api, agent_token, "capture", "demand")
            with cpu_loop(tmp_path, server.url, agent_token, "demand", poll_s=0.5) as loop:
                wait_for("a first poll", lambda: http_polls(server.url, admin) >= 1, loop)
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
        trace = api_get(server.url, admin, f"/api/v1/traces/{answer['trace_id']}")
        capture = trace["metadata"]["capture"]
        assert capture["reason"] == "on_demand" and capture["request_id"] == request_id
        assert trace["metadata"]["window"]["reason"] == "on_demand"
        assert summary["captured"] == 1  # the only window: the schedule never opens one


def api_get(server: str, token: str, path: str) -> Any:
    resp = httpx.get(f"{server}{path}", headers=bearer(token), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
def test_polls_come_at_most_once_per_interval(tmp_path: Path) -> None:
    """Every poll answered 200 with nothing pending: the count over the loop's whole life stays
    within one per interval (a loop polling as fast as it can would make hundreds)."""
    env = migrated_sqlite_env(tmp_path / "server")
    interval = 0.5
    with serve_subprocess(env) as server:
        agent_token, admin = cli_token(env, "upload"), cli_token(env, "admin")
        make_live(httpx.Client(base_url=server.url, timeout=60), agent_token, "capture", "steady")
        with cpu_loop(tmp_path, server.url, agent_token, "steady", poll_s=interval) as loop:
            wait_for("three polls", lambda: http_polls(server.url, admin) >= 3, loop)
            summary, elapsed = loop.stop()
        polls = http_polls(server.url, admin)
    assert summary["steps"] > 0
    assert 3 <= polls <= elapsed / interval + 1, (polls, elapsed)


class _Failing(BaseHTTPRequestHandler):
    """Answers every capture poll with 503 and counts them (the server's side of the backoff)."""

    polls: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        if self.path.startswith("/api/v1/capture-requests"):
            type(self).polls.append(time.monotonic())
        body = b'{"error": {"code": "unavailable", "message": "down for maintenance"}}'
        self.send_response(503)
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
    """A server answering 503: each wait doubles from the interval, so over the loop's life the polls
    are about log2(life / interval) + 1, far fewer than one per interval, and training is unharmed."""
    interval = 0.25
    _Failing.polls = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with cpu_loop(
            tmp_path, url, "sdt_test", "failing", poll_s=interval, STEPDOCTOR_FLUSH_TIMEOUT="2"
        ) as loop:
            wait_for("four polls", lambda: len(_Failing.polls) >= 4, loop, timeout=120)
            summary, elapsed = loop.stop()
    finally:
        httpd.shutdown()
        httpd.server_close()
    polls = list(_Failing.polls)
    assert summary["steps"] > 0 and summary["captured"] == 0
    # after the k-th failure the next poll waits at least interval * 2**k, so n polls span at least
    # interval * (2**n - 2) s of the loop's life (at one poll per interval, n would be ~life / interval)
    assert len(polls) >= 4 and interval * (2 ** len(polls) - 2) <= elapsed, (len(polls), elapsed)
