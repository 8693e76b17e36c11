"""The approval desk: REST API, dashboard, webhooks and tool proxy (``undolog serve``, the [server] extra).

Importing this package does not import FastAPI, so ``undolog`` works without the extra;
``create_app`` loads it on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
