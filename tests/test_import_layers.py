"""Import layers, read from the source with ``ast`` (every import, at module level or inside a function).

Packages: the agent imports nothing of the backend; the engine nothing of the server, the dashboard
or the agent; the dashboard (templates, figures, formatting) only the engine; the server the engine,
the dashboard (its ``web`` layer renders the templates) and the agent's logging setup.

Inside the server, each sub-package imports only those below it (``LAYERS``): ``core`` at the
bottom, then ``jobs`` (which runs what the domains register with it), ``auth``, the domains
(``traces``, ``runs``, ``deep``), then ``web`` and the entry points (``job_handlers``, ``cli``). Arrows that still run the wrong way, and import circles between modules, are
listed in ``KNOWN_*``: the test fails when a new one appears, and when one is fixed without taking
it off the list, so the lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "stepdoctor": REPO / "agent",
    "stepdoctor_analysis": REPO / "backend",
    "stepdoctor_server": REPO / "backend",
    "stepdoctor_dashboard": REPO / "frontend",
}
# Which top-level packages each may import (besides itself): the arrows of the README's layout.
ALLOWED = {
    "stepdoctor": set(),
    "stepdoctor_analysis": set(),
    "stepdoctor_server": {"stepdoctor_analysis", "stepdoctor_dashboard", "stepdoctor"},
    "stepdoctor_dashboard": {"stepdoctor_analysis"},
}
# The server's sub-packages, bottom first; a module may import its own sub-package and those below.
# ``jobs`` runs what the domains register with it (``jobs.defer``), so it sits below them.
LAYERS = ["core", "jobs", "auth", "traces", "runs", "deep", "web"]
KNOWN_UPWARD_LAYERS: set[tuple[str, str]] = set()
# The engine, bottom first: the package's own constants ("") and errors, the trace ``model``,
# ``parsing`` (which builds it), the ``analyzers`` (one trace's facts), the ``report`` (their typed
# JSON and text), the ``rules`` (which judge them), a ``run`` of several traces, the ``pipeline``
# (path in, report out) and the ``cli``. A module imports its own layer and those below.
ENGINE_LAYERS = ["", "errors", "model", "parsing", "analyzers", "report", "rules", "run", "pipeline", "cli"]
ENGINE_BESIDE = {"rank_pool": "pipeline"}  # top-level modules in another module's layer
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, module: str) -> set[str]:
    """Every module name (and ``module.name``) the file imports, relative imports resolved."""
    out: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: len(package) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {d for d in out if d.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    raw = {}
    for package, root in PACKAGES.items():
        for path in (root / package).rglob("*.py"):
            module = _module_name(path, root)
            raw[module] = _imports(path, module)
    modules = set(raw)

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {m: {o for d in deps if (o := owner(d)) and o != m} for m, deps in raw.items()}


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "stepdoctor_server" and len(parts) > 2 and parts[1] in LAYERS else None


def test_no_package_imports_upward() -> None:
    upward = {
        (m, d)
        for m, deps in _graph().items()
        for d in deps
        if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in ALLOWED[m.split(".")[0]]
    }
    assert upward == set()


def test_server_layers_import_only_downward() -> None:
    upward = set()
    for module, deps in _graph().items():
        here = _layer(module)
        for dep in deps:
            there = _layer(dep)
            if here and there and LAYERS.index(there) > LAYERS.index(here):
                upward.add((here, there))
    assert upward == KNOWN_UPWARD_LAYERS


def _engine_layer(module: str) -> str:
    parts = module.split(".")
    return "" if len(parts) == 1 else ENGINE_BESIDE.get(parts[1], parts[1])


def _engine_arrows(graph: dict[str, set[str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """(engine modules in no layer, imports that run up the engine's layers)."""
    engine = {m: deps for m, deps in graph.items() if m.split(".")[0] == "stepdoctor_analysis"}
    unplaced = sorted(m for m in engine if _engine_layer(m) not in ENGINE_LAYERS)
    rank = {m: ENGINE_LAYERS.index(_engine_layer(m)) for m in engine if m not in unplaced}
    upward = sorted(
        (m, d) for m, deps in engine.items() for d in deps if d in rank and m in rank and rank[d] > rank[m]
    )
    return unplaced, upward


def test_engine_layers_import_only_downward() -> None:
    assert _engine_arrows(_graph()) == ([], [])


def test_an_upward_engine_import_is_caught() -> None:
    """The check sees an arrow that runs up: the trace model importing the rules."""
    graph = _graph()
    graph["stepdoctor_analysis.model.trace"] = graph["stepdoctor_analysis.model.trace"] | {
        "stepdoctor_analysis.rules"
    }
    assert ("stepdoctor_analysis.model.trace", "stepdoctor_analysis.rules") in _engine_arrows(graph)[1]


def test_the_engine_imports_no_server_dashboard_or_agent() -> None:
    graph = _graph()
    engine = {m: deps for m, deps in graph.items() if m.startswith("stepdoctor_analysis")}
    assert engine and all(d.startswith("stepdoctor_analysis") for deps in engine.values() for d in deps)


def test_no_new_import_circles() -> None:
    assert _circles(_graph()) == KNOWN_CIRCLES
