"""A forward-only MCP proxy written with the same SDK: lists the upstream's tools and forwards every call and
every resource read, nothing else. The floor any gateway pays (two hops instead of one)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import anyio
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server


async def main(command: list[str]) -> None:
    params = StdioServerParameters(command=command[0], args=command[1:])
    async with stdio_client(params) as (r, w), ClientSession(r, w) as upstream:
        await upstream.initialize()
        tools = (await upstream.list_tools()).tools
        server: Server[Any, Any] = Server("forward-proxy")

        @server.list_tools()  # type: ignore[misc]
        async def _list() -> list[types.Tool]:
            return tools

        @server.call_tool(validate_input=False)  # type: ignore[misc]
        async def _call(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            return await upstream.call_tool(name, arguments)

        @server.list_resources()  # type: ignore[misc]
        async def _resources() -> list[types.Resource]:
            return (await upstream.list_resources()).resources

        async def _read(req: types.ReadResourceRequest) -> types.ServerResult:
            return types.ServerResult(await upstream.read_resource(req.params.uri))

        server.request_handlers[types.ReadResourceRequest] = _read  # the upstream's answer, as it came

        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    # Quiet, as the gateway runs (WARNING): no "Processing request of type ..." line per request on the console.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    anyio.run(main, sys.argv[1:])
