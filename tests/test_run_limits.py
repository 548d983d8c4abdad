"""A run's limits at upload: at most ``max_run_ranks`` distinct ranks, ``max_run_windows`` traces per
rank and ranks × windows traces in all (409 naming the limit and its configured value); a rank
outside ``[0, world size)`` (the upload's metadata, else the trace's ``distributedInfo``) is 422.
A refused upload keeps nothing: no row, no file."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.settings import Settings
from support.fixtures import HTA_TRACES
from support.server import row_counts, store_files, synthetic_trace, upload

RANK0_OF_128 = (HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz").read_bytes()  # distributedInfo


def _refused(app: FastAPI, client: TestClient, status: int, code: str, **kwargs: object) -> str:
    before = (row_counts(app), store_files(app))
    resp = upload(client, kwargs.pop("body", synthetic_trace()), **kwargs)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code
    assert (row_counts(app), store_files(app)) == before
    return str(resp.json()["error"]["message"])


def test_a_run_accepts_at_most_its_ranks_windows_and_traces(app: FastAPI, client: TestClient) -> None:
    app.state.settings = app.state.settings.model_copy(update={"max_run_ranks": 3, "max_run_windows": 2})
    for rank in (0, 1, 2):
        assert upload(client, synthetic_trace(), run="capped", rank=rank).status_code == 201
    message = _refused(app, client, 409, "run_rank_limit", run="capped", rank=3)
    assert "3 ranks" in message and "STEPDOCTOR_MAX_RUN_RANKS=3" in message
    assert upload(client, synthetic_trace(), run="other", rank=3).status_code == 201  # per run
    assert upload(client, synthetic_trace(), run="capped", rank=0).status_code == 201  # a second window
    message = _refused(app, client, 409, "run_window_limit", run="capped", rank=0)
    assert "rank 0" in message and "STEPDOCTOR_MAX_RUN_WINDOWS=2" in message
    for _ in range(2):  # traces without a rank count towards the run's total only
        assert upload(client, synthetic_trace(), run="capped", rank=None).status_code == 201
    message = _refused(app, client, 409, "run_trace_limit", run="capped", rank=None)
    assert "6 traces" in message and "STEPDOCTOR_MAX_RUN_RANKS=3" in message


def test_default_limits_hold_4096_ranks_of_3_windows() -> None:
    settings = Settings()
    assert settings.max_run_ranks >= 4096 and settings.max_run_windows >= 3


def test_a_rank_outside_the_world_is_refused(app: FastAPI, client: TestClient) -> None:
    message = _refused(
        app, client, 422, "rank_out_of_range", rank=4, metadata={"world_size": 4, "host": "h", "pid": 1}
    )
    assert "rank 4 is outside [0, 4)" in message and "metadata.world_size" in message
    # the trace's own distributedInfo (world size 128) when the upload does not say
    message = _refused(app, client, 422, "rank_out_of_range", body=RANK0_OF_128, rank=128)
    assert "outside [0, 128)" in message and "distributedInfo" in message
    assert upload(client, RANK0_OF_128, rank=127).status_code == 201
    assert upload(client, RANK0_OF_128, rank=None).status_code == 201  # its own rank 0 of 128
    assert upload(client, synthetic_trace(), rank=3, metadata={"world_size": 4}).status_code == 201
