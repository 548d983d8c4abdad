"""The verdict guide (docs/verdicts.md): a complete section per kind, every rule named where its
kind is explained, the packaged copy the same text, and the CLI report and dashboard linking to it."""

from __future__ import annotations

import gzip
import importlib.util
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from stepdoctor_analysis import BOTTLENECK_KINDS
from stepdoctor_analysis.cli.analyze import main as analyze_main
from stepdoctor_analysis.report import guide
from stepdoctor_analysis.rules import documented_rules
from support.reports import recommendation
from support.server import drain, logged_in, upload
from support.synthetic import sync_bound_trace

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "verdicts.md").read_text(encoding="utf-8")
PARTS = (
    "**What it means.**",
    "**How stepdoctor measures it.**",
    "**Changes, in the order to try them",
    "**How to verify.**",
    "**False leads.**",
)


def _gen_docs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", guide.SECTIONS)
def test_each_kind_has_a_complete_section(name: str) -> None:
    section = guide.sections(DOC).get(name)
    assert section is not None, f"docs/verdicts.md has no '## {name}' section"
    at = [section.find(part) for part in PARTS]
    assert all(i >= 0 for i in at), f"{name}: missing {[p for p, i in zip(PARTS, at, strict=True) if i < 0]}"
    assert at == sorted(at), f"{name}: the parts are out of order"
    changes = section[at[2] : at[3]]
    steps = re.findall(r"^\d+\. ", changes, re.MULTILINE)
    snippets = changes.count("```") // 2
    assert steps and snippets >= len(steps), f"{name}: {len(steps)} changes but {snippets} code snippets"


def test_every_rule_is_named_in_its_kinds_section() -> None:
    sections = guide.sections(DOC)
    assert set(BOTTLENECK_KINDS) <= set(sections)
    missing = [
        r.id for r in documented_rules() if f"`{r.id}`" not in sections[guide.section_name(r.kind, r.id)]
    ]
    assert missing == [], f"rules not explained in their kind's section of docs/verdicts.md: {missing}"


def test_packaged_guide_is_the_docs_guide() -> None:
    packaged = _gen_docs().PACKAGED_GUIDE
    assert _gen_docs().generated()[packaged] == DOC
    assert packaged.read_text(encoding="utf-8") == DOC, "run `make docs`"
    assert guide.text() == DOC
    assert guide.section("transfer") == guide.sections(DOC)["transfer"]
    with pytest.raises(KeyError, match="known: input"):
        guide.section("How to verify any fix")


def test_a_trigger_stating_a_share_states_the_rules_threshold() -> None:
    """The docs table's threshold column and its "fires when" text must be the same number."""
    wrong = [
        (r.id, r.threshold, r.trigger)
        for r in documented_rules()
        if "%" in r.trigger and 0 < r.threshold < 1 and f"{100 * r.threshold:g}%" not in r.trigger
    ]
    assert wrong == []


def test_rules_table_lists_the_straggler_card() -> None:
    text = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    assert "| communication.straggler | communication |" in text


def test_text_report_links_the_verdict_and_card_to_their_sections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = sync_bound_trace(tmp_path / "t.json")
    assert analyze_main([str(trace)]) == 0
    out = capsys.readouterr().out
    primary = re.search(r"Primary bottleneck: (\w+)", out)
    assert primary is not None
    assert f"What to do: docs/verdicts.md#{primary.group(1).lower()}" in out
    card = re.search(r"Next optimization: .*\n(?:  .*\n)*?  Guide:  (\S+)", out)
    assert card is not None and card.group(1).startswith("docs/verdicts.md#")
    assert card.group(1).split("#")[1] in guide.SECTIONS


@pytest.mark.only_db("sqlite")
def test_dashboard_cards_link_to_the_guide_page(client: TestClient) -> None:
    from stepdoctor_server.web.pages import templates

    page = client.get("/guide")
    assert page.status_code == 200
    for name in guide.SECTIONS:
        assert f'<h2 id="{name}">' in page.text
    card = templates.env.from_string(
        '{% from "_macros.html" import recommendation %}{{ recommendation(rec) }}'
    )
    straggler = card.render(rec=recommendation("communication.straggler", kind="communication"))
    assert '<a class="guide" href="/guide#stragglers">' in straggler
    odd = card.render(rec=recommendation("x", kind='"><script>'))
    assert "<script>" not in odd and 'href="/guide#&#34;&gt;&lt;script&gt;"' in odd


@pytest.mark.only_db("sqlite")
def test_run_and_trace_pages_link_their_verdict_to_its_section(
    app: FastAPI, client: TestClient, admin_token: str, tmp_path: Path
) -> None:
    body = gzip.compress(sync_bound_trace(tmp_path / "t.json").read_bytes())
    created = upload(client, body, token=admin_token)
    assert created.status_code == 201, created.text
    drain(app)
    pages = logged_in(app, admin_token)
    for path in (f"/runs/{created.json()['run_id']}", f"/traces/{created.json()['id']}"):
        page = pages.get(path)
        assert page.status_code == 200
        assert '<a class="guide" href="/guide#sync">What to do</a>' in page.text, path
        assert '<a class="guide" href="/guide#sync">guide</a>' in page.text, path  # the first card
