"""The conformance suite's fixture server, written here with the official SDK's low-level ``Server``.

``@modelcontextprotocol/conformance`` (0.1.16, server mode) runs its scenarios as a client against a server it is
pointed at; its own fixture (``everything-server.ts``) lives only in its source repository, not in the npm package.
This is that server: every tool, resource, template and prompt the scenarios name (their names and behaviours are
read from the package's ``dist/index.js``), plus ``undo``, a no-op compensation the gateway's COMPENSABLE run points
at (it is left unclassified, so the gateway does not expose it).

Run: ``python conformance_fixture.py`` (stdio) or ``python conformance_fixture.py --http PORT`` (streamable HTTP at
``/mcp``, with the SDK's DNS-rebinding protection for a loopback server).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

from undolog_mcp._sdk_import import defer_inits

# The SDK imported as a gateway imports it: its package __init__ files (FastMCP and its web stack) never run.
defer_inits()

import anyio  # noqa: E402
from mcp import types  # noqa: E402
from mcp.server.lowlevel import NotificationOptions, Server  # noqa: E402

# A 1x1 red PNG and a tiny WAV (44-byte header, two silent samples).
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")
WAV = (b"RIFF" + (40).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little") + (1).to_bytes(2, "little")
       + (1).to_bytes(2, "little") + (8000).to_bytes(4, "little") + (16000).to_bytes(4, "little")
       + (2).to_bytes(2, "little") + (16).to_bytes(2, "little") + b"data" + (4).to_bytes(4, "little") + b"\0\0\0\0")
PNG_B64 = base64.b64encode(PNG).decode()
WAV_B64 = base64.b64encode(WAV).decode()

NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}}
LEVELS = ["debug", "info", "notice", "warning", "error", "critical", "alert", "emergency"]

TOOLS = [
    types.Tool(name="test_simple_text", description="Returns simple text", inputSchema=NO_ARGS),
    types.Tool(name="test_image_content", description="Returns an image", inputSchema=NO_ARGS),
    types.Tool(name="test_audio_content", description="Returns audio", inputSchema=NO_ARGS),
    types.Tool(name="test_embedded_resource", description="Returns an embedded resource", inputSchema=NO_ARGS),
    types.Tool(name="test_multiple_content_types", description="Returns text, image and resource",
               inputSchema=NO_ARGS),
    types.Tool(name="test_tool_with_logging", description="Logs three messages while it runs", inputSchema=NO_ARGS),
    types.Tool(name="test_error_handling", description="Always answers an error", inputSchema=NO_ARGS),
    types.Tool(name="test_tool_with_progress", description="Reports progress 0, 50, 100", inputSchema=NO_ARGS),
    types.Tool(name="test_sampling", description="Asks the client's LLM",
               inputSchema={"type": "object", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"]}),
    types.Tool(name="test_elicitation", description="Asks the client's user",
               inputSchema={"type": "object", "properties": {"message": {"type": "string"}},
                            "required": ["message"]}),
    types.Tool(name="test_elicitation_sep1034_defaults", description="Elicitation with defaults",
               inputSchema=NO_ARGS),
    types.Tool(name="test_elicitation_sep1330_enums", description="Elicitation with every enum form",
               inputSchema=NO_ARGS),
    types.Tool(name="json_schema_2020_12_tool", description="Tool with JSON Schema 2020-12 features",
               inputSchema={
                   "$schema": "https://json-schema.org/draft/2020-12/schema",
                   "type": "object",
                   "$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                          "city": {"type": "string"}}}},
                   "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
                   "additionalProperties": False,
               }),
    types.Tool(name="undo", description="The compensation of every tool here: does nothing",
               inputSchema={"type": "object", "properties": {"key": {"type": "string"}}}),
]

RESOURCES = [
    types.Resource(uri="test://static-text", name="static-text", description="A static text resource",
                   mimeType="text/plain"),
    types.Resource(uri="test://static-binary", name="static-binary", description="A static binary resource",
                   mimeType="image/png"),
    types.Resource(uri="test://watched-resource", name="watched-resource", description="A resource to subscribe to",
                   mimeType="text/plain"),
]
TEMPLATES = [types.ResourceTemplate(uriTemplate="test://template/{id}/data", name="template",
                                    description="A resource per id", mimeType="application/json")]
PROMPTS = [
    types.Prompt(name="test_simple_prompt", description="A simple prompt"),
    types.Prompt(name="test_prompt_with_arguments", description="A prompt with arguments",
                 arguments=[types.PromptArgument(name="arg1", description="First", required=True),
                            types.PromptArgument(name="arg2", description="Second", required=True)]),
    types.Prompt(name="test_prompt_with_embedded_resource", description="A prompt embedding a resource",
                 arguments=[types.PromptArgument(name="resourceUri", description="The URI", required=True)]),
    types.Prompt(name="test_prompt_with_image", description="A prompt with an image"),
]


def text(value: str) -> list[types.ContentBlock]:
    return [types.TextContent(type="text", text=value)]


def build() -> Server[Any, Any]:
    server: Server[Any, Any] = Server("conformance-fixture", version="1.0.0",
                                      instructions="The conformance suite's fixture server.")
    subscribed: set[str] = set()
    level = {"value": "info"}

    async def log(message: str, at: str = "info") -> None:
        if LEVELS.index(at) >= LEVELS.index(level["value"]):
            ctx = server.request_context
            await ctx.session.send_log_message(at, message, logger="fixture", related_request_id=ctx.request_id)

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_tools() -> list[types.Tool]:
        return TOOLS

    @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
    async def call_tool(name: str, args: dict[str, Any]) -> Any:
        ctx = server.request_context
        if name == "test_simple_text":
            return text("This is a simple text response for testing.")
        if name == "test_image_content":
            return [types.ImageContent(type="image", data=PNG_B64, mimeType="image/png")]
        if name == "test_audio_content":
            return [types.AudioContent(type="audio", data=WAV_B64, mimeType="audio/wav")]
        if name == "test_embedded_resource":
            return [types.EmbeddedResource(type="resource", resource=types.TextResourceContents(
                uri="test://embedded-resource", mimeType="text/plain", text="This is an embedded resource content."))]
        if name == "test_multiple_content_types":
            return [*text("Multiple content types test:"),
                    types.ImageContent(type="image", data=PNG_B64, mimeType="image/png"),
                    types.EmbeddedResource(type="resource", resource=types.TextResourceContents(
                        uri="test://mixed-content-resource", mimeType="application/json",
                        text='{"test":"data","value":123}'))]
        if name == "test_tool_with_logging":
            await log("Tool execution started")
            await anyio.sleep(0.05)
            await log("Tool processing data")
            await anyio.sleep(0.05)
            await log("Tool execution completed")
            return text("Tool with logging executed successfully")
        if name == "test_error_handling":
            return types.CallToolResult(isError=True,
                                        content=text("This tool intentionally returns an error for testing"))
        if name == "test_tool_with_progress":
            token = ctx.meta.progressToken if ctx.meta else None
            for step in (0, 50, 100):
                if token is not None:
                    await ctx.session.send_progress_notification(token, step, 100, related_request_id=ctx.request_id)
                if step < 100:
                    await anyio.sleep(0.05)
            return text(f"Tool with progress executed successfully (token {token!r})")
        if name == "test_sampling":
            if not ctx.session.check_client_capability(types.ClientCapabilities(sampling=types.SamplingCapability())):
                return types.CallToolResult(isError=True, content=text("the client does not support sampling"))
            sampled = await ctx.session.create_message(
                messages=[types.SamplingMessage(role="user", content=types.TextContent(type="text",
                                                                                         text=args["prompt"]))],
                max_tokens=100, related_request_id=ctx.request_id)
            answer = sampled.content.text if isinstance(sampled.content, types.TextContent) else str(sampled.content)
            return text(f"LLM response: {answer}")
        if name.startswith("test_elicitation"):
            if not ctx.session.check_client_capability(types.ClientCapabilities(
                    elicitation=types.ElicitationCapability())):
                return types.CallToolResult(isError=True, content=text("the client does not support elicitation"))
            message, schema = _elicitation(name, args)
            got = await ctx.session.send_request(
                types.ServerRequest(types.ElicitRequest(params=types.ElicitRequestFormParams(
                    message=message, requestedSchema=schema))),
                types.ElicitResult, metadata=_related(ctx.request_id))
            if name == "test_elicitation":
                return text(f"User response: action={got.action}, content={got.content}")
            return text(f"Elicitation completed: action={got.action}, content={got.content}")
        if name == "json_schema_2020_12_tool":
            return text(f"name={args.get('name')}, address={args.get('address')}")
        if name == "undo":
            return text("undone")
        raise ValueError(f"unknown tool {name}")

    @server.list_resources()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_resources() -> list[types.Resource]:
        return RESOURCES

    @server.list_resource_templates()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_templates() -> list[types.ResourceTemplate]:
        return TEMPLATES

    async def read_resource(req: types.ReadResourceRequest) -> types.ServerResult:
        # Registered as the request's handler itself: the decorator's helper wraps contents its own way.
        u = str(req.params.uri)
        if u == "test://static-text":
            contents: list[Any] = [types.TextResourceContents(uri=u, mimeType="text/plain",
                                                              text="This is the content of the static text resource.")]
        elif u == "test://static-binary":
            contents = [types.BlobResourceContents(uri=u, mimeType="image/png", blob=PNG_B64)]
        elif u == "test://watched-resource":
            contents = [types.TextResourceContents(uri=u, mimeType="text/plain", text="watched")]
        elif u.startswith("test://template/") and u.endswith("/data"):
            ident = u[len("test://template/"):-len("/data")]
            contents = [types.TextResourceContents(uri=u, mimeType="application/json",
                                                   text=f'{{"id":"{ident}","templateTest":true,"data":"Data for ID: '
                                                        f'{ident}"}}')]
        else:
            raise ValueError(f"unknown resource {u}")
        return types.ServerResult(types.ReadResourceResult(contents=contents))

    server.request_handlers[types.ReadResourceRequest] = read_resource

    @server.subscribe_resource()  # type: ignore[no-untyped-call, untyped-decorator]
    async def subscribe(uri: Any) -> None:
        subscribed.add(str(uri))
        # Said at once, so a test sees an update relayed for what it subscribed to.
        await server.request_context.session.send_resource_updated(uri)

    @server.unsubscribe_resource()  # type: ignore[no-untyped-call, untyped-decorator]
    async def unsubscribe(uri: Any) -> None:
        subscribed.discard(str(uri))

    @server.list_prompts()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_prompts() -> list[types.Prompt]:
        return PROMPTS

    @server.get_prompt()  # type: ignore[no-untyped-call, untyped-decorator]
    async def get_prompt(name: str, args: dict[str, str] | None) -> types.GetPromptResult:
        args = args or {}
        if name == "test_simple_prompt":
            msgs = [types.PromptMessage(role="user", content=types.TextContent(
                type="text", text="This is a simple prompt for testing."))]
        elif name == "test_prompt_with_arguments":
            msgs = [types.PromptMessage(role="user", content=types.TextContent(
                type="text", text=f"Prompt with arguments: arg1='{args.get('arg1')}', arg2='{args.get('arg2')}'"))]
        elif name == "test_prompt_with_embedded_resource":
            msgs = [types.PromptMessage(role="user", content=types.EmbeddedResource(
                        type="resource", resource=types.TextResourceContents(
                            uri=args.get("resourceUri", "test://example-resource"), mimeType="text/plain",
                            text="Embedded resource content for testing."))),
                    types.PromptMessage(role="user", content=types.TextContent(
                        type="text", text="Please process the embedded resource above."))]
        elif name == "test_prompt_with_image":
            msgs = [types.PromptMessage(role="user", content=types.ImageContent(type="image", data=PNG_B64,
                                                                                mimeType="image/png")),
                    types.PromptMessage(role="user", content=types.TextContent(
                        type="text", text="Please analyze the image above."))]
        else:
            raise ValueError(f"unknown prompt {name}")
        return types.GetPromptResult(messages=msgs)

    @server.completion()  # type: ignore[no-untyped-call, untyped-decorator]
    async def complete(ref: Any, argument: types.CompletionArgument, context: Any) -> types.Completion:
        words = ["paris", "park", "party", "test", "testing"]
        values = [w for w in words if w.startswith(argument.value)]
        return types.Completion(values=values, total=len(values), hasMore=False)

    @server.set_logging_level()  # type: ignore[no-untyped-call, untyped-decorator]
    async def set_level(new: types.LoggingLevel) -> None:
        level["value"] = new

    return server


def _related(request_id: Any) -> Any:
    from mcp.shared.message import ServerMessageMetadata

    return ServerMessageMetadata(related_request_id=request_id)


def _elicitation(name: str, args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if name == "test_elicitation":
        return args.get("message", "Please provide your information"), {
            "type": "object",
            "properties": {"username": {"type": "string", "description": "User's response"},
                           "email": {"type": "string", "description": "User's email address"}},
            "required": ["username", "email"]}
    if name == "test_elicitation_sep1034_defaults":
        return "Please review and update the form fields with defaults", {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "User name", "default": "John Doe"},
                "age": {"type": "integer", "description": "User age", "default": 30},
                "score": {"type": "number", "description": "User score", "default": 95.5},
                "status": {"type": "string", "description": "User status", "enum": ["active", "inactive", "pending"],
                           "default": "active"},
                "verified": {"type": "boolean", "description": "Verification status", "default": True}}}
    return "Please select options from the enum fields", {
        "type": "object",
        "properties": {
            "untitledSingle": {"type": "string", "description": "Select one option",
                               "enum": ["option1", "option2", "option3"]},
            "titledSingle": {"type": "string", "description": "Select one option with titles",
                             "oneOf": [{"const": "value1", "title": "First Option"},
                                       {"const": "value2", "title": "Second Option"},
                                       {"const": "value3", "title": "Third Option"}]},
            "legacyEnum": {"type": "string", "description": "Select one option (legacy)",
                           "enum": ["opt1", "opt2", "opt3"],
                           "enumNames": ["Option One", "Option Two", "Option Three"]},
            "untitledMulti": {"type": "array", "description": "Select multiple options",
                              "items": {"type": "string", "enum": ["option1", "option2", "option3"]}},
            "titledMulti": {"type": "array", "description": "Select multiple options with titles",
                            "items": {"anyOf": [{"const": "value1", "title": "First Choice"},
                                                {"const": "value2", "title": "Second Choice"},
                                                {"const": "value3", "title": "Third Choice"}]}}}}


async def serve_stdio() -> None:
    from mcp.server.stdio import stdio_server

    server = build()
    async with stdio_server() as (read, write):
        await server.run(read, write, options_raw(server))


async def serve_http(port: int) -> None:
    import uvicorn
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from mcp.server.transport_security import TransportSecuritySettings

    server = build()
    server.create_initialization_options = lambda *a, **k: options_raw(server)  # type: ignore[method-assign]
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"])
    manager = StreamableHTTPSessionManager(app=server, security_settings=security)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await manager.handle_request(scope, receive, send)

    @contextlib.asynccontextmanager
    async def running() -> AsyncIterator[None]:
        async with manager.run():
            yield

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    async with running():
        await uvicorn.Server(config).serve()


_original = Server.create_initialization_options


def options_raw(server: Server[Any, Any]) -> Any:
    opts = _original(server, NotificationOptions(prompts_changed=True, resources_changed=True, tools_changed=True))
    if opts.capabilities.resources is not None:
        opts.capabilities.resources.subscribe = True
    return opts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, help="serve streamable HTTP on this port")
    ns = parser.parse_args()
    if ns.http is None:
        anyio.run(serve_stdio)
    else:
        print(f"fixture: http://127.0.0.1:{ns.http}/mcp", file=sys.stderr, flush=True)
        anyio.run(serve_http, ns.http)


if __name__ == "__main__":
    main()
