"""mkdocs hooks: fill the reference pages' generated parts at build time and publish benchmarks/README.md.

A page asks for a generated part with a marker line, ``<!-- generate: NAME -->``, replaced here by the Markdown
``tools.docs_reference`` builds from the code (names: ``cli``, ``openapi``, ``errors``, ``environment``).
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

from tools import docs_reference  # noqa: E402

_CACHE: dict[str, str] = {}


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
