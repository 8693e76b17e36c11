"""A gateway config as an ``--app``: the CLI and the desk load the upstreams' tools and compensations from it, so
``undolog sessions rollback`` and the desk's recovery loop can undo what an MCP client did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from undolog_core import UndoLog
from undolog_core.errors import ConfigurationError
from undolog_core.integration import run_coro_blocking

from .config import load_config


def register_gateway(path: str | Path, into: UndoLog) -> UndoLog:
    """Register every classified tool of the config's upstreams (listed now, over short-lived connections) with
    ``into``, with the same contracts the running gateway registers, so no revision is made by loading it.

    Example:
        >>> register_gateway("gateway.toml", UndoLog.open("sqlite:///undolog.db"))
    """
    from .gateway import Gateway
    from .upstream import first_cause, list_tools

    config = load_config(path)

    async def listing() -> dict[str, Any]:
        listed: dict[str, Any] = {}
        for name, cfg in config.upstreams.items():
            try:
                listed[name] = await list_tools(cfg)
            except Exception as exc:  # noqa: BLE001 - said as a configuration problem naming the upstream
                raise ConfigurationError(f"upstream {name!r} of {path}: could not list its tools: "
                                         f"{first_cause(exc)}") from exc
        return listed

    Gateway(config, into).register(run_coro_blocking(listing()))
    return into
