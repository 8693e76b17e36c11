"""Tools the way FastMCP (the SDK's high-level server, 1.x line) shows them, served by the SDK's low-level ``Server``:
the test upstreams (``tickets_server.py``, ``counter_server.py``, ...) start several hundred times per test run.

On FastMCP each start cost about 0.51 CPU s, here 0.34 (a start listing the tools; medians of 9 alternating runs,
2 cores, load 4): ``mcp.server.fastmcp`` imports starlette, uvicorn, sse-starlette and pydantic-settings, the SDK's
package ``__init__`` files import FastMCP, httpx imports its command-line client (click, pygments, Rich), and
FastMCP builds a pydantic model per tool at start. The gateway's tests look at what an upstream advertises and
answers (input and output schemas, structured content, tool errors), so this module keeps all of it exactly as
FastMCP had it (the same schemas, titles and key order; the same result content; the same pydantic argument checks
and error texts) and drops only the rest: each tool's argument model is built at its first call, and the SDK is
imported the way a gateway imports it (``undolog_mcp._sdk_import``: no package ``__init__``, no FastMCP, no httpx
command-line client).

A test places this file beside the server it starts (``mcp_upstreams.copy_upstream``): the gateway starts the server
as a script from the test's folder, with the SDK's bare environment, where only the script's folder is on
``sys.path``.

Example:
    >>> app = ToolServer("tickets")
    >>> @app.tool()
    ... def close_ticket(id: int) -> str:
    ...     '''Close a ticket.'''
    ...     return "closed"
    >>> app.run()
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import Annotated, Any

from undolog_mcp._sdk_import import defer_inits

defer_inits()

import anyio  # noqa: E402 - after defer_inits, as the gateway imports the SDK
from mcp import types  # noqa: E402
from mcp.server.lowlevel import NotificationOptions, Server  # noqa: E402
from mcp.server.stdio import stdio_server  # noqa: E402

_JSON = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _title(name: str) -> str:
    return name.title().replace("_", " ")  # pydantic's default field title


def _property(annotation: Any, title: str | None = None) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin is list:
        (item,) = typing.get_args(annotation)
        prop: dict[str, Any] = {"items": _property(item), "type": "array"}
    elif origin is dict:
        prop = {"additionalProperties": True, "type": "object"}
    else:
        prop = {"type": _JSON[annotation]}
    if title is not None:
        prop["title"] = title
    return _ordered(prop)


def _ordered(prop: dict[str, Any]) -> dict[str, Any]:
    # pydantic's key order: the listing is FastMCP's byte for byte, not only equal as JSON.
    order = ("default", "items", "additionalProperties", "title", "type")
    return {k: prop[k] for k in sorted(prop, key=order.index)}


def object_schema(title: str, fields: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The JSON schema pydantic writes for a model of these fields (name: (annotation, default or ``...``))."""
    props = {}
    for name, (annotation, default) in fields.items():
        prop = _property(annotation, _title(name))
        if default is not ...:
            prop = _ordered({**prop, "default": default})
        props[name] = prop
    schema: dict[str, Any] = {"properties": props}
    required = [name for name, (_, default) in fields.items() if default is ...]
    if required:
        schema["required"] = required
    schema["title"] = title
    schema["type"] = "object"
    return schema


def _output(name: str, returns: Any) -> tuple[dict[str, Any] | None, bool]:
    """FastMCP's output schema for a return annotation, and whether the result is wrapped as ``{"result": ...}``."""
    if typing.get_origin(returns) is Annotated:  # Annotated[CallToolResult, Model]: the model's schema, as is
        returns = typing.get_args(returns)[1]
    if returns is dict or returns is types.CallToolResult:
        return None, False  # a bare dict or a whole result: no schema, the result is not checked
    if typing.is_typeddict(returns):
        hints = typing.get_type_hints(returns)
        return object_schema(returns.__name__, {k: (v, ...) for k, v in hints.items()}), False
    if typing.get_origin(returns) is dict:
        return {"additionalProperties": True, "title": f"{name}DictOutput", "type": "object"}, False
    return object_schema(f"{name}Output", {"result": (returns, ...)}), True


def _content(result: Any) -> list[types.ContentBlock]:
    """FastMCP's unstructured content: a string as is, a list item by item, anything else as indented JSON."""
    if isinstance(result, list | tuple):
        return [block for item in result for block in _content(item)]
    if isinstance(result, str):
        return [types.TextContent(type="text", text=result)]
    return [types.TextContent(type="text", text=json.dumps(result, indent=2, ensure_ascii=False))]


class _Tool:
    def __init__(self, fn: Callable[..., Any], annotations: types.ToolAnnotations | None) -> None:
        self.fn = fn
        self.name = fn.__name__
        signature = inspect.signature(fn, eval_str=True)
        self.fields = {p.name: (p.annotation, ... if p.default is p.empty else p.default)
                       for p in signature.parameters.values()}
        self.output, self.wrap = _output(self.name, signature.return_annotation)
        self.definition = types.Tool(name=self.name, description=fn.__doc__,
                                     inputSchema=object_schema(f"{self.name}Arguments", self.fields),
                                     outputSchema=self.output, annotations=annotations)
        self._model: Any = None

    def arguments(self, raw: dict[str, Any]) -> dict[str, Any]:
        """FastMCP's check of the arguments: JSON given inside a string parsed first, then a pydantic model of the
        parameters (built at the first call: most tools of a test's upstream are never called)."""
        if self._model is None:
            from pydantic import create_model

            self._model = create_model(f"{self.name}Arguments", **self.fields)  # type: ignore[call-overload]
        data = dict(raw)
        for key, value in raw.items():
            if key in self.fields and isinstance(value, str) and self.fields[key][0] is not str:
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError:
                    continue
                if not isinstance(parsed, str | int | float):
                    data[key] = parsed
        model = self._model.model_validate(data)
        return {name: getattr(model, name) for name in self.fields}

    async def call(self, raw: dict[str, Any]) -> Any:
        try:
            result = self.fn(**self.arguments(raw))
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            raise RuntimeError(f"Error executing tool {self.name}: {exc}") from exc
        if isinstance(result, types.CallToolResult):
            return result
        if self.output is None:
            return _content(result)
        return _content(result), ({"result": result} if self.wrap else result)


class ToolServer:
    """A low-level ``Server`` whose tools are plain functions, listed and called as FastMCP lists and calls them.

    Its capabilities are FastMCP's too (tools, and empty prompts and resources): the gateway decides what it passes
    through from them. Sync tools run on the event loop, as FastMCP runs them (a slow one holds the server).
    """

    def __init__(self, name: str) -> None:
        self.server: Server[Any, Any] = Server(name)
        self.tools: dict[str, _Tool] = {}
        server = self.server

        @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
        async def list_tools() -> list[types.Tool]:
            return [tool.definition for tool in self.tools.values()]

        @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
        async def call_tool(name: str, arguments: dict[str, Any]) -> Any:
            tool = self.tools.get(name)
            if tool is None:
                raise RuntimeError(f"Unknown tool: {name}")
            return await tool.call(arguments)

        @server.list_prompts()  # type: ignore[no-untyped-call, untyped-decorator]
        async def list_prompts() -> list[types.Prompt]:
            return []

        @server.get_prompt()  # type: ignore[no-untyped-call, untyped-decorator]
        async def get_prompt(name: str, arguments: dict[str, str] | None) -> types.GetPromptResult:
            raise ValueError(f"Unknown prompt: {name}")

        @server.list_resources()  # type: ignore[no-untyped-call, untyped-decorator]
        async def list_resources() -> list[types.Resource]:
            return []

        @server.read_resource()  # type: ignore[no-untyped-call, untyped-decorator]
        async def read_resource(uri: Any) -> Any:
            raise ValueError(f"Unknown resource: {uri}")

        @server.list_resource_templates()  # type: ignore[no-untyped-call, untyped-decorator]
        async def list_resource_templates() -> list[types.ResourceTemplate]:
            return []

    def tool(self, annotations: types.ToolAnnotations | None = None) -> Callable[[Callable[..., Any]], Any]:
        """Add the decorated function as a tool: its name, docstring, parameters and return annotation say what
        FastMCP would have listed."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add_tool(fn, annotations)
            return fn

        return add

    def add_tool(self, fn: Callable[..., Any], annotations: types.ToolAnnotations | None = None) -> None:
        """Add (or replace) a tool; a new one is listed last."""
        self.tools[fn.__name__] = _Tool(fn, annotations)

    def remove_tool(self, name: str) -> None:
        """Stop listing a tool."""
        del self.tools[name]

    def meta(self) -> dict[str, Any]:
        """The ``_meta`` of the request being answered (its fields beyond the SDK's own)."""
        meta = self.server.request_context.meta
        return dict(meta.model_extra or {}) if meta is not None else {}

    @property
    def session(self) -> Any:
        """The session of the request being answered."""
        return self.server.request_context.session

    def run(self) -> None:
        """Serve over stdio until the client goes."""

        async def main() -> None:
            options = self.server.create_initialization_options(NotificationOptions())
            async with stdio_server() as (read, write):
                await self.server.run(read, write, options)

        anyio.run(main)
