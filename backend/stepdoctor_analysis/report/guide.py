"""The verdict guide (docs/verdicts.md) by section, for the CLI report, the dashboard and the MCP server.

The guide ships inside this package (``verdicts.md`` in the package's top folder, copied from docs/ by
``make docs``; a test keeps the two equal), so a wheel install answers "what do I do about a
transfer verdict" without the repository. Sections are the level-2 headings: one per bottleneck
kind, plus ``stragglers`` for the job-level straggler card.
"""

from __future__ import annotations

import re
from functools import cache

from .. import BOTTLENECK_KINDS, STRAGGLER_ID

DOC_PATH = "docs/verdicts.md"  # where the guide lives in the repository (and on its web host)
STRAGGLERS = "stragglers"
SECTIONS = (*BOTTLENECK_KINDS, STRAGGLERS)
_HEADING = re.compile(r"^## +(\S.*?)\s*$", re.MULTILINE)


@cache
def text() -> str:
    """The whole guide, from the packaged copy (``importlib.resources`` pulls in tempfile, shutil and
    the compressors: imported here, so a report that only links the guide does not pay for them)."""
    from importlib import resources

    return resources.files("stepdoctor_analysis").joinpath("verdicts.md").read_text(encoding="utf-8")


def sections(doc: str | None = None) -> dict[str, str]:
    """Level-2 heading -> that section's markdown (heading included, up to the next heading)."""
    doc = text() if doc is None else doc
    heads = list(_HEADING.finditer(doc))
    return {
        m.group(1): doc[m.start() : heads[i + 1].start() if i + 1 < len(heads) else len(doc)].rstrip() + "\n"
        for i, m in enumerate(heads)
    }


def section_name(kind: str, rule_id: str | None = None) -> str:
    """The section a verdict of ``kind`` (or the card ``rule_id``) is explained in."""
    return STRAGGLERS if rule_id == STRAGGLER_ID else kind


def section(name: str) -> str:
    """The guide's section ``name`` (a kind or ``stragglers``); ``KeyError`` naming the known ones."""
    found = sections().get(name)
    if found is None or name not in SECTIONS:
        raise KeyError(f"no guide section {name!r}; known: {', '.join(SECTIONS)}")
    return found


def link(kind: str, rule_id: str | None = None) -> str:
    """Where a verdict or card is explained: the repository path with the section's anchor."""
    return f"{DOC_PATH}#{section_name(kind, rule_id)}"
