"""Shared pieces of the dashboard tests: Debian's Chromium under Playwright, and the page's plot specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"


def launch_chromium(pw: Any) -> Any:
    """Debian's Chromium, headless, with its own background traffic off so every request is the page's."""
    return pw.chromium.launch(
        executable_path=CHROMIUM,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
        ],
    )


def page_plots(html: str) -> dict[str, Any]:
    """The Plotly figure specs a dashboard page embeds, by plot id."""
    out = {}
    marker = 'type="application/json" data-plot="'
    for chunk in html.split(marker)[1:]:
        name, rest = chunk.split('">', 1)
        out[name] = json.loads(rest.split("</script>", 1)[0])
    return out


def analyse_queued(data_dir: Path) -> int:
    """Run the queued analyses of a ``serve_subprocess`` server in this process, as one of its
    workers would (same data directory and database); returns how many ran."""
    from stepdoctor_server.core.settings import Settings
    from stepdoctor_server.web.app import create_app
    from support.server import drain

    app = create_app(Settings(data_dir=data_dir, workers=0))
    try:
        return drain(app)
    finally:
        app.state.db.dispose()
