"""``undolog mcp init``: a proposed gateway.toml from an upstream's own tool list.

MCP's tool annotations are hints the protocol itself says not to trust, so they only suggest: ``readOnlyHint``
suggests safe, ``destructiveHint`` suggests irreversible, and everything else is left unclassified (not exposed)
with a comment. Every line says it is a proposal.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from mcp import types

from .config import UpstreamConfig
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
    lines = [
        "# PROPOSAL written by `undolog mcp init`: review every line before serving.",
        "# MCP annotations are hints, not guarantees; this file decides each tool's tier.",
        "# A tool left without a tier is not exposed to clients at all.",
        "",
        f"[upstreams.{_key(upstream)}]",
        f"command = {json.dumps(command)}",
    ]
    if env:
        lines.append("env = { " + ", ".join(f"{_key(k)} = {json.dumps(v)}" for k, v in sorted(env.items())) + " }")
    lines.append("")
    for tool in sorted(tools, key=lambda t: t.name):
        ann = tool.annotations
        head = f"[tools.{_key(upstream)}.{_key(tool.name)}]"
        desc = (tool.description or "").strip().splitlines()[0:1]
        about = f"  # {desc[0][:100]}" if desc else ""
        if ann is not None and ann.readOnlyHint:
            lines += [f"{head}{about}", 'tier = "safe"  # proposed: the upstream hints readOnlyHint', ""]
        elif ann is not None and ann.destructiveHint:
            lines += [f"{head}{about}", 'tier = "irreversible"  # proposed: the upstream hints destructiveHint',
                      f"reason = {json.dumps(tool.description or tool.name)}", ""]
        else:
            lines += [
                f"# {head}{about}",
                "# tier = ?  # unclassified: no hint to go on. safe, compensable (with a compensation tool),",
                "#            or irreversible. Until a tier is set here, the tool is not exposed.",
                '# compensation = { tool = "...", args = { id = "{result.id}" } }',
                "",
            ]
    return "\n".join(lines)


def _key(name: str) -> str:
    """A TOML key: bare when it can be, quoted otherwise."""
    if name and all(c.isalnum() or c in "-_" for c in name):
        return name
    return json.dumps(name)
