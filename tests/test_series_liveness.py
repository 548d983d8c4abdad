"""Run liveness from the step series' heartbeats (``runs.series.liveness_of``): a real agent loop
killed with SIGKILL becomes ``stopped`` once no heartbeat came for the threshold (a setting, 3 s
here), one that exits cleanly is ``finished`` and stays so, one that raises is ``stopped`` (its
exit chunk says it did not end cleanly); a run without a series has none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepdoctor_server.runs.series import StreamBeat, liveness_rule
from support.capture import mint_token, sqlite_env
from support.server import serve_subprocess

STALE_S = 3.0
LOOP = """
import sys, time, torch, stepdoctor
from stepdoctor.series import SeriesSettings
server, token, spool, run, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
fail_at = int(sys.argv[6])
model = torch.nn.Linear(16, 16)
settings = SeriesSettings(chunk_seconds=0.3, anomaly_capture=False)
with stepdoctor.profile("proj", run, server=server, token=token, spool=spool, skip_first=5,
                        series_settings=settings) as prof:
    i = 0
    while steps < 0 or i < steps:
        model(torch.ones(4, 16)).sum().backward()
        time.sleep(0.01)
        prof.step()
        i += 1
        if i == fail_at:
            raise RuntimeError("the loss went NaN")
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = sqlite_env(tmp_path_factory.mktemp("liveness-server"))
    env["STEPDOCTOR_SERIES_STALE_AFTER_S"] = str(STALE_S)
    with serve_subprocess(env) as served:
        yield {"url": served.url, "upload": mint_token(env, "upload"), "read": mint_token(env, "read")}


def start_loop(
    server: dict[str, str], spool: Path, run: str, steps: int, fail_at: int = -1
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPDOCTOR_")}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            LOOP,
            server["url"],
            server["upload"],
            str(spool),
            run,
            str(steps),
            str(fail_at),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def liveness(server: dict[str, str], run: str) -> Any:
    """The run's liveness as the run list and the run itself show it (they must agree); None
    while the run does not exist yet."""
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {server['read']}"}) as api:
        runs = api.get("/api/v1/runs", params={"project": "proj"}).json()["items"]
        found = [r for r in runs if r["name"] == run]
        if not found:
            return None
        detail = api.get(f"/api/v1/runs/{found[0]['id']}").json()
        assert detail["liveness"] == found[0]["liveness"]
        return detail["liveness"]


def wait_for(
    server: dict[str, str],
    run: str,
    wanted: str,
    timeout: float = 180.0,
    meanwhile: Callable[[], object] = lambda: None,
) -> list[Any]:
    """Poll until the run is ``wanted`` (calling ``meanwhile`` at each poll); returns every state
    seen on the way."""
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        meanwhile()
        state = liveness(server, run)
        if not seen or seen[-1] != state:
            seen.append(state)
        if state == wanted:
            return seen
        assert time.monotonic() < deadline, f"{run} never became {wanted}: {seen}"
        time.sleep(0.2)


class Exits:
    """Loops expected to exit by themselves: as each does, its exit code and its run's liveness are
    checked at once (well within the threshold, so its exit chunk decides, not the staleness)."""

    def __init__(self, server: dict[str, str], loops: dict[str, tuple[subprocess.Popen[bytes], int, str]]):
        self.server, self.loops = server, loops
        self.at: dict[str, float] = {}  # when each exited (monotonic)

    def check(self) -> bool:
        for run, (process, code, state) in self.loops.items():
            if run not in self.at and process.poll() is not None:
                self.at[run] = time.monotonic()
                assert process.returncode == code, run
                assert liveness(self.server, run) == state, run
        return len(self.at) == len(self.loops)

    def wait(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.check():
            assert time.monotonic() < deadline, (
                f"still running after {timeout} s: {set(self.loops) - set(self.at)}"
            )
            time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_agent_loop_becomes_stopped_and_a_clean_exit_finished(
    tmp_path: Path, server: dict[str, str]
) -> None:
    """The three loops run at once (each run is judged by its own heartbeats): the clean and the
    crashing one start up and exit while the killed one's heartbeats go stale."""
    killed = start_loop(server, tmp_path / "a", "killed", -1)
    clean = start_loop(server, tmp_path / "b", "clean", 60)
    # a loop that raises: its exit chunk says so, and the run is stopped, not finished
    crashed = start_loop(server, tmp_path / "c", "crashed", 60, fail_at=40)
    # the clean exit's chunk went in the exit flush: finished at once
    exits = Exits(server, {"clean": (clean, 0, "finished"), "crashed": (crashed, 1, "stopped")})
    try:
        wait_for(server, "killed", "live", meanwhile=exits.check)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        seen = wait_for(server, "killed", "stopped", meanwhile=exits.check)
        assert "finished" not in seen
        exits.wait()
    finally:
        for loop in (killed, clean, crashed):
            if loop.poll() is None:
                loop.kill()
                loop.wait()

    time.sleep(max(0.0, exits.at["clean"] + STALE_S + 0.5 - time.monotonic()))
    assert liveness(server, "clean") == "finished"  # past the threshold: still finished, not stopped
    assert liveness(server, "killed") == "stopped"


NOW = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)


def beat(rank: int | None, seconds_ago: float, final: bool = False, clean: bool = True) -> StreamBeat:
    return StreamBeat(rank, NOW - timedelta(seconds=seconds_ago), final, clean)


@pytest.mark.parametrize(
    ("streams", "expected"),
    [
        ([], None),
        ([beat(0, 10)], "live"),
        ([beat(0, 301)], "stopped"),
        ([beat(0, 301, final=True)], "finished"),
        ([beat(0, 5, final=True, clean=False)], "stopped"),  # ended by an exception
        # a killed process restarted: the newer process of the rank decides
        ([beat(0, 900), beat(0, 20, final=True)], "finished"),
        ([beat(0, 900, final=True), beat(0, 400)], "stopped"),
        # every rank must have exited cleanly; any fresh heartbeat keeps the run live
        ([beat(0, 5, final=True), beat(1, 10)], "live"),
        ([beat(0, 5, final=True), beat(1, 600)], "stopped"),
    ],
)
def test_the_liveness_rule(streams: list[StreamBeat], expected: str | None) -> None:
    assert liveness_rule(streams, now=NOW, stale_after_s=300) == expected
