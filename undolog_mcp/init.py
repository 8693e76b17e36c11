"""``undolog mcp init``: a proposed gateway.toml from an upstream's own tool list.

MCP's tool annotations are hints the protocol itself says not to trust, so they only suggest: ``readOnlyHint``
suggests safe, an evident inverse (a move undone by moving back, a create by the matching delete: ``inverses``)
suggests compensable with that compensation, ``destructiveHint`` suggests irreversible, and everything else is
left unclassified (not exposed) with a comment. Each tool's argument and output field names are printed, for
writing templates. Every line says it is a proposal.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mcp import types

from .config import UpstreamConfig
from .inverses import Inverse, find_inverse, props
from .upstream import list_tools


def propose(upstream: str, command: list[str], *, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> str:
    """The proposed config text for the upstream started by ``command`` (with ``env`` added to its environment).

    Example:
        >>> print(propose("tickets", ["python", "tickets_server.py"]))
    """
    tools = asyncio.run(list_tools(UpstreamConfig(upstream, tuple(command), cwd=cwd, env=dict(env or {}))))
    return render(upstream, command, tools, env)


def render(upstream: str, command: list[str], tools: list[types.Tool], env: dict[str, str] | None = None) -> str:
    """The proposal's text: every tool with its argument and output field names, a tier where a hint or an
    evident inverse suggests one, and every line marked a proposal."""
    up = _key(upstream)
    lines = [
        "# PROPOSAL written by `undolog mcp init`: review every line before serving.",
        "# MCP annotations are hints, not guarantees; this file decides each tool's tier.",
        "# A tool left without a tier is not exposed to clients at all.",
        "",
        f"[upstreams.{up}]  # proposed",
        f"command = {json.dumps(command)}  # proposed",
    ]
    if env:
        lines.append("env = { " + ", ".join(f"{_key(k)} = {json.dumps(v)}" for k, v in sorted(env.items()))
                     + " }  # proposed")
    lines.append("")
    by_name = {t.name: t for t in tools}
    for tool in sorted(tools, key=lambda t: t.name):
        ann = tool.annotations
        head = f"[tools.{up}.{_key(tool.name)}]"
        desc = (tool.description or "").strip().splitlines()[0:1]
        about = f"  # proposed: {desc[0][:100]}" if desc else "  # proposed"
        fields = _fields(tool)
        inverse = None if ann is not None and ann.readOnlyHint else find_inverse(tool, by_name)
        if ann is not None and ann.readOnlyHint:
            lines += [f"{head}{about}", *fields, 'tier = "safe"  # proposed: the upstream hints readOnlyHint', ""]
        elif inverse is not None and not inverse.unsure:
            lines += [f"{head}{about}", *fields,
                      f'tier = "compensable"  # proposed: an evident inverse ({inverse.why})'
                      + ("; the upstream hints destructiveHint" if ann is not None and ann.destructiveHint else ""),
                      f"compensation = {_compensation(inverse)}  # proposed: check it undoes the call", ""]
        elif ann is not None and ann.destructiveHint:
            lines += [f"{head}{about}", *fields,
                      'tier = "irreversible"  # proposed: the upstream hints destructiveHint',
                      f"reason = {json.dumps(tool.description or tool.name)}  # proposed", ""]
        else:
            lines += [f"# {head}{about}", *fields]
            if inverse is not None:
                lines += [f"# tier = \"compensable\"  # proposed: {inverse.why}; fill in "
                          f"{', '.join(inverse.unsure)}",
                          f"# compensation = {_compensation(inverse)}  # proposed"]
            else:
                lines += [
                    "# tier = ?  # unclassified: no hint to go on. safe, compensable (with a compensation tool),",
                    "#            or irreversible. Until a tier is set here, the tool is not exposed.",
                    '# compensation = { tool = "...", args = { id = "{result.id}" } }  # proposed shape',
                ]
            lines.append("")
    return "\n".join(lines)


def _fields(tool: types.Tool) -> list[str]:
    """Comment lines naming what the tool takes and answers: what ``{args.NAME}`` and ``{result.NAME}`` read."""
    required = (tool.inputSchema or {}).get("required")
    takes = [n + ("" if isinstance(required, list) and n in required else "?") for n in props(tool.inputSchema)]
    answers = list(props(tool.outputSchema))
    return [f"#   arguments: {', '.join(takes) or '(none)'}  (? optional; {{args.NAME}} in a template)",
            f"#   answers: {', '.join(answers)}  ({{result.NAME}})" if answers else
            "#   answers: no output schema listed ({result.NAME} reads its text parsed as JSON)"]


def _compensation(inverse: Inverse) -> str:
    parts = [f"tool = {json.dumps(inverse.tool)}", f"args = {_inline(inverse.args)}"]
    if inverse.for_each is not None:
        parts += [f"for_each = {json.dumps(inverse.for_each)}", "skip_if_empty = true"]
    return "{ " + ", ".join(parts) + " }"


def _inline(value: Any) -> str:
    """A TOML inline value (tables and arrays of strings)."""
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_inline(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return json.dumps(value)


def _key(name: str) -> str:
    """A TOML key: bare when it can be, quoted otherwise."""
    if name and all(c.isalnum() or c in "-_" for c in name):
        return name
    return json.dumps(name)
