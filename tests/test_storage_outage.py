"""The trace store going away and coming back: SeaweedFS stopped and restarted at the same
endpoint, on SQLite (embedded pool) and PostgreSQL (procrastinate).

- An upload while the store is down is a 503 with ``Retry-After``; nothing is kept (no row, no
  stage file, no object) and the message names no endpoint, bucket or key.
- ``/readyz`` says the store is not ready while it is down, and ready again once it is back.
- An analysis that finds the store down waits with backoff, ``analysis_tries`` times in all, and
  completes once the store is back; past the tries it fails with a reason users may read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.settings import Settings
from stepdoctor_server.traces.storage import S3Store
from support.s3 import BUCKET, S3Server, free_weed_ports, running_weed
from support.server import (
    DB_BACKENDS,
    FIXTURE_TRACES,
    migrated_database,
    row_counts,
    upload,
    worker_subprocess,
)

pytestmark = pytest.mark.slow

TRACE = FIXTURE_TRACES / "hta" / "critical_path" / "cuda_event_sync" / "event_sync_trace.json.gz"


class Weed:
    """A private ``weed mini`` that a test stops (an outage) and starts again on the same ports."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.ports = free_weed_ports()
        self._running: AbstractContextManager[S3Server | str] | None = None
        self.server: S3Server | None = None

    def start(self) -> S3Server:
        self._running = running_weed(self.data, ports=self.ports)
        server = self._running.__enter__()
        if isinstance(server, str):
            self._running.__exit__(None, None, None)
            self._running = None
            pytest.skip(server)
        self.server = server
        return server

    def stop(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)
            self._running = None


@pytest.fixture(params=DB_BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of this test's own (not the session's shared one): the ``stepdoctor worker``
    a test starts works through every job queued in its database, so the jobs earlier tests
    left (for traces long deleted) must not stand in front of the one this test watches."""
    data_dir = tmp_path / "db"
    data_dir.mkdir()
    with migrated_database(request.param, data_dir) as url:
        yield url


@pytest.fixture
def weed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weed]:
    pytest.importorskip("obstore", reason="obstore (the S3 client, server extra) is not installed")
    store = Weed(tmp_path / "weed")
    store.data.mkdir()
    server = store.start()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture
def server_settings(db_url: str, tmp_path: Path, weed: Weed) -> Settings:
    """Traces in a fresh prefix of the private store; analyses retried quickly (tests only)."""
    return Settings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        workers=0,
        storage_url=f"s3://{BUCKET}/t{uuid.uuid4().hex[:12]}",
        analysis_tries=8,
        analysis_retry_wait_s=0.25,
    )


def _no_secrets(text: str, weed: Weed) -> None:
    """What users read names no endpoint, bucket, object key or path."""
    assert weed.server is not None
    for secret in (weed.server.endpoint, str(weed.ports["s3.port"]), BUCKET, "team", "/tmp", ".json.gz"):
        assert secret not in text, (secret, text)


def _wait_for(
    what: str, check: Callable[[], bool], timeout_s: float = 120.0, state: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state()}"
        time.sleep(0.2)


def test_upload_while_the_store_is_down_is_503_and_keeps_nothing(
    app: FastAPI, client: TestClient, weed: Weed
) -> None:
    store = app.state.store
    assert isinstance(store, S3Store)
    body = TRACE.read_bytes()
    before = upload(client, body, run="before")
    assert before.status_code == 201
    rows, keys = row_counts(app), store.list_keys()
    assert client.get("/readyz").status_code == 200

    weed.stop()
    started = time.monotonic()
    refused = upload(client, body, run="during")
    assert refused.status_code == 503, refused.text
    assert time.monotonic() - started < 60  # obstore's own retries are bounded (was 3 min)
    assert refused.headers["Retry-After"].isdigit()
    error = refused.json()["error"]
    assert error["code"] == "storage_unavailable" and "Traceback" not in refused.text
    _no_secrets(refused.text, weed)
    assert row_counts(app) == rows
    assert not [p for p in store.temp_dir.glob("*") if p.is_file()]  # no stage file left
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "trace store" in ready.json()["error"]["message"]
    _no_secrets(ready.text, weed)
    # Reading a stored trace while the store is down: the same 503, not a 500.
    download = client.get(f"/api/v1/traces/{before.json()['id']}/download")
    assert download.status_code == 503 and download.json()["error"]["code"] == "storage_unavailable"

    weed.start()
    assert client.get("/readyz").status_code == 200
    assert store.list_keys() == keys  # the refused upload left no object
    assert upload(client, body, run="after").status_code == 201


@pytest.mark.parametrize("outcome", ["recovers", "gives_up"])
def test_analysis_waits_out_a_store_outage_and_completes_when_it_is_back(
    app: FastAPI,
    client: TestClient,
    server_settings: Settings,
    weed: Weed,
    monkeypatch: pytest.MonkeyPatch,
    outcome: str,
) -> None:
    """A real ``stepdoctor worker`` (embedded pool on SQLite, procrastinate on PostgreSQL)."""
    trace_id = upload(client, TRACE.read_bytes(), run="outage").json()["id"]
    tries = "8" if outcome == "recovers" else "2"
    for name, value in {
        "STEPDOCTOR_STORAGE_URL": server_settings.storage_url,
        "STEPDOCTOR_ANALYSIS_TRIES": tries,
        "STEPDOCTOR_ANALYSIS_RETRY_WAIT_S": "0.25",  # then 0.5, 1, 2, ... s
        # Procrastinate finds a retry that is due by polling (no NOTIFY): 5 s by default.
        "STEPDOCTOR_JOB_POLL_INTERVAL_S": "0.2",
    }.items():
        monkeypatch.setenv(name, value)
    weed.stop()

    def status() -> dict[str, object]:
        return dict(client.get(f"/api/v1/traces/{trace_id}").json())

    url = server_settings.database_url.get_secret_value()
    failure: AssertionError | None = None
    with worker_subprocess(url, server_settings.data_dir, "--workers", "1") as worker:
        try:
            _follow_the_outage(outcome, status, weed)
        except AssertionError as exc:  # reported with the worker's log, which exists once it stopped
            failure = exc
    assert failure is None, f"{failure}\nworker log:\n{worker.output[-6000:]}"
    assert "Traceback" not in worker.output, worker.output
    if outcome == "recovers":
        assert client.get(f"/api/v1/traces/{trace_id}/report").status_code == 200


def _follow_the_outage(outcome: str, status: Callable[[], dict[str, object]], weed: Weed) -> None:
    if outcome == "gives_up":
        _wait_for("the trace to fail", lambda: status()["status"] == "failed", state=status)
        reason = str(status()["status_reason"])
        assert reason.startswith("the trace store is unreachable (2 tries"), reason
        _no_secrets(reason, weed)
        return
    # Tried, found the store down, and waiting to try again (shown to users): not failed.
    _wait_for(
        "a failed try", lambda: "waiting to retry" in str(status()["status_reason"] or ""), state=status
    )
    _no_secrets(str(status()["status_reason"]), weed)
    time.sleep(1.0)  # two more tries fail meanwhile (0.25 s, then 0.5 s, after the first)
    assert status()["status"] in ("pending", "running"), status()
    weed.start()
    # Bounded generously: a try that starts while weed is still coming up may hang until the
    # client's request timeout (S3_CLIENT_TIMEOUTS) before it fails over to the next try.
    _wait_for("the analysis", lambda: status()["status"] == "done", timeout_s=300, state=status)
    assert status()["status_reason"] is None


def test_internal_error_reasons_name_no_path_or_endpoint() -> None:
    """An unexpected exception's text (a path, a key, an endpoint) goes to the log, not to users."""
    from stepdoctor_server.jobs.pool import describe_error
    from stepdoctor_server.traces.storage import StoreUnavailable

    leaky = OSError(5, "Input/output error", "/srv/stepdoctor/traces/team1/2026-11/1bb5493c.json.gz")
    reason, internal = describe_error(leaky)
    assert internal and reason == "internal error: OSError (details in the server log)"
    assert describe_error(StoreUnavailable()) == ("the trace store is unreachable", False)
