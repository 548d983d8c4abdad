"""Server time of the dashboard pages with 10,000 runs in the database (target: under 300 ms each).

Builds a fresh migrated database (SQLite by default, ``--database-url`` for PostgreSQL), analyses two
real fixture traces (the largest HTA fixture, whose report carries the biggest step timeline and
tables, and a small one), inserts ``--runs`` runs into one project with a copy of a real diagnosis,
then times each page in-process (``TestClient``: request routing, database, templates, figures; no
network). Prints the median and worst of ``--repeat`` requests per page, next to the target.

Pages are fast whatever the trace size because nothing on the request path opens a trace: the worker
stores the report with its precomputed step timeline (``step_timeline``, at most 400 boxes per lane)
and tables (50 rows each), so a page reads one bounded JSON document.

    .venv/bin/python bench/dashboard_pages.py [--runs 10000] [--repeat 15] [--database-url URL]
        [--big-trace-mb 850]   # also: a trace of that size (the big fixture tiled), analysed, paged, cut
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.fixtures import HTA_TRACES  # noqa: E402
from support.server import drain, upload  # noqa: E402

BIG = HTA_TRACES / "df_index_resolver" / "df_index_resolver.json.gz"
SMALL = HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz"
TARGET_MS = 300.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--database-url", default="", help="default: a SQLite file in a temporary directory")
    p.add_argument("--big-trace-mb", type=int, default=0, help="tile the big fixture to about this size")
    args = p.parse_args()

    from fastapi.testclient import TestClient

    from stepdoctor_server.auth import tokens as auth
    from stepdoctor_server.core import migrate
    from stepdoctor_server.core.models import Analysis, Run
    from stepdoctor_server.core.settings import Settings
    from stepdoctor_server.web.app import create_app

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=args.database_url, workers=0)
        migrate.upgrade(settings)
        app = create_app(settings)
        with app.state.db.session() as session:
            team, _ = auth.get_or_create_team(session, f"bench-{int(time.time())}")
            _, admin = auth.create_token(session, team, scope="admin", name="bench")
            team_id = team.id
        source = BIG
        if args.big_trace_mb:
            t0 = time.perf_counter()
            source = tile_trace(BIG, Path(tmp) / "tiled.pt.trace.json.gz", args.big_trace_mb)
            print(
                f"tiled {BIG.name} to {source.stat().st_size / 2**20:.0f} MiB gzip in {time.perf_counter() - t0:.0f} s"
            )
        with TestClient(app, headers={"Authorization": f"Bearer {admin}"}) as api:
            t0 = time.perf_counter()
            big = upload(api, source.read_bytes(), project="bench", run="big").json()
            print(f"uploaded in {time.perf_counter() - t0:.1f} s")
            small = upload(api, SMALL.read_bytes(), project="bench", run="small").json()
        t0 = time.perf_counter()
        drain(app)
        print(f"analysed in {time.perf_counter() - t0:.1f} s")
        if args.big_trace_mb:
            from stepdoctor_analysis.trim import trim_trace

            with app.state.db.session() as session:
                numbers = [
                    s["number"]
                    for s in session.get(Analysis, _analysis_id(session, big["id"])).report["steps"]
                ]
            t0 = time.perf_counter()
            cut = trim_trace(source, Path(tmp) / "cut.pt.trace.json.gz", numbers[0], numbers[0])
            size = (Path(tmp) / "cut.pt.trace.json.gz").stat().st_size
            print(
                f"trimmed step {numbers[0]} in {time.perf_counter() - t0:.1f} s: kept {cut.kept:,} of "
                f"{cut.kept + cut.dropped:,} events, {size / 2**20:.1f} MiB"
            )
        with app.state.db.session() as session:
            diagnosis = session.get(Run, big["run_id"]).diagnosis
            project_id = session.get(Run, big["run_id"]).project_id
            t0 = time.perf_counter()
            now = datetime.now(timezone.utc)
            kinds = ("input", "compute", "launch", "sync", "communication", None)
            session.add_all(
                Run(
                    project_id=project_id,
                    name=f"run-{i:05d}",
                    tags=["sweep"] if i % 7 == 0 else [],
                    created_at=now - timedelta(seconds=i),
                    updated_at=now - timedelta(seconds=i),
                    primary_kind=kinds[i % len(kinds)],
                    diagnosis=diagnosis,
                )
                for i in range(args.runs)
            )
            session.commit()
            print(
                f"inserted {args.runs:,} runs in {time.perf_counter() - t0:.1f} s ({settings.database_url.get_secret_value().split(':')[0]})"
            )
        pages = {
            "home /": "/",
            "runs list /runs": "/runs",
            "runs list, page 100": "/runs?page=100",
            "runs list, search": "/runs?q=run-0999",
            "project, newest": f"/projects/{project_id}",
            "project, by name, page 150": f"/projects/{project_id}?sort=name&page=150",
            "project, kind filter": f"/projects/{project_id}?kind=input",
            "run page (big report)": f"/runs/{big['run_id']}",
            "trace page (big report)": f"/traces/{big['id']}",
            "compare": f"/compare?base={small['run_id']}&other={big['run_id']}",
        }
        with TestClient(app) as browser:
            with app.state.db.session() as session:
                _, reader = auth.create_token(session, session.merge(team), scope="read", name="bench-read")
            browser.post(
                "/login",
                content=f"token={reader}&next=/",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
                follow_redirects=False,
            )
            print(f"{'page':<30}{'median ms':>11}{'max ms':>9}{'/ target':>10}")
            worst = 0.0
            for label, url in pages.items():
                times = []
                for _ in range(args.repeat + 1):
                    t = time.perf_counter()
                    resp = browser.get(url)
                    times.append((time.perf_counter() - t) * 1000.0)
                    assert resp.status_code == 200, (url, resp.status_code, resp.text[:300])
                times = times[1:]  # the first request warms caches (templates, plotly JSON encoder)
                med = statistics.median(times)
                worst = max(worst, med)
                print(f"{label:<30}{med:>11.1f}{max(times):>9.1f}{med / TARGET_MS:>10.2f}")
        print(
            f"slowest median {worst:.1f} ms: {'within' if worst < TARGET_MS else 'OVER'} the {TARGET_MS:.0f} ms target"
        )
        del team_id
        app.state.db.dispose()
    return 0


def _analysis_id(session: object, trace_id: int) -> int:
    from sqlalchemy import select

    from stepdoctor_server.core.models import Analysis

    return int(session.scalar(select(Analysis.id).where(Analysis.trace_id == trace_id)))  # type: ignore[attr-defined]


def tile_trace(src: Path, dst: Path, target_mb: int) -> Path:
    """``src`` repeated, each copy shifted after the previous one in time, with its steps renumbered and
    its correlation/flow ids offset, until the decompressed text is about ``target_mb``: a trace of
    that size with real events, for timing what depends on size."""
    import gzip
    import json

    doc = json.loads(gzip.decompress(src.read_bytes()))
    events = doc.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), int | float)]
    span = max(e["ts"] + (e.get("dur") or 0) for e in timed) - min(e["ts"] for e in timed)
    copies = max(1, round(target_mb * 1e6 / len(json.dumps(events))))
    with gzip.open(dst, "wt", compresslevel=1) as out:
        out.write('{"traceEvents": [\n')
        first = True
        for k in range(copies):
            for e in events:
                e = dict(e)
                if isinstance(e.get("ts"), int | float):
                    e["ts"] = e["ts"] + k * (span + 1000)
                name = e.get("name")
                if isinstance(name, str) and name.startswith("ProfilerStep#"):
                    e["name"] = f"ProfilerStep#{int(name[13:]) + k * 1000}"
                if "id" in e and isinstance(e["id"], int):
                    e["id"] += k * 10**8
                args = e.get("args")
                if isinstance(args, dict):
                    args = dict(args)
                    for key in ("correlation", "External id"):
                        if isinstance(args.get(key), int):
                            args[key] += k * 10**8
                    e["args"] = args
                out.write(("" if first else ",\n") + json.dumps(e))
                first = False
        out.write("\n]")
        for key, value in doc.items():
            out.write(f",\n{json.dumps(key)}: {json.dumps(value)}")
        out.write("}\n")
    return dst


if __name__ == "__main__":
    raise SystemExit(main())
