"""Upload and catalog speed of a real ``stepdoctor serve`` process on 127.0.0.1.

1. 20 concurrent uploads of a ~50 MB (on the wire, gzip) trace built by repeating a real fixture's
   events: every trace must be stored with the sha256 the client computed; prints the server's
   peak RSS (target < 400 MB: bodies stream to disk, never into memory) and the throughput.
2. GET /api/v1/runs over 10,000 runs (rows inserted directly): median latency of first pages,
   filtered pages and a deep cursor page (target < 100 ms).

    .venv/bin/python bench/server_upload.py [--database-url postgresql+psycopg://...] [--mb 50]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "hta" / "trace_diff" / "control" / "control.json.gz"

from support.server import serve_subprocess  # noqa: E402


def build_trace(target_bytes: int, out: Path) -> tuple[int, str, int]:
    """Repeat the fixture's events (shifted in time) until the gzip file reaches ``target_bytes``."""
    doc = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    events = doc.pop("traceEvents")
    span = max(float(e.get("ts", 0) or 0) for e in events) - min(float(e.get("ts", 0) or 0) for e in events)
    head = json.dumps(doc)[:-1] + ', "traceEvents": ['
    raw_size = 0
    with out.open("wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=6) as gz:
        raw_size += gz.write(head.encode())
        copy = 0
        while fh.tell() < target_bytes:
            shift = copy * (span + 1000.0)
            chunk = ",".join(json.dumps({**e, "ts": e["ts"] + shift} if "ts" in e else e) for e in events)
            raw_size += gz.write(((", " if copy else "") + chunk).encode())
            copy += 1
        raw_size += gz.write(b"]}")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    return out.stat().st_size, digest, raw_size


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def create_token(env: dict[str, str]) -> str:
    from stepdoctor_server import cli
    from stepdoctor_server.core.settings import get_settings

    os.environ.update(env)
    get_settings.cache_clear()
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli.main(["db", "upgrade"]) == 0
        assert cli.main(["token", "create", "--team", "bench", "--scope", "admin"]) == 0
    return buffer.getvalue().strip().splitlines()[-1]


def bench_uploads(url: str, token: str, body: bytes, digest: str, n: int, data_dir: Path) -> dict[str, float]:
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
    }

    def one(rank: int) -> dict[str, object]:
        with httpx.Client(base_url=url, timeout=600) as client:
            response = client.post(
                "/api/v1/traces",
                params={"project": "bench", "run": f"upload-{int(time.time())}", "rank": rank},
                content=body,
                headers={**headers, "Idempotency-Key": f"bench-{time.time_ns()}-{rank}"},
            )
            response.raise_for_status()
            return dict(response.json())

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        created = list(pool.map(one, range(n)))
    elapsed = time.perf_counter() - start
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client:
        for item in created:
            trace = client.get(f"/api/v1/traces/{item['id']}").json()
            assert trace["sha256"] == digest, f"trace {item['id']}: sha256 mismatch"
            assert trace["size_bytes"] == len(body)
    stored = [p for p in (data_dir / "traces").rglob("*.json.gz")]
    assert len(stored) >= n
    for path in stored:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{path}: sha256 mismatch on disk"
    leftovers = list((data_dir / "traces" / "tmp").glob("*"))
    assert not leftovers, f"temp files left: {leftovers}"
    return {"seconds": elapsed, "mb_per_s": n * len(body) / elapsed / 1e6}


def insert_runs(database_url: str, data_dir: Path, count: int) -> None:
    from sqlalchemy import insert, select

    from stepdoctor_server.core.database import Database
    from stepdoctor_server.core.models import Project, Run, Team
    from stepdoctor_server.core.settings import Settings

    db = Database(Settings(data_dir=data_dir, database_url=database_url))
    kinds = ["input", "transfer", "launch", "memory", "sync", "communication", "compute"]
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with db.session() as session:
        team_id = session.scalars(select(Team.id).where(Team.name == "bench")).one()
        project_ids = []
        for i in range(20):
            project = Project(team_id=team_id, name=f"listing-{i}")
            session.add(project)
            session.flush()
            project_ids.append(project.id)
        rows = [
            {
                "project_id": project_ids[i % 20],
                "name": f"run-{i:05d}",
                "tags": ["nightly" if i % 10 == 0 else "adhoc", f"bs{2 ** (i % 8)}"],
                "created_at": t0 + timedelta(minutes=i),
                "updated_at": t0 + timedelta(minutes=i, seconds=30),
                "primary_kind": kinds[i % 7],
            }
            for i in range(count)
        ]
        session.execute(insert(Run), rows)
    if database_url.startswith("postgresql"):
        # What autovacuum does shortly after a bulk load; without statistics the planner guesses.
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE")
    db.dispose()


def bench_listing(url: str, token: str, repeats: int) -> dict[str, float]:
    results: dict[str, float] = {}
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client:
        deep = None
        for _ in range(40):  # walk 40 pages of 50 for a deep cursor
            page = client.get(
                "/api/v1/runs", params={"limit": 50, **({"cursor": deep} if deep else {})}
            ).json()
            deep = page["next"]
        queries = {
            "first page (50, newest)": {"limit": 50},
            "first page (200, by name)": {"limit": 200, "sort": "name"},
            "tag=nightly": {"limit": 50, "tag": "nightly"},
            "project + primary_kind": {"limit": 50, "project": "listing-3", "primary_kind": "sync"},
            "page 41 via cursor": {"limit": 50, "cursor": deep},
        }
        for label, params in queries.items():
            timings = []
            for _ in range(repeats):
                start = time.perf_counter()
                response = client.get("/api/v1/runs", params=params)
                timings.append((time.perf_counter() - start) * 1000)
                assert response.status_code == 200 and response.json()["items"], label
            results[label] = statistics.median(timings)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", default="", help="default: SQLite in a temp data dir")
    parser.add_argument("--mb", type=float, default=50.0, help="upload size on the wire (MB)")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--runs", type=int, default=10_000)
    args = parser.parse_args()
    if not FIXTURE.is_file():
        print(f"fixture missing: {FIXTURE}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="stepdoctor-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        env = {"STEPDOCTOR_DATA_DIR": str(data_dir), "STEPDOCTOR_WORKERS": "0"}
        if args.database_url:
            env["STEPDOCTOR_DATABASE_URL"] = args.database_url
        database_url = args.database_url or f"sqlite:///{data_dir / 'stepdoctor.sqlite3'}"
        trace_path = Path(tmp) / "big.pt.trace.json.gz"
        size, digest, raw = build_trace(int(args.mb * 1e6), trace_path)
        print(f"trace: {size / 1e6:.1f} MB gzip ({raw / 1e6:.0f} MB JSON), sha256 {digest[:12]}…")
        token = create_token(env)
        body = trace_path.read_bytes()
        with serve_subprocess(env) as server:
            base_rss = peak_rss_mb(server.process.pid)
            up = bench_uploads(server.url, token, body, digest, args.concurrency, data_dir)
            peak = peak_rss_mb(server.process.pid)
            print(
                f"uploads: {args.concurrency} x {size / 1e6:.1f} MB concurrently in {up['seconds']:.1f} s "
                f"= {up['mb_per_s']:.0f} MB/s on the wire; all sha256 match; no temp files left"
            )
            print(f"server peak RSS: {peak:.0f} MB (idle {base_rss:.0f} MB; target < 400 MB)")
            insert_runs(database_url, data_dir, args.runs)
            listing = bench_listing(server.url, token, repeats=30)
            backend = "PostgreSQL" if args.database_url.startswith("postgresql") else "SQLite"
            print(f"GET /api/v1/runs over {args.runs} runs ({backend}), median of 30 (target < 100 ms):")
            for label, ms in listing.items():
                print(f"  {label:<28} {ms:6.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
