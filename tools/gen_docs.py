"""Write the generated docs: docs/rules.md from the rules, docs/report.schema.json from the report
types, and the packaged copy of the verdict guide (docs/verdicts.md, which people edit).

Run by ``make docs``; tests/test_contract_rules.py and tests/test_docs_verdicts.py fail when a
committed file differs from what this writes, so a rule or report change and its docs land in the
same commit, and the wheel's guide (``stepdoctor_analysis.report.guide``) is the one in docs/.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "verdicts.md"
PACKAGED_GUIDE = ROOT / "backend" / "stepdoctor_analysis" / "verdicts.md"


def generated() -> dict[Path, str]:
    """Path -> the text it must hold."""
    from stepdoctor_analysis.report.contract import schema_text
    from stepdoctor_analysis.rules.doc import rules_markdown

    return {
        ROOT / "docs" / "rules.md": rules_markdown(),
        ROOT / "docs" / "report.schema.json": schema_text(),
        PACKAGED_GUIDE: GUIDE.read_text(encoding="utf-8"),
    }


def main() -> int:
    for path, text in generated().items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
