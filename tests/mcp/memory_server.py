"""An upstream MCP server (the official SDK's low-level ``Server`` with FastMCP's tools: ``lowlevel_tools.py``) whose
whole state lives in its own process's memory: what a compensation run in any other process (a fresh upstream started
for a rollback) cannot reach."""

from __future__ import annotations

import os
from typing import Any

from lowlevel_tools import ToolServer

mcp = ToolServer("memory")
ITEMS: dict[int, str] = {}
NEXT = [1]


@mcp.tool()
def add_item(name: str) -> dict[str, Any]:
    """Add an item; answers its id."""
    n = NEXT[0]
    NEXT[0] += 1
    ITEMS[n] = name
    return {"id": n, "name": name}


@mcp.tool()
def remove_item(id: int) -> str:
    """Remove an item (one that is not there is fine)."""
    ITEMS.pop(id, None)
    return "removed"


@mcp.tool()
def list_items() -> dict[str, Any]:
    """The items, and which process holds them."""
    return {"items": sorted(ITEMS.values()), "pid": os.getpid()}


if __name__ == "__main__":
    mcp.run()
