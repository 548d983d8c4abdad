"""Data in pages is data: the one escaper for values written into ``<script>`` elements.

Pure (no server import), so the dashboard's templates (the ``script_json`` filter) and the server's
API docs page use the same function.
"""

from __future__ import annotations

import json
from typing import Any

from markupsafe import Markup

# What may end a <script> element or a JavaScript string in the HTML parser's and the JS parser's
# eyes: "</script", "<!--", "]]>", entities (in XHTML), quote-closing in attributes, and the two
# line terminators JavaScript before ES2019 refused inside strings. JSON.parse reads the escapes back.
_SCRIPT_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "'": "\\u0027", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def script_json(value: Any) -> Markup:
    """``value`` as JSON that is safe inside any ``<script>`` element (data block or inline code).

    The one way pages embed data in script elements (the dashboard's ``script_json`` filter, the API
    docs' configuration): ``json.dumps`` alone leaves ``</script>`` intact in a string, which ends
    the element and lets the rest of the string run as markup. NaN and non-JSON types are refused,
    not written as JavaScript that ``JSON.parse`` would reject.
    """
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_not_json)
    return Markup(text.translate(_SCRIPT_ESCAPES))


def _not_json(value: Any) -> Any:
    raise TypeError(f"a page's JSON holds a {type(value).__name__}")
