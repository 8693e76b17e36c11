"""What a gateway process imports: ``undolog mcp serve`` (and ``connect``, ``init``) defer the MCP SDK's package
``__init__`` files (``undolog_mcp._sdk_import``), so a stdio gateway never loads FastMCP and its web stack
(starlette, uvicorn, sse-starlette, pydantic-settings), which an MCP client that opens a session per call paid
once per session (about 0.13 CPU s of a gateway's 1.1 s of start-up, measured on a 2-core machine), nor httpx's
command-line client (click, pygments, Rich), which httpx's ``__init__`` imports whenever they are installed.

One child process: ``sys.modules`` of this one already holds the whole SDK (the tests import it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import json, sys
    from undolog_mcp._sdk_import import defer_inits
    defer_inits()
    from undolog_mcp import require_sdk
    require_sdk()
    import undolog_mcp.gateway, undolog_mcp.stdio, undolog_mcp.socket, undolog_mcp.init
    from mcp.server.stdio import stdio_server
    heavy = sorted(m for m in ("mcp.server.fastmcp", "uvicorn", "starlette", "sse_starlette", "pydantic_settings",
                               "httpx._main", "rich", "pygments") if sys.modules.get(m) is not None)
    import httpx
    # The deferred __init__ runs with the first name it defines, and what it exports is then there as usual.
    from mcp import ClientSession, McpError, StdioServerParameters, types
    from mcp.server import FastMCP, Server
    import mcp
    print(json.dumps({
        "heavy_before": heavy,
        "init_ran": "mcp.server.fastmcp" in sys.modules and type(mcp).__name__ == "module",
        "same_types": types is sys.modules["mcp.types"] and "ClientSession" in mcp.__all__,
        "same_server": Server is sys.modules["mcp.server.lowlevel"].Server,
        "names": [ClientSession.__name__, McpError.__name__, StdioServerParameters.__name__, FastMCP.__name__],
        "httpx": [callable(httpx.main), httpx.AsyncClient.__name__],
    }))
""")


def test_a_gateway_imports_no_fastmcp_and_the_sdk_still_exports_every_name() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout)
    assert seen["heavy_before"] == [], f"a gateway process imported {seen['heavy_before']}"
    assert seen["init_ran"] and seen["same_types"] and seen["same_server"]
    assert seen["names"] == ["ClientSession", "McpError", "StdioServerParameters", "FastMCP"]
    assert seen["httpx"] == [True, "AsyncClient"]  # httpx itself as usual; its main() a stub


def test_deferring_after_the_sdk_is_imported_changes_nothing() -> None:
    import mcp

    from undolog_mcp._sdk_import import defer_inits

    before = sys.modules["mcp"]
    defer_inits()
    assert sys.modules["mcp"] is before is mcp and type(mcp).__name__ == "module"
