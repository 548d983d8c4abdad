"""``python -m stepdoctor_server.demo --host H --port P``: the whole product in one command.

Starts ``stepdoctor serve`` (embedded defaults: SQLite and a trace store under
``STEPDOCTOR_DATA_DIR``), creates tokens through the CLI, runs the agent's demo training twice
(DataLoader ``num_workers=0``, then ``2``: a before/after pair), waits for the analyses, prints the
dashboard URL, the login token and one line per run, then keeps the server in the foreground
until Ctrl-C. Everything goes through the public interfaces (CLI, HTTP), as a user would.

Each invocation trains fresh runs (names stamped with the start time), so a second demo never
mixes its traces into the first one's runs; earlier runs stay in the data directory and the demo
says so. The step time printed per run is the analysed one, formatted as the dashboard shows it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

PROJECT = "demo"
TEAM = "default"
RUNS = (("workers0", 0), ("workers2", 2))  # name prefix, DataLoader num_workers
READY_TIMEOUT_S = 120.0
ANALYSIS_TIMEOUT_S = 600.0


class DemoError(Exception):
    """A step of the demo failed; printed as one line."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stepdoctor_server.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per run (demo_train's default)"
    )
    parser.add_argument("--no-wait", action="store_true", help="exit after the summary instead of serving")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    _stop_on_signals()

    client_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{client_host}:{args.port}"
    data_dir = Path(os.environ.get("STEPDOCTOR_DATA_DIR", "./stepdoctor-data")).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "demo-server.log"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs_of_this_demo = [(f"{prefix}-{stamp}", workers) for prefix, workers in RUNS]
    server = _start_server(args.host, args.port, log_path)
    try:
        _wait_ready(server, url, log_path)
        upload_token = _create_token("upload", "demo agent")
        login_token = _create_token("read", "demo dashboard")
        _say_what_is_added(url, login_token, data_dir, [name for name, _ in runs_of_this_demo])
        for run, workers in runs_of_this_demo:
            _train(run, workers, url, upload_token, args.steps, data_dir / "spool")
        runs = _wait_analyses(url, login_token, [name for name, _ in runs_of_this_demo])
        _summary(url, login_token, runs, log_path)
        if args.no_wait:
            return 0
        print("\nServing in the foreground; press Ctrl-C to stop.", flush=True)
        return _foreground(server)
    except DemoError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        print(f"demo: server log: {log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        _stop(server)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (``docker stop``, a supervisor) both stop the server before we exit,
    even when the demo was started with SIGINT ignored (a background job of a script)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stepdoctor", *args]


def _start_server(host: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    print(f"Starting stepdoctor serve on {host}:{port} (log: {log_path}) ...", flush=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            _cli("serve", "--host", host, "--port", str(port)), stdout=log, stderr=subprocess.STDOUT
        )


def _wait_ready(server: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise DemoError(f"stepdoctor serve exited with status {server.returncode}: {tail[0]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise DemoError(f"the server did not become ready at {url} within {READY_TIMEOUT_S:.0f} s")


def _create_token(scope: str, name: str) -> str:
    out = subprocess.run(
        _cli("token", "create", "--team", TEAM, "--create-team", "--scope", scope, "--name", name),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise DemoError(f"token creation failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return lines[-1].strip()


def _say_what_is_added(url: str, token: str, data_dir: Path, names: list[str]) -> None:
    """Fresh runs every time; say whether they join earlier demo runs in this data directory."""
    listed = httpx.get(
        f"{url}/api/v1/runs",
        params={"project": PROJECT, "limit": 200},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10.0,
    )
    earlier = len(listed.json().get("items", [])) if listed.status_code == 200 else 0
    where = f"project {PROJECT!r} in {data_dir}"
    if earlier:
        print(
            f"New runs {', '.join(names)} join {earlier} earlier run(s) of {where} "
            "(`make clean` or another STEPDOCTOR_DATA_DIR starts empty).",
            flush=True,
        )
    else:
        print(f"New runs {', '.join(names)} in {where}.", flush=True)


def _train(run: str, workers: int, url: str, token: str, steps: int | None, spool: Path) -> None:
    """One demo training run; its agent spools inside the data directory, which ``make clean`` removes."""
    print(f"Training demo run {run!r} (DataLoader num_workers={workers}) ...", flush=True)
    cmd = [sys.executable, "-m", "stepdoctor.demo_train", "--run", run, "--workers", str(workers)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    env = {
        **os.environ,
        "STEPDOCTOR_SERVER": url,
        "STEPDOCTOR_TOKEN": token,
        "STEPDOCTOR_PROJECT": PROJECT,
        "STEPDOCTOR_SPOOL": str(spool),
    }
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise DemoError(f"demo training {run!r} failed with status {done.returncode}")


def _wait_analyses(url: str, token: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Run details (in ``names`` order) once every trace of these runs is analysed (done or failed)."""
    headers = {"Authorization": f"Bearer {token}"}
    print("Waiting for the analyses ...", flush=True)
    deadline = time.monotonic() + ANALYSIS_TIMEOUT_S
    wanted = set(names)
    with httpx.Client(base_url=url, headers=headers, timeout=10.0) as client:
        while time.monotonic() < deadline:
            listed = client.get("/api/v1/runs", params={"project": PROJECT, "limit": 200})
            listed.raise_for_status()
            ids = {r["name"]: r["id"] for r in listed.json()["items"] if r["name"] in wanted}
            details = {name: client.get(f"/api/v1/runs/{rid}").json() for name, rid in ids.items()}
            if len(details) == len(wanted) and all(_finished(d) for d in details.values()):
                return {name: details[name] for name in names}
            time.sleep(0.5)
    raise DemoError(f"analyses not finished after {ANALYSIS_TIMEOUT_S:.0f} s")


def _finished(run: dict[str, Any]) -> bool:
    counts = run.get("trace_status") or {}
    return sum(counts.values()) > 0 and not counts.get("pending") and not counts.get("running")


def diagnosis_line(name: str, run: dict[str, Any]) -> str:
    """One line: the run's bottleneck, its share, the mean step and the next change to make."""
    diag = run.get("diagnosis") or {}
    primary = diag.get("primary")
    if not primary:
        failed = (run.get("trace_status") or {}).get("failed", 0)
        return f"{name}: no diagnosis ({failed} trace(s) failed analysis)"
    from stepdoctor_dashboard.formatting import duration  # the dashboard's own rendering of the figure

    recs = diag.get("recommendations") or []
    advice = f" -> next: {recs[0].get('title')}" if recs else ""
    step = duration(float(diag.get("step_time_us") or 0.0))
    return f"{name}: {primary['kind']}-bound ({primary['share']:.0%} of step time), mean step {step}{advice}"


def _summary(url: str, token: str, runs: dict[str, dict[str, Any]], log_path: Path) -> None:
    print("\n" + "=" * 72)
    print(f"Dashboard:    {url}/")
    print(f"Login token:  {token}   (read-only; shown once)")
    print(f"API docs:     {url}/docs      server log: {log_path}")
    print("Diagnosis (mean of the profiled steps, as on the dashboard):")
    for name, run in runs.items():
        print(f"  {diagnosis_line(name, run)}")
        print(f"    {url}/runs/{run['id']}")
    ids = [run["id"] for run in runs.values()]
    print(f"Compare:      {url}/compare?base={ids[0]}&other={ids[1]}")
    print("=" * 72, flush=True)


def _foreground(server: subprocess.Popen[bytes]) -> int:
    try:
        return server.wait()
    except KeyboardInterrupt:
        return 0


def _stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


if __name__ == "__main__":
    raise SystemExit(main())
