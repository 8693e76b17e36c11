"""mkdocs hooks: fill the reference pages' generated parts at build time and publish benchmarks/README.md.

A page asks for a generated part with a marker line, ``<!-- generate: NAME -->``, replaced here by the Markdown
``tools.docs_reference`` builds from the code (names: ``cli``, ``openapi``, ``errors``, ``environment``).

The site loads nothing from elsewhere: a page that draws a Mermaid diagram gets the copy of Mermaid vendored under
``docs/assets/javascripts/`` (see ``MERMAID``), which mkdocs-material then uses instead of fetching it from a CDN.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs loads this file by path; the generators import `tools.*`
    sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File  # noqa: E402
from mkdocs.utils import get_relative_url  # noqa: E402

from tools import docs_reference  # noqa: E402

_CACHE: dict[str, str] = {}

#: Mermaid 11.17.2 (MIT, ``mermaid.LICENSE.txt`` beside it), the ``dist/mermaid.min.js`` of the npm package.
#: mkdocs-material draws diagrams with a global ``mermaid`` when one is defined and otherwise loads
#: ``https://unpkg.com/mermaid@11`` at view time, so the copy is put on each page that has a diagram (only those:
#: it is 3.5 MB), before the theme's bundle.
MERMAID = "assets/javascripts/mermaid.min.js"


def _examples_section() -> None:
    """Read a docstring's ``Example:`` as the Google "Examples" section (code), as ruff's D rules accept it.

    The project writes ``Example:`` (one example, the team's style); griffe takes only the plural as the examples
    section and renders the singular as a prose admonition, where ``>>>`` lines lose their code formatting.
    Griffe keeps the section names in a private table: without it the pages still build, only plainer.
    """
    try:
        from griffe._internal.docstrings import google
        from griffe._internal.enumerations import DocstringSectionKind
    except ImportError:  # another griffe: the admonition rendering stays
        return
    google._section_kind.setdefault("example", DocstringSectionKind.examples)


_examples_section()


def _environment() -> str:
    rows = ["| variable | read by |", "|---|---|"]
    for name, where in docs_reference.environment_variables().items():
        rows.append(f"| `{name}` | {', '.join(f'`{w}`' for w in where)} |")
    return "\n".join(rows) + "\n"


_GENERATORS = {
    "cli": docs_reference.cli_markdown,
    "openapi": docs_reference.openapi_markdown,
    "errors": docs_reference.errors_markdown,
    "environment": _environment,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- generate: NAME -->`` line with its generated Markdown."""
    lines = []
    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("<!-- generate:") and stripped.endswith("-->"):
            name = stripped[len("<!-- generate:"):-3].strip()
            if name not in _GENERATORS:
                raise ValueError(f"{page.file.src_path}: unknown generated part {name!r}; one of {sorted(_GENERATORS)}")
            if name not in _CACHE:
                _CACHE[name] = _GENERATORS[name]()
            lines.append(_CACHE[name])
        else:
            lines.append(line)
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    """Publish ``benchmarks/README.md`` as the page ``benchmarks.md``, so the performance page links into it."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    # Its links into benchmarks/results/ point at files of the repository, not pages of the site.
    text = re.sub(r"\[([^\]]+)\]\((results/[^)]*)\)", r"`benchmarks/\2` in the repository", text)
    files.append(File.generated(config, "benchmarks.md", content=text))
    return files


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Give a page that draws a Mermaid diagram the vendored Mermaid, before the theme's script needs it."""
    if 'class="mermaid"' not in output:
        return output
    tag = f'<script src="{get_relative_url(MERMAID, page.url)}"></script>'
    at = output.find('<script src="')
    if at == -1:
        raise ValueError(f"{page.file.src_path}: no script tag to put Mermaid before")
    return output[:at] + tag + "\n    " + output[at:]
