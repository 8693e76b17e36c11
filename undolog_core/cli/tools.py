"""``undolog tools``: the tool registry, every contract revision with its fingerprint and tier."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import typer

from ._output import _print_json, _show, _state, _Table, _txt, _when
from ._root import CliInputError, JsonOpt, _open


def tools(
    ctx: typer.Context,
    tool: Annotated[str | None, typer.Option("--tool", help="Only this tool's revisions.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the tool registry: every contract revision with its fingerprint and tier.

    \f
    Reads ``undolog_tool_registry``, the immutable contract audit trail; the newest revision of each tool
    is the one new sessions are pinned to.
    """
    from rich.text import Text  # the command's own: importing the CLI loads no Rich

    u = _open(ctx)
    rows = u.registry.history(tool)
    if tool and not rows:
        raise CliInputError(f"tool {tool!r} has never been registered in this database")
    if as_json:
        _print_json([_registry_row(r) for r in rows])
        return
    if not rows:
        typer.echo("no tools registered yet")
        return
    latest = {r["tool_name"]: r["revision"] for r in rows}  # rows are ordered by (tool, revision)
    table = _Table("Tool registry (fingerprints shortened; --json for full values)")
    table.col("Tool", no_wrap=True)
    table.col("Rev", justify="right")
    table.col("Tier")
    table.col("Fingerprint", no_wrap=True)
    table.col("Previous", no_wrap=True, drop=3)
    table.col("Compensation")
    table.col("Registered by", drop=1)
    table.col("Registered at (UTC)", no_wrap=True, drop=2)
    for r in rows:
        comp = f"{r['compensation_name']} v{r['compensation_version']}" if r["compensation_name"] else "-"
        rev = Text(str(r["revision"]) + ("" if latest[r["tool_name"]] == r["revision"] else " (old)"),
                   style="" if latest[r["tool_name"]] == r["revision"] else "dim")
        table.row(_txt(r["tool_name"]), rev, _state(r["tier"]), r["fingerprint"][:16],
                  (r["previous_fingerprint"] or "-")[:16], _txt(comp), _txt(r["registered_by"]),
                  _when(r["registered_at"]))
    _show(table)


def _registry_row(r: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("tool_name", "revision", "tier", "fingerprint", "previous_fingerprint", "compensation_name",
            "compensation_version", "registered_by", "registered_at", "contract")
    return {k: r.get(k) for k in keys}
