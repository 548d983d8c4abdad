"""``stepdoctor serve | token | db`` as users run them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from stepdoctor_server import cli
from stepdoctor_server.core.settings import Settings, get_settings
from support.server import bearer, serve_subprocess, small_trace_bytes, upload


@pytest.fixture
def env_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the CLI (which reads the environment) at a fresh SQLite data dir."""
    monkeypatch.setenv("STEPDOCTOR_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("STEPDOCTOR_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    yield tmp_path / "data"
    get_settings.cache_clear()


def test_db_upgrade_then_token_create_and_list(
    env_settings: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["db", "upgrade"]) == 0
    assert (env_settings / "stepdoctor.sqlite3").is_file()
    assert (
        cli.main(
            ["token", "create", "--team", "ml-infra", "--create-team", "--scope", "read", "--name", "grafana"]
        )
        == 0
    )
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert token.startswith("sdt_") and " " not in token

    assert cli.main(["token", "list", "--team", "ml-infra"]) == 0
    listing = capsys.readouterr().out
    assert "grafana" in listing and "read" in listing and token[:10] in listing
    assert token not in listing

    from starlette.testclient import TestClient

    from stepdoctor_server.web.app import create_app

    with TestClient(create_app(Settings(data_dir=env_settings, workers=0))) as client:
        assert client.get("/api/v1/runs", headers=bearer(token)).status_code == 200


def test_the_console_script_reaches_every_server_command(
    env_settings: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through ``stepdoctor``'s one dispatcher table (the entries resolve; args arrive without the name)."""
    import importlib

    from stepdoctor.cli import COMMANDS, main

    for name, command in COMMANDS.items():
        module, function = command.entry.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    assert main(["db", "upgrade"]) == 0
    assert main(["token", "create", "--team", "ops", "--create-team", "--scope", "read"]) == 0
    assert main(["token", "list", "--team", "ops"]) == 0
    assert "read" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["worker", "--help"])
    assert exc.value.code == 0 and "usage: stepdoctor worker" in capsys.readouterr().out


def test_cli_errors_are_one_line(env_settings: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["db", "upgrade"])
    capsys.readouterr()
    assert cli.main(["token", "list", "--team", "nobody"]) == 2
    assert capsys.readouterr().err.strip() == "stepdoctor token: no team named 'nobody'"
    assert cli.main(["token", "create", "--team", "../x"]) == 2
    assert "invalid team name" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["token", "create", "--team", "t", "--scope", "root"])
    assert exc.value.code == 2


def test_unreachable_database_is_one_line(
    env_settings: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEPDOCTOR_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:1/none")
    get_settings.cache_clear()
    assert cli.main(["db", "upgrade"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepdoctor db: database error at postgresql+psycopg://postgres@127.0.0.1:1/none")
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.slow
def test_serve_bootstraps_once_and_accepts_uploads(
    app: FastAPI, server_settings: Settings, tmp_path: Path
) -> None:
    """A real ``stepdoctor serve`` on the test database (SQLite and PostgreSQL): empty DB -> admin token."""
    env = {
        "STEPDOCTOR_DATA_DIR": str(tmp_path / "served"),
        "STEPDOCTOR_DATABASE_URL": server_settings.database_url.get_secret_value(),
        "STEPDOCTOR_WORKERS": "0",
    }
    with serve_subprocess(env) as server:
        output = server.output()
        token = next(line.strip() for line in output.splitlines() if line.strip().startswith("sdt_"))
        assert f"{server.url}/" in output
        with httpx.Client(base_url=server.url, timeout=30) as client:
            created = upload(client, small_trace_bytes(), token=token)
            assert created.status_code == 201, created.text
            listed = client.get("/api/v1/runs", headers=bearer(token)).json()
            assert [r["id"] for r in listed["items"]] == [created.json()["run_id"]]
    with serve_subprocess(env) as again:
        assert "sdt_" not in again.output()


def test_the_database_password_never_prints(
    env_settings: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "postgresql+psycopg://stepdoctor:hunter2@127.0.0.1:1/none"
    settings = Settings(data_dir=env_settings, database_url=url)
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)
    assert settings.database_url_shown == "postgresql+psycopg://stepdoctor:***@127.0.0.1:1/none"
    # Worker processes get their settings as JSON: that form keeps the real URL.
    assert Settings.model_validate_json(settings.model_dump_json()).database_url.get_secret_value() == url
    monkeypatch.setenv("STEPDOCTOR_DATABASE_URL", url)
    get_settings.cache_clear()
    assert cli.main(["db", "upgrade"]) == 2
    err = capsys.readouterr().err
    assert "stepdoctor:***@127.0.0.1:1/none" in err and "hunter2" not in err
