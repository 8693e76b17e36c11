"""An MCP server (the SDK's low-level ``Server``, over stdio) whose tools and prompts grow while it runs: ``grow``
adds a tool or a prompt of the name it is given and says so (``notifications/tools/list_changed`` or
``notifications/prompts/list_changed``), as a server that loads a plugin does."""

from __future__ import annotations

from typing import Any

from undolog_mcp._sdk_import import defer_inits

# The SDK imported as a gateway imports it: its package __init__ files (FastMCP and its web stack) never run.
defer_inits()

import anyio  # noqa: E402
from mcp import types  # noqa: E402
from mcp.server.lowlevel import NotificationOptions, Server  # noqa: E402
from mcp.server.stdio import stdio_server  # noqa: E402

GROW = types.Tool(name="grow", description="Adds a tool or a prompt",
                  inputSchema={"type": "object", "properties": {"name": {"type": "string"},
                                                                "kind": {"enum": ["tool", "prompt"]}},
                               "required": ["name", "kind"]})


def build() -> Server[Any, Any]:
    server: Server[Any, Any] = Server("growing")
    tools = [GROW]
    prompts: list[types.Prompt] = []

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_tools() -> list[types.Tool]:
        return tools

    @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
    async def call_tool(name: str, args: dict[str, Any]) -> list[types.ContentBlock]:
        session = server.request_context.session
        if name == "grow":
            if args["kind"] == "tool":
                tools.append(types.Tool(name=args["name"], description="grown at run time",
                                        inputSchema={"type": "object", "properties": {}}))
                await session.send_tool_list_changed()
            else:
                prompts.append(types.Prompt(name=args["name"], description="grown at run time"))
                await session.send_prompt_list_changed()
            return [types.TextContent(type="text", text=f"added {args['kind']} {args['name']}")]
        return [types.TextContent(type="text", text=f"{name} ran")]

    @server.list_prompts()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_prompts() -> list[types.Prompt]:
        return prompts

    @server.get_prompt()  # type: ignore[no-untyped-call, untyped-decorator]
    async def get_prompt(name: str, args: dict[str, str] | None) -> types.GetPromptResult:
        return types.GetPromptResult(messages=[types.PromptMessage(
            role="user", content=types.TextContent(type="text", text=f"the {name} prompt"))])

    return server


async def main() -> None:
    server = build()
    options = server.create_initialization_options(NotificationOptions(tools_changed=True, prompts_changed=True))
    async with stdio_server() as (read, write):
        await server.run(read, write, options)


if __name__ == "__main__":
    anyio.run(main)
