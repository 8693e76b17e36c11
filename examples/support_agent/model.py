"""A scripted chat model: the demo and the tests run the real agent loop with no API key and no network."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

Turn = Sequence[tuple[str, dict[str, Any]]]


class ScriptedChatModel(BaseChatModel):
    """Plays a script of tool calls, picked by a keyword of the latest user message.

    Turn *k* of a user turn (the number of AI messages since that user message) makes the calls in
    ``scripts[keyword][k]``, all in one message when there are several. When the script is over, or
    a tool answered with an error (a refusal, a rejection, a rollback), the model stops calling tools
    and answers with a short, honest summary of what the tools said. The turn is derived from the
    conversation, not from a counter, so a re-run or a fresh process gives the same answer.
    ``bind_tools`` returns the model itself, which is all ``create_agent`` needs.

    Example:
        >>> model = ScriptedChatModel(scripts={"refund": [[("send_refund_email", {"user_id": "u-1"})]]})
        >>> model.invoke("please refund me").tool_calls[0]["name"]
        'send_refund_email'
    """

    scripts: dict[str, list[list[tuple[str, dict[str, Any]]]]]

    @property
    def _llm_type(self) -> str:
        return "undolog-scripted"

    def bind_tools(self, tools: Any, *, tool_choice: Any = None, **kwargs: Any) -> ScriptedChatModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        since = _since_last_human(messages)
        text = _text(next((m for m in reversed(messages) if isinstance(m, HumanMessage)), None))
        script = next((turns for key, turns in self.scripts.items() if key.lower() in text.lower()), [])
        k = sum(isinstance(m, AIMessage) for m in since)
        tool_msgs = [m for m in since if isinstance(m, ToolMessage)]
        last_batch = _last_batch(since)
        if k < len(script) and not any(m.status == "error" for m in last_batch):
            calls = [
                {"name": name, "args": dict(args), "id": "call_" + uuid.uuid4().hex[:10], "type": "tool_call"}
                for name, args in script[k]
            ]
            msg = AIMessage(content="", tool_calls=calls)
        else:
            msg = AIMessage(content=_summary(tool_msgs))
        return ChatResult(generations=[ChatGeneration(message=msg)])


def _since_last_human(messages: Sequence[BaseMessage]) -> list[BaseMessage]:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], HumanMessage):
            return list(messages[i + 1:])
    return list(messages)


def _last_batch(since: Sequence[BaseMessage]) -> list[ToolMessage]:
    out: list[ToolMessage] = []
    for m in reversed(since):
        if isinstance(m, ToolMessage):
            out.append(m)
        else:
            break
    return out


def _text(m: BaseMessage | None) -> str:
    if m is None:
        return ""
    return m.content if isinstance(m.content, str) else " ".join(str(c) for c in m.content)


def _summary(tool_msgs: Sequence[ToolMessage]) -> str:
    if not tool_msgs:
        return "How can I help?"
    failed = [m for m in tool_msgs if m.status == "error"]
    if failed:
        return "I could not finish this. " + _text(failed[-1])
    return "All done: " + ", ".join(f"{m.name} succeeded" for m in tool_msgs) + "."
