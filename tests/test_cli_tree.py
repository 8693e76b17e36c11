"""``undolog --help`` lists the same commands, with the same options and help, as the one-file ``cli.py`` did.

The CLI was one 1,400-line module; it is now a package by resource (``undolog_core/cli/``), and the desk's and the
gateway's commands come in through the ``undolog.cli_plugins`` entry-point group instead of the core importing
them. ``tests/data/cli_tree.json`` is the command tree the one-file CLI built (written by running
``command_tree()`` on it): a command that goes missing, moves, changes an option or its help fails here. A new
command is added to the file on purpose, with the change that adds it.

Example of what it reports: ``['undolog keys create']`` (missing from the tree built now).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from undolog_core.cli import app

TREE = Path(__file__).resolve().parent / "data" / "cli_tree.json"


def _param(p: Any, ctx: Any) -> dict[str, Any]:
    default = p.default if not callable(p.default) else "<callable>"
    return {
        "name": p.name,
        "opts": list(getattr(p, "opts", [])) + list(getattr(p, "secondary_opts", [])),
        "kind": type(p).__name__,
        "type": str(p.display_type(ctx)) if hasattr(p, "display_type") else type(p).__name__,
        "required": bool(p.required),
        "default": default if isinstance(default, str | int | float | bool | type(None) | list) else repr(default),
        "multiple": bool(getattr(p, "multiple", False)),
        "hidden": bool(getattr(p, "hidden", False)),
        "envvar": getattr(p, "envvar", None),
        "help": getattr(p, "help", None),
    }


def command_tree(typer_app: typer.Typer) -> list[dict[str, Any]]:
    """Every command and group of the app in the order ``--help`` lists them: path, help text, parameters."""
    root = typer.main.get_command(typer_app)
    ctx = root.context_class(root, info_name="undolog")
    out: list[dict[str, Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        out.append({"path": " ".join(["undolog", *path]), "help": (cmd.help or "").split("\f")[0].strip(),
                    "hidden": bool(getattr(cmd, "hidden", False)),
                    "params": [_param(p, ctx) for p in cmd.params]})
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name])

    walk(root, [])
    return out


def test_the_command_tree_is_the_one_file_clis() -> None:
    built = command_tree(app)
    pinned = json.loads(TREE.read_text(encoding="utf-8"))
    assert [c["path"] for c in built] == [c["path"] for c in pinned]
    for now, before in zip(built, pinned, strict=True):
        assert now == before, now["path"]


def test_the_desk_and_the_gateway_come_in_through_their_entry_points() -> None:
    """The core's CLI names neither package: ``serve``, ``keys`` and ``mcp`` exist because the installed
    distribution declares them in ``undolog.cli_plugins``, and ``undolog --help`` (a fresh process, the console
    script's path) lists them."""
    from importlib.metadata import entry_points

    declared = {ep.name: ep.value for ep in entry_points(group="undolog.cli_plugins")}
    assert declared == {"keys": "undolog_server.cli:register_keys [server]", "mcp": "undolog_mcp.cli:register [mcp]",
                        "serve": "undolog_server.cli:register_serve [server]"}
    shown = subprocess.run([sys.executable, "-m", "undolog_core.cli", "--help"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    # Rich boxes the listing: a command is the first word of a "│ name  help" line.
    listed = {line.strip("│ ").split(" ")[0] for line in shown.splitlines() if line.startswith("│ ")}
    assert {"serve", "keys", "mcp", "sessions", "approvals", "check-undo"} <= listed, shown
    assert "effects" in listed  # listed once it has a command: `undolog effects resolve`


if __name__ == "__main__":  # regenerate the pinned tree on purpose: python -m tests.test_cli_tree
    TREE.write_text(json.dumps(command_tree(app), indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")
