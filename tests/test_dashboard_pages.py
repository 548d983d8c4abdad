"""Dashboard pages for #14: verdict from the aggregate, facts, drawn step, compare, paging, trims, errors, assets."""

from __future__ import annotations

import gzip
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis import BOTTLENECK_KINDS
from stepdoctor_analysis import parsing as parse
from stepdoctor_analysis.model import steps
from stepdoctor_server.core.models import Project, Run
from support.dashboard import page_plots
from support.fixtures import HTA_TRACES
from support.server import drain, logged_in, upload

SIMPLE_ADD = HTA_TRACES / "critical_path" / "simple_add" / "benchmark_result_493459_1694039959_trace.json.gz"
TWO_STEPS = HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz"
FAST = HTA_TRACES / "trace_compare" / "test" / "test.json.gz"


def test_run_page_verdict_facts_tables_and_steps(client: TestClient, app: FastAPI, read_token: str) -> None:
    made = upload(client, TWO_STEPS.read_bytes(), project="p", run="r").json()
    drain(app)
    api = client.get(f"/api/v1/runs/{made['run_id']}").json()["diagnosis"]
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/runs/{made['run_id']}").text
    verdict = page.split('id="verdict"', 1)[1].split("</div>\n</div>", 1)[0]
    assert f">{api['primary']['kind']}</strong>:" in verdict
    assert f"{api['primary']['share'] * 100:.0f}%" in verdict
    assert api["recommendations"][0]["title"] in verdict
    assert 'id="device-summary"' in page and "GPU utilization" in page
    assert 'table class="sortable" id="kernels"' in page and 'id="operators"' in page
    assert "551–552" in page  # the steps column, from the report when the upload had no step metadata


def test_trace_page_draws_one_step_and_offers_a_step_download(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    made = upload(client, TWO_STEPS.read_bytes(), project="p", run="r").json()
    drain(app)
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/traces/{made['id']}?step=552").text
        assert 'id="trim-form"' in page
        plots = page_plots(page)
        step = plots["plot-step"]
        charged = {t["name"] for t in step["data"] if t.get("showlegend") is not False}
        assert charged and charged <= {*BOTTLENECK_KINDS, "other"}
        assert "Step 552" in step["layout"]["title"]["text"]
        cut = browser.get(f"/traces/{made['id']}/download?steps=552")
        assert cut.status_code == 200
        assert 0 < len(cut.content) < TWO_STEPS.stat().st_size
        assert "steps552" in cut.headers["content-disposition"]
        bad = browser.get(f"/traces/{made['id']}/download?steps=9-1")
        assert bad.status_code == 422 and "reversed" in bad.text and "<html" in bad.text
    api = client.get(f"/api/v1/traces/{made['id']}/download?steps=551")
    assert api.status_code == 200
    path = app.state.settings.data_dir / "cut.json.gz"
    path.write_bytes(api.content)
    assert [s.number for s in steps.find_steps(parse.load_trace(path))] == [551]
    missing = client.get(f"/api/v1/traces/{made['id']}/download?steps=3")
    assert missing.status_code == 422 and missing.json()["error"]["code"] == "cannot_trim"


def test_warnings_and_a_failed_trace_reason_are_shown(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    made = upload(client, SIMPLE_ADD.read_bytes(), project="p", run="nomarkers").json()
    broken = upload(
        client,
        gzip.compress(b'{"traceEvents": [{"ph": "i", "name": "[memory]", "ts": 1, "args": {"Bytes": 64}}]}'),
        project="p",
        run="broken",
    ).json()
    drain(app)
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/runs/{made['run_id']}").text
        assert 'id="warnings"' in page and "no ProfilerStep markers" in page
        failed = browser.get(f"/traces/{broken['id']}").text
        assert "Analysis failed" in failed


def test_compare_reads_slower_with_a_factor_above_one(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    fast = upload(client, FAST.read_bytes(), project="p", run="fast").json()
    slow = upload(client, TWO_STEPS.read_bytes(), project="p", run="slow").json()
    drain(app)
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/compare?base={fast['run_id']}&other={slow['run_id']}").text
    factor = page.split('class="factor">', 1)[1].split("</strong>", 1)[0]
    number, word = factor.split("× ")
    assert word == "slower" and float(number) > 1.0
    assert 'id="kinds"' in page and "per step" in page
    with logged_in(app, read_token) as browser:
        back = browser.get(f"/compare?base={slow['run_id']}&other={fast['run_id']}").text
    assert "faster</strong>" in back
    assert 'id="prediction"' in back and "Predicted vs measured" in back


def test_a_thousand_run_project_is_paged_searchable_and_filtered(
    app: FastAPI, read_token: str, team: Any
) -> None:
    now = datetime.now(timezone.utc)
    with app.state.db.session() as session:
        project = Project(team_id=team.id, name="big")
        session.add(project)
        session.flush()
        session.add_all(
            Run(
                project_id=project.id,
                name=f"run-{i:04d}",
                tags=[],
                created_at=now - timedelta(minutes=i),
                updated_at=now - timedelta(minutes=i),
                primary_kind="input" if i % 10 == 0 else "compute",
            )
            for i in range(1000)
        )
        session.commit()
        pid = project.id
    with logged_in(app, read_token) as browser:
        first = browser.get(f"/projects/{pid}").text
        assert "Runs 1–50 of 1,000" in first and "page 1 of 20" in first
        assert first.count('href="/runs/') == 50 and "run-0000" in first
        last = browser.get(f"/projects/{pid}?page=20").text
        assert "Runs 951–1,000 of 1,000" in last and "run-0999" in last
        found = browser.get(f"/projects/{pid}?q=run-012").text
        assert "of 10<" in found
        inputs = browser.get(f"/projects/{pid}?kind=input&sort=name").text
        assert "of 100<" in inputs and "run-0000" in inputs
        assert browser.get("/runs?sort=name").status_code == 200


def test_missing_pages_are_html_and_the_api_stays_json(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    with logged_in(app, read_token) as browser:
        for path in ("/runs/999999", "/no/such/page", "/traces/424242"):
            resp = browser.get(path)
            assert resp.status_code == 404 and "<html" in resp.text and 'id="error"' in resp.text
    api = client.get("/api/v1/runs/999999")
    assert api.status_code == 404 and api.json()["error"]["code"] == "not_found"


def test_static_assets_are_versioned_gzip_and_immutable(app: FastAPI, read_token: str) -> None:
    import plotly

    with logged_in(app, read_token) as browser:
        page = browser.get("/").text
        url = f"/static/v/{plotly.__version__}/plotly.min.js"
        assert url in page
        packed = browser.get(url, headers={"Accept-Encoding": "gzip"})
        assert packed.headers["content-encoding"] == "gzip"
        assert "immutable" in packed.headers["cache-control"]
        assert int(packed.headers["content-length"]) < 2_000_000  # 4.8 MB uncompressed
        assert b"plotly" in packed.content[:2000]  # the client inflated it
        css = page.split('rel="stylesheet" href="', 1)[1].split('"', 1)[0]
        assert css.startswith("/static/v/") and browser.get(css).status_code == 200


def test_pending_pages_refresh_and_deep_analyses_need_hta(
    client: TestClient, app: FastAPI, read_token: str, admin_token: str, monkeypatch: Any
) -> None:
    made = upload(client, TWO_STEPS.read_bytes(), project="p", run="waiting").json()  # left pending
    with logged_in(app, read_token) as browser:
        assert 'http-equiv="refresh"' in browser.get(f"/runs/{made['run_id']}").text
        assert 'http-equiv="refresh"' in browser.get(f"/traces/{made['id']}").text
    drain(app)
    from stepdoctor_analysis.analyzers import deep

    monkeypatch.setattr(deep, "available", lambda: False)
    with logged_in(app, admin_token) as browser:
        page = browser.get(f"/traces/{made['id']}").text
        assert 'http-equiv="refresh"' not in page
        assert "critical-path" not in page  # not offered where the server cannot run it
        refused = browser.post(f"/traces/{made['id']}/deep/critical-path", content="")
        assert refused.status_code in (403, 501) and "<html" in refused.text


def test_compare_warns_when_the_setups_differ(client: TestClient, app: FastAPI, read_token: str) -> None:
    a100 = {"devices": [{"name": "NVIDIA A100"}], "loader": {"batch_size": 32}, "world_size": 8}
    h100 = {"devices": [{"name": "NVIDIA H100"}], "loader": {"batch_size": 64}, "world_size": 8}
    base = upload(client, TWO_STEPS.read_bytes(), project="p", run="a100", metadata=a100).json()
    other = upload(client, FAST.read_bytes(), project="p", run="h100", metadata=h100).json()
    drain(app)
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/compare?base={base['run_id']}&other={other['run_id']}").text
    assert "differ in devices: NVIDIA A100 vs NVIDIA H100" in page
    assert "differ in batch size: 32 vs 64" in page
    assert "world size" not in page  # equal: no warning


def test_a_report_that_does_not_decode_is_shown_as_stale(
    client: TestClient, app: FastAPI, read_token: str
) -> None:
    """Pages read reports typed (``ReportDoc``): one stored in an older shape is outdated, so the
    trace page says it is stale (and writes nothing), the run page still renders, and once the
    admin's re-analysis has redone it the verdict is back."""
    from sqlalchemy import select

    from stepdoctor_server.core.models import Analysis, Trace

    made = upload(client, TWO_STEPS.read_bytes(), project="p", run="r").json()
    drain(app)
    with app.state.db.session() as session:
        analysis = session.scalars(select(Analysis).where(Analysis.trace_id == made["id"])).one()
        old = dict(analysis.report)
        old["primary"] = {"kind": old["primary"]["kind"]}  # an older engine's verdict, fewer fields
        old["tables"] = {"ops": "not rows"}
        analysis.report = old
    api_before = client.get(f"/api/v1/traces/{made['id']}/report").json()["report"]
    assert api_before["tables"] == {"ops": "not rows"}  # the API returns the stored JSON as it is
    with logged_in(app, read_token) as browser:
        trace_page = browser.get(f"/traces/{made['id']}")
        run_page = browser.get(f"/runs/{made['run_id']}")
        assert trace_page.status_code == 200 and run_page.status_code == 200
        assert "Stale:" in trace_page.text and "Bound by" not in trace_page.text
        assert 'id="kernels"' not in run_page.text  # its tables did not decode: not shown
        with app.state.db.session() as session:
            assert session.get(Trace, made["id"]).status == "done"  # type: ignore[union-attr]
        # Written by this engine's version yet unreadable: redone on the explicit write path.
        assert client.post(f"/api/v1/traces/{made['id']}/reanalyze").status_code == 202
        drain(app)
        again = browser.get(f"/traces/{made['id']}").text
    assert "Stale:" not in again and "Bound by" in again


def test_compare_uses_the_unprofiled_steady_state_when_both_runs_have_a_series(
    client: TestClient, app: FastAPI, read_token: str, team: Any
) -> None:
    """Profiled steps are the same (100 ms); the steady steps went from 60 to 40 ms: the page, its
    JSON twin and predicted-vs-measured all say 1.50x on the unprofiled basis, and say so."""
    from support.regressions import recorded_run
    from support.reports import recommendation

    rec = [recommendation("input.workers", title="More workers", change="x", removable_us_per_step=50_000.0)]
    base = recorded_run(app, team.id, "p", "base", step_ms=100.0, series_ms=60.0, recommendations=rec)
    other = recorded_run(app, team.id, "p", "other", step_ms=100.0, series_ms=40.0)
    api = client.get(f"/api/v1/compare?base={base}&other={other}").json()["comparison"]
    assert api["step"] == {
        "basis": "unprofiled",
        "base_ms": 60.0,
        "other_ms": 40.0,
        "change": pytest.approx(-1 / 3),
        "speedup": 1.5,
    }
    assert api["speedup"] == 1.5 and api["step_time_us"]["base"] == api["step_time_us"]["other"] == 100_000.0
    assert (api["followed"]["measured_speedup"], api["followed"]["measured_basis"]) == (1.5, "unprofiled")
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/compare?base={base}&other={other}").text
    assert 'class="factor">1.50× faster</strong>' in page
    assert "Basis: unprofiled steady-state median step time" in page
    assert "measured <strong>1.50× faster</strong> (unprofiled steady state)" in page
    # Without a series on one side, both fall back to the profiled steps and say so.
    plain = recorded_run(app, team.id, "p", "plain", step_ms=80.0)
    api = client.get(f"/api/v1/compare?base={base}&other={plain}").json()["comparison"]
    assert api["step"]["basis"] == "profiled" and api["speedup"] == 1.25
    with logged_in(app, read_token) as browser:
        page = browser.get(f"/compare?base={base}&other={plain}").text
    assert "Basis: profiled step time (capture windows" in page and 'class="factor">1.25× faster' in page
