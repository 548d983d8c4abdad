"""App plumbing: JSON errors everywhere, health/readiness/metrics, OpenAPI, explicit wiring, the worker pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web import app as app_module
from stepdoctor_server.web.app import create_app
from support.server import synthetic_trace, upload


def test_framework_errors_are_json(client: TestClient) -> None:
    missing = client.get("/api/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = client.delete("/api/v1/runs")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    bad_id = client.get("/api/v1/runs/abc")
    assert bad_id.status_code == 422
    assert bad_id.json()["error"]["message"].startswith("path parameter 'run_id'")


def test_unexpected_error_is_a_bare_500_without_traceback(app: FastAPI, admin_token: str) -> None:
    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internals")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json() == {
        "error": {"code": "internal_error", "message": "internal server error (see the server log)"}
    }
    assert "secret internals" not in response.text and "Traceback" not in response.text


def test_readyz_reports_an_unreachable_database(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path, database_url="postgresql+psycopg://postgres@127.0.0.1:1/nowhere", workers=0
    )
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        response = client.get("/readyz")
        api = client.get("/api/v1/runs", headers={"Authorization": "Bearer sdt_x"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "database_unavailable"
    # API calls say "retry later" (the agent honours Retry-After) instead of a bare 500.
    assert api.status_code == 503 and api.headers["retry-after"] == "5"
    assert api.json()["error"]["code"] == "database_unavailable"


def test_metrics_count_requests_and_queue(client: TestClient) -> None:
    assert upload(client, synthetic_trace()).status_code == 201
    client.get("/api/v1/runs")
    text = client.get("/metrics").text
    assert 'stepdoctor_http_requests_total{method="POST",route="/api/v1/traces",status="201"} 1.0' in text
    assert 'stepdoctor_http_requests_total{method="GET",route="/api/v1/runs",status="200"} 1.0' in text
    assert 'stepdoctor_traces{status="pending"} 1.0' in text


def test_openapi_documents_the_api(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/api/v1/traces", "/api/v1/traces/{trace_id}/download", "/api/v1/runs", "/api/v1/projects"):
        assert path in spec["paths"], path
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    assert client.get("/docs").status_code == 200


def test_lifespan_starts_and_stops_the_worker_pool(
    server_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []

    class Handle:
        def stop(self, timeout: float) -> None:
            events.append("stop")

    def start_pool(settings: Settings) -> Handle:
        events.append(f"start:{settings.workers}")
        return Handle()

    monkeypatch.setattr(app_module.job_handlers, "start_pool", start_pool)

    with TestClient(create_app(server_settings.model_copy(update={"workers": 2}))):
        assert events == ["start:2"]
    assert events == ["start:2", "stop"]
    with TestClient(create_app(server_settings)):  # workers=0: no pool
        pass
    assert events == ["start:2", "stop"]


# One request per part of the service: (method, URL, the route template that must answer it).
EXPECTED_ROUTES = [
    ("POST", "/api/v1/traces", "/api/v1/traces"),  # api_traces
    ("GET", "/api/v1/traces/1", "/api/v1/traces/{trace_id}"),
    ("GET", "/api/v1/runs", "/api/v1/runs"),  # api_catalog
    ("GET", "/api/v1/projects", "/api/v1/projects"),
    ("GET", "/api/v1/traces/1/report", "/api/v1/traces/{trace_id}/report"),  # api_analysis
    ("GET", "/api/v1/compare", "/api/v1/compare"),
    ("GET", "/api/v1/traces/1/deep", "/api/v1/traces/{trace_id}/deep"),
    ("GET", "/", "/"),  # the dashboard
    ("GET", "/runs", "/runs"),
    ("GET", "/compare", "/compare"),
    ("GET", "/login", "/login"),
    ("GET", "/docs", "/docs"),  # api_docs
    ("GET", "/redoc", "/redoc"),
    ("GET", "/healthz", "/healthz"),  # the app's own
    ("GET", "/metrics", "/metrics"),
]


def test_every_part_of_the_service_is_routed(client: TestClient) -> None:
    """Each part answers through its own route (the metrics label a request by its matched template)."""
    for method, url, _ in EXPECTED_ROUTES:
        client.request(method, url, follow_redirects=False)
    text = client.get("/metrics").text
    for method, url, template in EXPECTED_ROUTES:
        assert f'method="{method}",route="{template}"' in text, f"{method} {url} matched no route {template}"
    assert 'route="unmatched"' not in text


# The interpreter of an install that lacks one part: the module reads as absent, then the app is built.
WITHOUT_PART = """
import sys
sys.modules[sys.argv[1]] = None
try:
    from stepdoctor_server.web.app import create_app
    create_app()
except ImportError as exc:
    print(exc)
    raise SystemExit(3)
print("started without", sys.argv[1])
"""


@pytest.mark.parametrize(
    "part",
    ["stepdoctor_server.web.pages", "stepdoctor_server.web.api_analysis", "stepdoctor_server.jobs.pool"],
)
def test_a_missing_part_stops_the_server_with_a_message(part: str, tmp_path: Path) -> None:
    env = {**os.environ, "STEPDOCTOR_DATA_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_PART, part], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stdout.startswith(f"stepdoctor server cannot start: its part {part} does not import"), (
        out.stdout
    )
    assert "pip install 'stepdoctor[server]'" in out.stdout


def test_serve_without_a_part_is_one_line(tmp_path: Path) -> None:
    """Through the console script, a part that is not installed ends in the install hint, not a traceback."""
    code = (
        "import sys; sys.modules['stepdoctor_server.web.pages'] = None\n"
        "from stepdoctor_server import cli\n"
        "cli.migrate.upgrade = lambda settings: None\n"  # reach the app import without a database
        "from stepdoctor.cli import main\n"
        "raise SystemExit(main(['serve', '--workers', '1']))\n"
    )
    env = {**os.environ, "STEPDOCTOR_DATA_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'stepdoctor[server]'" in lines[0], out.stderr
