"""The run verdict and run page at many ranks: the sentence naming stragglers names a few and counts
the rest ("and N more"), the same words on the CLI and the page; a 1,000-rank run page draws its
ranks as one heatmap with the straggler marked on the metric it was judged by, the distribution as
text, hosts grouped, and capped tables (the worst ranks, the worst nodes, a paginated view of all)."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis.run.ranks import NAMED_RANKS, TraceEntry, named_ranks
from stepdoctor_analysis.run.verdict import run_verdict
from stepdoctor_dashboard.rank_figures import TOP_NODES, TOP_RANKS, RankPlace, heatmap_figure
from support.dashboard import page_plots
from support.many_ranks import many_rank_run, rank_report
from support.reports import typed
from support.server import logged_in

SLOW = [3, 5, 8, 13, 21, 22, 30, 31, 33, 34, 35, 38]  # 12 stragglers of 40 ranks


def _job(ranks: int, slow: dict[int, float]) -> list[TraceEntry]:
    return [TraceEntry(typed(**rank_report(r, slow=slow.get(r, 0.0))), rank=r) for r in range(ranks)]


def test_named_ranks_names_a_few_then_counts_the_rest() -> None:
    assert named_ranks([]) == ""
    assert named_ranks(["rank 1"]) == "rank 1"
    assert named_ranks(["rank 1", "rank 2"]) == "rank 1 and rank 2"
    assert named_ranks(["a", "b", "c"]) == "a, b and c"
    assert named_ranks([f"rank {i}" for i in range(1000)]) == "rank 0, rank 1, rank 2 and 997 more"


def test_the_verdict_names_the_worst_few_stragglers_and_counts_the_rest() -> None:
    # Rank 30 is the worst, then 8: they are named first, whatever their rank order.
    slow = {r: 0.25 for r in SLOW} | {30: 0.6, 8: 0.45}
    verdict = run_verdict(_job(40, slow))
    assert sorted(s.rank for s in verdict.stragglers if s.rank is not None) == SLOW
    named = [w for w in verdict.warnings if w.startswith("straggler: ")]
    assert len(named) == NAMED_RANKS
    assert named[0].startswith("straggler: rank 30 ") and named[1].startswith("straggler: rank 8 ")
    (rest,) = [w for w in verdict.warnings if "stragglers by" in w]
    assert rest.startswith(f"{len(SLOW)} stragglers by busy time before collectives: rank 30, rank 8, ")
    assert rest.endswith(f"and {len(SLOW) - NAMED_RANKS} more (every rank in ranks.per_rank)")
    # No sentence lists every straggler.
    assert not any(all(f"rank {r}" in w for r in SLOW) for w in verdict.warnings)


def test_a_few_stragglers_keep_a_sentence_each() -> None:
    verdict = run_verdict(_job(8, {2: 0.3, 5: 0.3}))
    named = [w for w in verdict.warnings if "straggler" in w]
    assert [w.split(" works")[0] for w in named] == ["straggler: rank 2", "straggler: rank 5"]


@pytest.fixture
def thousand(app: FastAPI, client: TestClient) -> tuple[int, dict[int, int], int]:
    made = many_rank_run(app, client, 1000)
    return made.run_id, made.trace_ids, made.straggler


def _rows(html: str, table: str) -> int:
    body = html.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    return body.count("<tr") - 1  # less the header


def test_a_thousand_rank_run_page_draws_one_heatmap_and_capped_tables(
    app: FastAPI, client: TestClient, read_token: str, thousand: tuple[int, dict[int, int], int]
) -> None:
    run_id, trace_ids, slow = thousand
    diagnosis = client.get(f"/api/v1/runs/{run_id}/diagnosis").json()["diagnosis"]
    assert [s["rank"] for s in diagnosis["stragglers"]] == [slow] == [613]
    with logged_in(app, read_token) as browser:
        html = browser.get(f"/runs/{run_id}").text
        page_2 = browser.get(f"/runs/{run_id}?ranks_page=2").text
    heat, marks = page_plots(html)["plot-ranks"]["data"]
    assert heat["type"] == "heatmap" and len(heat["z"]) == 3 and len(heat["z"][0]) == 1000
    # The straggler's marker sits on the judged row, at its column, and carries its trace id.
    judged = next(y for y in heat["y"] if y.endswith("*"))
    assert judged == "busy *"
    assert marks["y"] == [judged] and marks["customdata"][0][:2] == [trace_ids[613], "613"]
    column = marks["x"][0]
    assert heat["customdata"][0][column][:2] == [trace_ids[613], "613"]
    assert heat["z"][1][column] == pytest.approx(1.3, abs=0.06)
    # The distribution as text, the stragglers named with their factor.
    spread = html.split('id="rank-spread"', 1)[1].split("</div>", 1)[0]
    assert "1000 ranks" in spread and re.search(r"rank 613 \(1\.[23]\d×\)", spread)
    assert re.search(r"busy before collectives: median [^,]+, p90 [^,]+, max [^=]+= <strong>1\.\d\d×", spread)
    # Capped tables: the worst ranks (the straggler first), the worst nodes, then "and N more".
    assert _rows(html, "rank-table") == TOP_RANKS
    first = html.split('id="rank-table"', 1)[1].split("</tr>", 2)[1]
    assert ">613 <span" in first and f'href="/traces/{trace_ids[613]}"' in first
    assert _rows(html, "rank-nodes") == TOP_NODES
    assert "node-076" in html.split('id="rank-nodes"', 1)[1].split("</tr>", 2)[1]  # 613 // 8
    assert f"and {125 - TOP_NODES} more nodes" in html
    # Each report's field costs a parse of the whole report on PostgreSQL: a bounded few are read.
    assert _rows(html, "traces") == 10 and "Showing the first 10 of 1000 traces" in html
    assert "analysis warnings of 8 of the run&#39;s 1000 traces are shown" in html
    assert html.count("<tr") < 120
    # Page 2 of all ranks, by rank id.
    assert _rows(page_2, "rank-table") == 100
    assert ">100</td>" in page_2.split('id="rank-table"', 1)[1].split("</tr>", 2)[1]


def test_a_small_run_keeps_one_bar_per_rank(app: FastAPI, client: TestClient, read_token: str) -> None:
    made = many_rank_run(app, client, 8, per_host=4)
    with logged_in(app, read_token) as browser:
        html = browser.get(f"/runs/{made.run_id}").text
    (bar,) = page_plots(html)["plot-ranks"]["data"]
    assert bar["type"] == "bar" and len(bar["x"]) == 8
    assert [row[2] for row in bar["customdata"]] == [made.trace_ids[r] for r in range(8)]
    assert 'id="rank-table"' not in html and 'id="rank-nodes"' in html and "more nodes" not in html
    assert "8 ranks" in html and re.search(r"rank 4 \(1\.[23]\d×\)", html)  # int(0.613 * 8)


def test_the_heatmap_carries_host_names_as_text_not_markup() -> None:
    hostile = '<a href="javascript:alert(1)">node</a>'
    verdict = run_verdict(_job(40, {7: 0.3}))
    places: dict[int | str, RankPlace] = {
        r: RankPlace(1000 + r, hostile if r < 20 else "node-b") for r in range(40)
    }
    fig = heatmap_figure(verdict, places, "busy_us")
    heat = fig["data"][0]
    cell = heat["customdata"][0][0]
    assert cell[:3] == [1000, "0", '&lt;a href="javascript:alert(1)"&gt;node&lt;/a&gt;']
    assert "&lt;a href" in fig["layout"]["xaxis"]["ticktext"][0]  # the node's name on the axis


def test_the_cli_text_names_a_few_stragglers_too() -> None:
    from stepdoctor_analysis.cli.analyze import _render_runs
    from stepdoctor_analysis.pipeline import analyze_path
    from support.fixtures import HTA_TRACES

    report = analyze_path(HTA_TRACES / "trace_filter" / "sampled_rank-0.json.gz")
    report.ranks = {"count": 40, "windows": 40, "basis": "step time", "spread": 0.3, "median_busy_us": 1e5}
    report.ranks["stragglers"] = SLOW
    assert "stragglers: 3, 5, 8 and 9 more\n" in report.render_text()
    row = {
        "run": "job", "traces": 40, "ranks": 40, "step_time_us": 1e5, "stragglers": SLOW,
        "primary": {"kind": "compute", "share": 0.6}, "next": None,
    }  # fmt: skip
    assert _render_runs("logs", [row]).rstrip().endswith("none; straggler rank(s) 3, 5, 8 and 9 more")
