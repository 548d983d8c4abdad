"""The dashboard's tables: collectives by type on the trace and run pages (the rows the CLI prints,
from the same report), and times shown with their zone."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_server.core.models import Project, Run
from support.dashboard_traces import ALL_REDUCE_NELEMS as NELEMS
from support.dashboard_traces import ddp_recorded_trace
from support.server import drain, logged_in, synthetic_trace, upload


def _cells(page: str, table_id: str) -> list[list[str]]:
    body = page.split(f'id="{table_id}"', 1)[1].split("</tbody>", 1)[0].split("<tbody>", 1)[1]
    return [
        [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in body.split("</tr>")
        if "<td" in row
    ]


def test_collectives_table_on_trace_and_run_pages_shows_the_report_rows(
    client: TestClient, app: FastAPI, read_token: str, tmp_path: Path
) -> None:
    made = [
        upload(
            client,
            ddp_recorded_trace(tmp_path / f"r{r}.json", r).read_bytes(),
            run="ddp",
            rank=r,
            gzipped=False,
        ).json()
        for r in (0, 1)
    ]
    drain(app)
    report = client.get(f"/api/v1/traces/{made[0]['id']}").json()["analysis"]["report"]
    (stat,) = report["metrics"]["communication"]["by_type"]
    assert stat["type"] == "all_reduce" and stat["bytes_per_step"] == 2 * NELEMS and stat["algbw_gbps"]
    with logged_in(app, read_token) as browser:
        trace_page = browser.get(f"/traces/{made[0]['id']}").text
        run_page = browser.get(f"/runs/{made[0]['run_id']}").text
    heads = re.findall(
        r"<th(?:\s[^>]*)?>(.*?)</th>", trace_page.split('id="collectives"', 1)[1].split("</thead>")[0]
    )
    assert heads == ["collective", "exposed", "overlapped", "calls", "bytes", "algbw"]
    (row,) = _cells(trace_page, "collectives")
    assert row[0] == "all_reduce (nccl)"
    assert row[1] == "1 ms" and row[2] == "0 µs" and row[3] == "1"
    assert row[4] == "128 MiB" and row[5] == f"{stat['algbw_gbps']:.1f} GB/s"
    # The run page shows its representative trace's rows, the same cells.
    assert "Collectives by type" in run_page
    assert _cells(run_page, "collectives") == [row]


def test_times_are_shown_with_their_zone(client: TestClient, app: FastAPI, read_token: str) -> None:
    made = upload(client, synthetic_trace()).json()
    when = datetime(2026, 3, 4, 5, 6, tzinfo=timezone.utc)
    with app.state.db.session() as session:
        run = session.get(Run, made["run_id"])
        assert run is not None
        run.updated_at = when
        session.get(Project, run.project_id)
        session.commit()
    with logged_in(app, read_token) as browser:
        for path in ("/", "/runs"):
            page = browser.get(path).text
            assert '<time datetime="2026-03-04T05:06:00+00:00">2026-03-04 05:06 UTC</time>' in page, path
            assert not re.search(r">\d{4}-\d\d-\d\d \d\d:\d\d<", page), path  # none without a zone
