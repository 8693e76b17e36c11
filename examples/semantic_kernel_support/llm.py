"""A scripted Semantic Kernel chat service: plays fixed tool calls, then answers. No network, no keys."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field
from semantic_kernel.connectors.ai.chat_completion_client_base import ChatCompletionClientBase
from semantic_kernel.connectors.ai.function_choice_behavior import FunctionChoiceBehavior
from semantic_kernel.connectors.ai.prompt_execution_settings import PromptExecutionSettings
from semantic_kernel.contents import (
    AuthorRole,
    ChatHistory,
    ChatMessageContent,
    FunctionCallContent,
    FunctionResultContent,
)


def call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    """One scripted tool call; ``name`` is SK's ``plugin-function`` name."""
    return {"id": call_id, "name": name, "args": args}


class ScriptedChat(ChatCompletionClientBase):
    """Turn k (= assistant messages already holding calls) returns ``turns[k]``; then a final text.

    Example:
        >>> chat = ScriptedChat(ai_model_id="scripted",
        ...                     turns=[[call("c1", "support-search_knowledge_base", query="refund")]])
    """

    SUPPORTS_FUNCTION_CALLING: ClassVar[bool] = True
    turns: list[list[dict[str, Any]]] = Field(default_factory=list)
    calls: int = 0

    async def _inner_get_chat_message_contents(self, chat_history: ChatHistory,
                                               settings: PromptExecutionSettings) -> list[ChatMessageContent]:
        self.calls += 1
        k = sum(1 for m in chat_history.messages if m.role == AuthorRole.ASSISTANT
                and any(isinstance(i, FunctionCallContent) for i in m.items))
        if k < len(self.turns) and settings.function_choice_behavior is not None:
            items = [FunctionCallContent(id=c["id"], name=c["name"], arguments=json.dumps(c["args"]))
                     for c in self.turns[k]]
            return [ChatMessageContent(role=AuthorRole.ASSISTANT, items=items)]
        seen = [str(i.result) for m in chat_history.messages for i in m.items if isinstance(i, FunctionResultContent)]
        return [ChatMessageContent(role=AuthorRole.ASSISTANT, content="Final summary: " + " | ".join(seen))]


def auto_settings() -> PromptExecutionSettings:
    return PromptExecutionSettings(function_choice_behavior=FunctionChoiceBehavior.Auto())
