"""Upload-to-report latency: time from an upload's 201 to its analysis row being stored.

Runs the real app (SQLite or ``--database-url``) with one analysis worker process, uploads the
34.8 MB ``trace_diff/control`` fixture ``--repeat`` times, and prints per upload:
- ``latency``: 201 received -> ``analyses`` row visible (polled every 5 ms),
- ``engine``: the engine's own time for the job (``analyses.duration_ms``),
- ``queue overhead``: latency - engine (claim wake-up, reading metadata, storing, run aggregate),
and, side by side, the same file analysed in this process (``analyze_path``) as the baseline.

    .venv/bin/python bench/server_analysis_latency.py [--repeat 5] [--database-url URL]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import select

from stepdoctor_server.auth import tokens as auth
from stepdoctor_server.core.migrate import upgrade
from stepdoctor_server.core.models import Analysis
from stepdoctor_server.core.settings import Settings
from stepdoctor_server.web.app import create_app

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/traces/hta/trace_diff/control/control.json.gz"
TARGET_S = 2.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--trace", type=Path, default=FIXTURE)
    args = parser.parse_args()
    body = args.trace.read_bytes()

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=args.database_url, workers=1)
        upgrade(settings)
        app = create_app(settings)
        with app.state.db.session() as session:
            team, _ = auth.get_or_create_team(session, f"bench-{uuid.uuid4().hex[:6]}")
            _, token = auth.create_token(session, team, scope="admin", name="bench")
        latencies, engine = [], []
        with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
            time.sleep(2.0)  # let the worker process start and import the engine
            for i in range(args.repeat):
                resp = client.post(
                    "/api/v1/traces",
                    params={"project": "bench", "run": f"r{i}", "rank": 0},
                    content=body,
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                )
                t0 = time.perf_counter()
                assert resp.status_code == 201, resp.text
                trace_id = resp.json()["id"]
                duration_ms = _wait_analysis(app, trace_id)
                latencies.append(time.perf_counter() - t0)
                engine.append(duration_ms / 1000)
                print(
                    f"upload {i}: latency {latencies[-1]:.3f} s, engine {engine[-1]:.3f} s, "
                    f"queue overhead {latencies[-1] - engine[-1]:.3f} s"
                )

    from stepdoctor_analysis.pipeline import analyze_path

    t = time.perf_counter()
    analyze_path(args.trace)
    direct = time.perf_counter() - t
    med = statistics.median(latencies)
    print(
        f"\ntrace: {args.trace.name} ({len(body) / 1e6:.1f} MB gzip), backend: {settings.database_url.get_secret_value().split(':')[0]}"
    )
    print(
        f"median upload->stored latency: {med:.3f} s (target < {TARGET_S} s: {'met' if med < TARGET_S else 'MISSED'})"
    )
    print(f"median engine time in worker:  {statistics.median(engine):.3f} s")
    print(f"in-process analyze_path:       {direct:.3f} s  (latency / direct = {med / direct:.2f}x)")
    return 0


def _wait_analysis(app: object, trace_id: int, timeout: float = 120.0) -> int:
    db = app.state.db  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with db.session() as session:
            ms = session.scalar(select(Analysis.duration_ms).where(Analysis.trace_id == trace_id))
        if ms is not None:
            return int(ms)
        time.sleep(0.005)
    raise TimeoutError(f"trace {trace_id} not analysed after {timeout}s")


if __name__ == "__main__":
    raise SystemExit(main())
