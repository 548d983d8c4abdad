"""Shared pieces of the capture-on-demand tests: a run made live the way the agent's series does it,
the CPU loop of ``capture_loop.py`` in a subprocess, the server's own count of polls, and the
database and tokens of a ``stepdoctor serve`` subprocess made in this process.

The database is migrated and the tokens minted by the CLI's own functions (``migrate.upgrade``,
``cli.token_create``) in the test process rather than by ``python -m stepdoctor`` subprocesses: each
such subprocess costs about 3 s of CPU importing the server, on a 2-core box shared with other tests.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from stepdoctor_server import cli
from stepdoctor_server.core import migrate
from stepdoctor_server.core.settings import Settings
from support import series_chunks
from support.server import bearer

LOOP = Path(__file__).parent / "capture_loop.py"


def sqlite_env(data_dir: Path) -> dict[str, str]:
    """Environment for ``serve_subprocess`` on a fresh, migrated SQLite database in ``data_dir`` (no
    workers), what ``support.server.migrated_sqlite_env`` gives without its CLI subprocess."""
    data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(_settings(data_dir))
    return {"STEPDOCTOR_DATA_DIR": str(data_dir), "STEPDOCTOR_DATABASE_URL": "", "STEPDOCTOR_WORKERS": "0"}


def mint_token(env: Mapping[str, str], scope: str) -> str:
    """A token of the team 'default' for the database in ``env``, by ``stepdoctor token create
    --create-team``'s own function: what ``support.server.cli_token`` gives, also before the server's
    first start (which then makes no team and bootstrap token of its own)."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.token_create(
            _settings(Path(env["STEPDOCTOR_DATA_DIR"])),
            team="default",
            scope=scope,
            name=None,
            create_team=True,
        )
    assert code == 0, out.getvalue()
    return out.getvalue().strip().splitlines()[-1]


def _settings(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, database_url="", workers=0)


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


@dataclass
class Loop:
    process: subprocess.Popen[str]
    stop_file: Path
    out_path: Path
    started: float
    start_file: Path | None = None

    def go(self) -> None:
        """Start the profile of a loop made with ``held=True`` (its process is up, torch imported)."""
        assert self.start_file is not None
        self.start_file.touch()

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
    tmp_path: Path, server: str, token: str, run: str, *, poll_s: float, held: bool = False, **env: str
) -> Iterator[Loop]:
    """``tests/support/capture_loop.py`` under ``stepdoctor.profile`` (no scheduled window), pointed at
    ``server``, until the test stops it (at most 10 minutes). ``held``: the process starts (and pays
    for importing torch) now, its profile only at :meth:`Loop.go`."""
    start_file = tmp_path / f"start-{run}" if held else None
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
    if start_file is not None:
        cmd += ["--start-file", str(start_file)]
    with out_path.open("w") as out:
        process = subprocess.Popen(
            cmd, env={**os.environ, **agent_env}, stdout=out, stderr=subprocess.STDOUT, text=True
        )
    loop = Loop(process, stop_file, out_path, time.monotonic(), start_file)
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
        time.sleep(0.2)


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
