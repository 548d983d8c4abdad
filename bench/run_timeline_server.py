"""Server time of a 10-million-step run: its chunks uploaded, its run page and ``GET /api/v1/runs/{id}``.

Builds the chunks like ``bench/run_timeline_speed.py`` (the agent's encoder, 10,000 steps each),
uploads them through ``POST /api/v1/series`` into a fresh migrated database (SQLite by default,
``--database-url`` for PostgreSQL), then times in-process (``TestClient``: routing, database,
templates, figure; no network):

* the first API read, which runs the engine's ``run_timeline`` over every stored chunk (a GET keeps
  nothing), then the workers' sweep (``series.refresh_run_timelines``) that keeps it (``run_timelines``);
* the API and the run page after that (the kept timeline: the same 1,000 display points);
* a read after one more chunk arrived, within ``run_timeline_refresh_s`` (the kept one, a live run's
  view) and with the refresh at 0 (everything recomputed, what ``check`` pays).

Prints medians of ``--repeat`` requests and the stored bytes. Timings only: no assertions.

    .venv/bin/python bench/run_timeline_server.py [--steps 10000000] [--repeat 5] [--database-url URL]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from run_timeline_speed import chunks  # noqa: E402


def timed(call: Callable[[], object], repeat: int) -> float:
    took = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--database-url", default="", help="default: a SQLite file in a temporary directory")
    args = p.parse_args()

    from fastapi.testclient import TestClient

    from stepdoctor_server.auth import tokens as auth
    from stepdoctor_server.core import migrate
    from stepdoctor_server.core.settings import Settings
    from stepdoctor_server.runs import series
    from stepdoctor_server.web.app import create_app

    data = chunks(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=args.database_url, workers=0)
        migrate.upgrade(settings)
        app = create_app(settings)
        with app.state.db.session() as session:
            team, _ = auth.get_or_create_team(session, f"bench-{int(time.time())}")
            _, admin = auth.create_token(session, team, scope="admin", name="bench")
        with TestClient(app, headers={"Authorization": f"Bearer {admin}"}) as api:
            start = time.perf_counter()
            for chunk in data[:-1]:
                sent = api.post("/api/v1/series", params={"project": "bench", "run": "long"}, content=chunk)
                assert sent.status_code == 201, sent.text
            upload_s = time.perf_counter() - start
            run_id = sent.json()["run_id"]
            api_url, page_url = f"/api/v1/runs/{run_id}", f"/runs/{run_id}"
            login = api.post(
                "/login",
                content=f"token={admin}&next=/",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
                follow_redirects=False,
            )
            assert login.status_code == 303, login.text

            def page() -> None:
                shown = api.get(page_url, follow_redirects=False)
                assert shown.status_code == 200 and 'id="plot-timeline"' in shown.text, shown.status_code

            print(
                f"{args.steps:,} steps in {len(data):,} chunks, {sum(map(len, data)) / 1e6:.1f} MB: uploaded "
                f"in {upload_s:.1f} s ({upload_s / (len(data) - 1) * 1000:.1f} ms per chunk)"
            )
            first = timed(lambda: api.get(api_url).raise_for_status(), 1)
            print(f"first API read (run_timeline over every chunk, not kept by a GET): {first:.0f} ms")
            swept = timed(lambda: series.refresh_run_timelines(app.state.db), 1)
            print(f"the workers' sweep keeps it: {swept:.0f} ms")
            print(
                f"API read, kept timeline: {timed(lambda: api.get(api_url).raise_for_status(), args.repeat):.0f} ms"
            )
            print(f"run page, kept timeline: {timed(page, args.repeat):.0f} ms")
            api.post("/api/v1/series", params={"project": "bench", "run": "long"}, content=data[-1])
            live = timed(page, args.repeat)
            print(f"run page after a new chunk, within run_timeline_refresh_s: {live:.0f} ms")
            app.state.settings.run_timeline_refresh_s = 0.0
            fresh = timed(page, 1)
            print(f"run page after a new chunk, refresh 0 (computed, not kept): {fresh:.0f} ms")
        app.state.db.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
