"""MkDocs hook: docs/getting-started.md is the README's section between its
`<!-- getting-started: start -->` and `<!-- getting-started: end -->` marks, taken at each
build, so the site's quick start, cluster recipe and training loop are the README's own.
The README's links point into docs/ from the repository's root (`docs/api.md`); on the
site the page lives in docs/ itself, so they lose their `docs/`."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
PAGE = "getting-started.md"
MARKER = "<!-- the README's getting-started section -->"
SECTION = re.compile(
    r"<!-- getting-started: start -->\n(.*?)<!-- getting-started: end -->", re.DOTALL
)


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    found = SECTION.search(README.read_text(encoding="utf-8"))
    if found is None or MARKER not in markdown:
        raise ValueError(f"{PAGE}: the README's getting-started marks or {MARKER} are gone")
    return markdown.replace(MARKER, re.sub(r"\]\(docs/", "](", found.group(1)))
