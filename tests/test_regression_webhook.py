"""The regression webhook: one JSON POST per regression to a real local HTTP receiver (a
``http.server`` in a thread), sent by the workers' job (``runs.webhook``), retried with backoff
when the receiver fails, never again when the status is recomputed with the same outcome."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy import select, update

from stepdoctor_server.core.models import WebhookDelivery, utcnow
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.runs.diagnosis_job import refresh_run_diagnosis
from stepdoctor_server.runs.webhook import retry_after_s
from support.regressions import recorded_run
from support.server import TeamInfo, drain, worker_subprocess

SECRET_PATH = "/hooks/T000/B000/s3cr3t-token"


@dataclass
class Receiver:
    """A local HTTP receiver: answers each POST with the next status of ``statuses`` (then 200)."""

    url: str = ""
    statuses: list[int] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)  # seconds to stall before answering, per POST
    bodies: list[dict[str, Any]] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)

    def delivered(self) -> list[dict[str, Any]]:
        return [b for b, code in zip(self.bodies, self.answered, strict=True) if code == 200]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                delay = got.delays.pop(0) if got.delays else 0.0
            if delay:
                time.sleep(delay)
            with lock:
                code = got.statuses.pop(0) if got.statuses else 200
                got.bodies.append(json.loads(body))
                got.answered.append(code)
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"ok" if code == 200 else b"busy")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got.url = f"http://127.0.0.1:{server.server_address[1]}{SECRET_PATH}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def server_settings(server_settings: Settings, receiver: Receiver) -> Settings:
    return server_settings.model_copy(
        update={
            "webhook_url": SecretStr(receiver.url),
            "webhook_retry_wait_s": 0.0,  # the backoff is checked on its own below
            "webhook_timeout_s": 30.0,
            "public_url": "https://stepdoctor.example.com/",
        }
    )


def deliveries(app: FastAPI) -> list[WebhookDelivery]:
    with app.state.db.session() as session:
        return list(session.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)))


def test_one_post_per_regression_with_the_numbers_and_a_slack_text(
    app: FastAPI, team: TeamInfo, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    recorded_run(app, team.id, "proj", "fine", step_ms=101.0)
    slow = recorded_run(app, team.id, "proj", "slow", step_ms=120.0, kind="input")
    assert receiver.bodies == []  # queued, not sent on the job's (or a request's) path
    with caplog.at_level(logging.INFO, logger="stepdoctor.webhook"):
        drain(app)
    assert len(receiver.bodies) == 1
    body = receiver.bodies[0]
    assert body["project"]["name"] == "proj" and body["run"] == {"id": slow, "name": "slow"}
    assert body["baseline"]["kind"] == "median" and body["baseline"]["names"] == ["fine", "base"]
    assert body["step_time_ms"] == {"run": 120.0, "baseline": 100.5} and body["basis"] == "profiled"
    assert body["change"] == pytest.approx(0.194, abs=1e-3) and body["reasons"] == ["step_time", "verdict"]
    assert body["verdict"] == {"run": "input", "baseline": "compute", "changed": True}
    assert body["link"] == f"https://stepdoctor.example.com/runs/{slow}"
    assert body["text"].startswith(
        "stepdoctor: run proj/slow regressed against the median of the last 2 finished run(s) (fine, base)"
    )
    assert "120.00 ms vs baseline 100.50 ms (+19.4%" in body["text"] and body["link"] in body["text"]
    assert "verdict compute -> input" in body["text"]
    # The URL's secret path is never logged.
    assert "delivered to http://127.0.0.1/..." in caplog.text and "s3cr3t" not in caplog.text
    # Recomputing with the same outcome (a re-aggregation, a later drain) posts nothing more.
    with app.state.db.session() as session:
        refresh_run_diagnosis(session, slow)
    drain(app)
    assert len(receiver.bodies) == 1
    [row] = deliveries(app)
    assert (row.status, row.attempts, row.run_id) == ("delivered", 1, slow)


def test_a_500_is_retried_then_delivered_once(app: FastAPI, team: TeamInfo, receiver: Receiver) -> None:
    receiver.statuses = [500, 503]
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    slow = recorded_run(app, team.id, "proj", "slow", step_ms=150.0)
    drain(app)
    assert receiver.answered == [500, 503, 200]
    assert len(receiver.delivered()) == 1 and receiver.delivered()[0]["run"]["id"] == slow
    [row] = deliveries(app)
    assert (row.status, row.attempts, row.last_error) == ("delivered", 3, None)
    drain(app)
    with app.state.db.session() as session:
        refresh_run_diagnosis(session, slow)
    drain(app)
    assert len(receiver.bodies) == 3  # nothing after the delivery


def test_a_failing_receiver_waits_with_exponential_backoff_and_gives_up(
    app: FastAPI, team: TeamInfo, receiver: Receiver
) -> None:
    settings = app.state.settings.model_copy(update={"webhook_retry_wait_s": 5.0, "webhook_tries": 3})
    assert [retry_after_s(settings, n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    app.state.settings.webhook_tries, app.state.settings.webhook_retry_wait_s = 3, 5.0
    receiver.statuses = [500] * 10
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    recorded_run(app, team.id, "proj", "slow", step_ms=150.0)
    for tries in (1, 2, 3):
        drain(app)  # one try, then the next is due only after the wait
        assert len(receiver.bodies) == tries
        with app.state.db.session() as session:
            row = session.scalars(select(WebhookDelivery)).one()
            if tries < 3:  # the wait doubles: 5 s, then 10 s (from when the try ended)
                wait = (row.next_attempt_at - row.updated_at).total_seconds()
                assert wait == pytest.approx(retry_after_s(settings, tries), abs=0.01)
            session.execute(update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1)))
    [row] = deliveries(app)
    assert (row.status, row.attempts, row.last_error) == ("failed", 3, "HTTP 500")
    drain(app)
    assert len(receiver.bodies) == 3


def test_a_4xx_is_not_retried(app: FastAPI, team: TeamInfo, receiver: Receiver) -> None:
    receiver.statuses = [400]
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    recorded_run(app, team.id, "proj", "slow", step_ms=150.0)
    drain(app)
    drain(app)
    [row] = deliveries(app)
    assert (row.status, len(receiver.bodies)) == ("failed", 1)


def test_no_webhook_url_means_no_delivery_row(app: FastAPI, team: TeamInfo, receiver: Receiver) -> None:
    app.state.settings.webhook_url = SecretStr("")
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    recorded_run(app, team.id, "proj", "slow", step_ms=150.0)
    drain(app)
    assert deliveries(app) == [] and receiver.bodies == []


def test_a_stepdoctor_worker_process_delivers_it_once_after_a_500(
    app: FastAPI,
    team: TeamInfo,
    receiver: Receiver,
    server_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real ``stepdoctor worker`` (the embedded pool on SQLite, procrastinate's periodic
    ``stepdoctor.webhooks`` on PostgreSQL) sends the queued delivery, retried after a 500."""
    receiver.statuses = [500]
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    slow = recorded_run(app, team.id, "proj", "slow", step_ms=150.0)
    monkeypatch.setenv("STEPDOCTOR_WEBHOOK_URL", receiver.url)
    monkeypatch.setenv("STEPDOCTOR_WEBHOOK_RETRY_WAIT_S", "0")
    url = server_settings.database_url.get_secret_value()
    with worker_subprocess(url, server_settings.data_dir, "--workers", "1") as worker:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and [r.status for r in deliveries(app)] != ["delivered"]:
            time.sleep(0.5)
    assert [r.status for r in deliveries(app)] == ["delivered"], worker.output
    assert receiver.answered == [500, 200] and receiver.delivered()[0]["run"]["id"] == slow
    assert "s3cr3t" not in worker.output


def test_a_receiver_that_times_out_is_tried_again(app: FastAPI, team: TeamInfo, receiver: Receiver) -> None:
    app.state.settings.webhook_timeout_s = 1.0
    receiver.delays = [4.0]  # the first POST gets no answer within the timeout
    recorded_run(app, team.id, "proj", "base", step_ms=100.0)
    recorded_run(app, team.id, "proj", "slow", step_ms=150.0)
    drain(app)
    [row] = deliveries(app)
    assert (
        row.status == "delivered" and row.attempts >= 2
    )  # (a machine too busy to answer in 1 s retries more)
    assert receiver.answered[-1] == 200
