"""UndoLog's MCP gateway: the three tiers in front of any MCP server, for any MCP client.

Needs the ``mcp`` extra (the official MCP SDK, 1.x line: the line that installs beside the crewai and
semantic-kernel extras). ``undolog mcp serve --config gateway.toml`` runs it.

Importing this package loads nothing heavy: the SDK is imported with the first name used from it, and a missing
SDK is an ``ImportError`` naming the extra to install.

Example:
    >>> from undolog_mcp import Gateway, load_config
    >>> gw = Gateway(load_config("gateway.toml"), UndoLog.open("sqlite:///undolog.db"))
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Approval": "config",
    "CompensationTemplate": "config",
    "GatewayConfig": "config",
    "SessionGrouping": "config",
    "ToolConfig": "config",
    "UpstreamConfig": "config",
    "load_config": "config",
    "Gateway": "gateway",
    "register_gateway": "app",
}


def require_sdk() -> None:
    """Raise an ``ImportError`` naming the extra when the MCP SDK is not installed."""
    try:
        import mcp  # noqa: F401
    except ImportError as exc:
        raise ImportError("the MCP gateway needs the mcp extra: pip install 'undolog[mcp]'") from exc


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'undolog_mcp' has no attribute {name!r}")
    if module != "config":
        require_sdk()
    return getattr(importlib.import_module(f"undolog_mcp.{module}"), name)


__all__ = sorted(_EXPORTS)
