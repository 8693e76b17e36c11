"""The benchmark's upstream MCP server (official SDK, FastMCP): trivial in-memory tools, so what is measured is
the path in front of them."""

from __future__ import annotations

from mcp.server.fastmcp import FastMCP

# WARNING, not FastMCP's INFO: the SDK logs "Processing request of type ..." for every request to stderr, which
# the benchmark's console would show between its table's lines.
mcp = FastMCP("bench-upstream", log_level="WARNING")
ITEMS: set[str] = set()


@mcp.tool()
def lookup(q: str) -> str:
    """A SAFE tool."""
    return q


@mcp.tool()
def add_item(name: str) -> str:
    """A COMPENSABLE tool."""
    ITEMS.add(name)
    return name


@mcp.resource("bench://doc", mime_type="text/plain")
def doc() -> str:
    """A resource: reading it is SAFE by nature."""
    return "a document"


@mcp.tool()
def remove_item(name: str) -> str:
    """add_item's compensation."""
    ITEMS.discard(name)
    return name


if __name__ == "__main__":
    mcp.run()
