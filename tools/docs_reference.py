"""The reference pages' generated parts: the CLI, the REST API, the error codes and the environment variables.

Each function returns Markdown built from the code itself (the Typer app, the desk's OpenAPI document,
``undolog_core.errors`` and the sources' ``UNDOLOG_*`` reads), so the reference cannot drift from what ships.
``tools/docs_hooks.py`` calls them while ``mkdocs build`` renders the pages; ``tests/docs`` calls them too.

Example:
    >>> from tools.docs_reference import errors_markdown
    >>> "`session_halted`" in errors_markdown()
    True
"""

from __future__ import annotations

import inspect
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("undolog_core", "undolog_server", "undolog_mcp", "undolog_adapters")


def _cell(text: str) -> str:
    """One Markdown table cell: no newline, no bare pipe."""
    return " ".join(str(text).split()).replace("|", "\\|")


# --- the CLI -----------------------------------------------------------------------------------------------


def _commands(group: Any, prefix: list[str]) -> Iterator[tuple[list[str], Any]]:
    for name in sorted(group.commands):
        cmd = group.commands[name]
        if getattr(cmd, "hidden", False):
            continue
        # A group of commands by what it has, not by class: Typer builds its groups on its own copy of click's.
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, [*prefix, name])
        else:
            yield [*prefix, name], cmd


def cli_markdown() -> str:
    """Every ``undolog`` command with its help and options, read from the Typer app.

    Returns:
        Markdown: one section per command (its usage, help text and a table of its parameters).

    Example:
        >>> "undolog approvals approve" in cli_markdown()
        True
    """
    import typer

    from undolog_core.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="undolog")
    out: list[str] = []
    out.append("## Global options\n")
    out.append(_params_table(root.params))
    for path, cmd in _commands(root, []):  # type: ignore[arg-type]
        full = " ".join(["undolog", *path])
        sub = cmd.context_class(cmd, info_name=full, parent=ctx)
        usage = " ".join(cmd.collect_usage_pieces(sub))
        out.append(f"## `{full}`\n")
        out.append(f"```text\n{full} {usage}\n```\n")
        help_text = inspect.cleandoc((cmd.help or "").split("\f")[0]).replace("\b\n", "")
        if help_text:
            out.append(help_text + "\n")
        table = _params_table(cmd.params)
        if table:
            out.append(table)
    return "\n".join(out)


def _params_table(params: list[Any]) -> str:
    rows = []
    for p in params:
        if getattr(p, "hidden", False) or p.name == "help":
            continue
        if p.param_type_name == "argument":
            name = f"`{p.name.upper()}`"
            kind = "argument"
        else:
            name = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            kind = "option"
        env = p.envvar if isinstance(p.envvar, str) else ", ".join(p.envvar or [])
        value = getattr(p.default, "value", p.default)  # an enum's default shows as the value typed on the line
        default = "" if value in (None, (), False) or callable(value) else f"`{value}`"
        help_text = getattr(p, "help", None) or ""
        rows.append(f"| {name} | {kind} | {_cell(help_text)} | {f'`{env}`' if env else ''} | {default} |")
    if not rows:
        return ""
    return "| parameter | kind | meaning | environment | default |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"


# --- the REST API ------------------------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The desk's OpenAPI document, built from a desk on a throwaway SQLite file (nothing is served).

    Example:
        >>> openapi_document()["openapi"].startswith("3.")
        True
    """
    from undolog_core import UndoLog
    from undolog_server.app import create_app

    with tempfile.TemporaryDirectory() as tmp:
        undolog = UndoLog.open(f"sqlite:///{tmp}/openapi.db")
        try:
            return create_app(undolog).openapi()
        finally:
            undolog.close()


def openapi_markdown(doc: dict[str, Any] | None = None) -> str:
    """Every route of the desk's REST API: method, path, summary, parameters, body and answers.

    Example:
        >>> "`POST /v1/approvals/{approval_request_id}:approve`" in openapi_markdown()
        True
    """
    doc = doc or openapi_document()
    out = ["| operation | what it does | answers |", "|---|---|---|"]
    sections: list[str] = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method not in {"get", "post", "put", "delete", "patch"}:
                continue
            name = f"`{method.upper()} {path}`"
            summary = op.get("summary") or ""
            statuses = ", ".join(sorted(op.get("responses", {})))
            out.append(f"| {name} | {_cell(summary)} | {statuses} |")
            body = []
            body.append(f"### {name}\n")
            if op.get("description"):
                body.append(inspect.cleandoc(op["description"]).split("\n\nArgs:")[0] + "\n")
            params = op.get("parameters", [])
            if params:
                body.append("| parameter | in | required | type |\n|---|---|---|---|")
                for p in params:
                    schema = p.get("schema", {})
                    kind = schema.get("type") or " or ".join(s.get("type", "?") for s in schema.get("anyOf", []))
                    body.append(f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | {kind} |")
                body.append("")
            req = op.get("requestBody", {}).get("content", {})
            for media, spec in req.items():
                ref = spec.get("schema", {}).get("$ref", "")
                body.append(f"Body: `{media}`" + (f", schema `{ref.rsplit('/', 1)[-1]}`" if ref else "") + "\n")
            sections.append("\n".join(body))
    schemas = sorted(doc.get("components", {}).get("schemas", {}))
    tail = "\n## Schemas\n\nThe request and answer bodies named above (`/openapi.json` holds each one in full): " + ", ".join(
        f"`{s}`" for s in schemas
    ) + ".\n"
    return "\n".join(out) + "\n\n## Routes\n\n" + "\n".join(sections) + tail


# --- error codes -------------------------------------------------------------------------------------------


def error_classes() -> list[type]:
    """Every ``UndoLogError`` class that ships (the core's, the CLI's and the undo check's), base first."""
    import undolog_core.cli  # noqa: F401 - defines CliInputError
    import undolog_core.testing  # noqa: F401 - defines ScenarioError
    from undolog_core.errors import UndoLogError

    seen: list[type] = []
    todo: list[type] = [UndoLogError]
    while todo:
        cls = todo.pop(0)
        if cls not in seen:
            seen.append(cls)
            todo.extend(sorted(cls.__subclasses__(), key=lambda c: c.__name__))
    # Private classes (a leading underscore) are internal signals, caught before they reach a caller.
    return [c for c in seen if c.__module__.startswith("undolog_") and not c.__name__.startswith("_")]


def _meaning_and_fix(cls: type) -> tuple[str, str]:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")  # its own, never the base class's
    doc = doc.split("\n\nExample:")[0].split("\n\nAttributes:")[0].split("\n\nArgs:")[0]
    fix = ""
    m = re.search(r"\n\nFix:\s*(.*)", doc, re.S)
    if m:
        fix = m.group(1)
        doc = doc[: m.start()]
    return _cell(doc), _cell(fix)


def errors_markdown() -> str:
    """Every error code: its class, what it means, how to fix it and the HTTP status the desk answers.

    Example:
        >>> "`approval_rejected`" in errors_markdown()
        True
    """
    try:
        from undolog_server.problems import ERROR_STATUS
    except ImportError:  # the server extra is not installed: the table goes without statuses
        ERROR_STATUS = {}
    rows = ["| code | raised as | what it means | how to fix it | HTTP |", "|---|---|---|---|---|"]
    codes = set()
    for cls in error_classes():
        code = cls.code  # type: ignore[attr-defined]
        meaning, fix = _meaning_and_fix(cls)
        status = ERROR_STATUS.get(code, "")
        inherited = "" if "code" in cls.__dict__ else f" (a kind of `{cls.__mro__[1].__name__}`)"
        rows.append(
            f"| <span id=\"{code}\"></span>`{code}` | `{cls.__module__}.{cls.__name__}`{inherited} | {meaning} "
            f"| {fix} | {status} |"
        )
        codes.add(code)
    extra = sorted(set(ERROR_STATUS) - codes)
    text = "\n".join(rows) + "\n"
    if extra:
        text += (
            "\nCodes the desk maps to an HTTP status that are carried by a base class's `code` argument rather than "
            "a class of their own: " + ", ".join(f"`{c}` ({ERROR_STATUS[c]})" for c in extra) + ".\n"
        )
    return text


# --- environment variables ---------------------------------------------------------------------------------

_ENV = re.compile(r"""["'](UNDOLOG_[A-Z0-9_]+)["']""")


def environment_variables() -> dict[str, list[str]]:
    """Every ``UNDOLOG_*`` variable a shipped module names, with the modules that name it.

    Example:
        >>> "UNDOLOG_DATABASE_URL" in environment_variables()
        True
    """
    found: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for name in set(_ENV.findall(path.read_text())):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return dict(sorted(found.items()))
