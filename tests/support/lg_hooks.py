"""LangChain agent middleware the adapter tests share (a framework hook, not a mock)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware


class AfterModel(AgentMiddleware):
    """Once armed, runs ``action(thread_id)`` right after the model asked for a tool (another process's halt, in
    effect): the tool call then meets a session changed since the turn's check, on the middleware's short path."""

    def __init__(self, action: Callable[[str], Any]) -> None:
        super().__init__()
        self.action = action
        self.armed = False

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        out = handler(request)
        self._fire()
        return out

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        out = await handler(request)
        await asyncio.to_thread(self._fire)
        return out

    def _fire(self) -> None:
        if self.armed:
            self.armed = False
            from langgraph.config import get_config

            self.action(get_config()["configurable"]["thread_id"])
