"""A scripted CrewAI LLM: plays a fixed list of tool calls, then answers. No network, no keys.

``native=True`` answers in OpenAI tool-call form (CrewAI's native function-calling path);
``native=False`` writes ReAct text (``Action:`` / ``Action Input:``), CrewAI's text path.
"""

from __future__ import annotations

import json
import re
from typing import Any

from crewai.llms.base_llm import BaseLLM
from pydantic import Field, PrivateAttr


class ScriptedLLM(BaseLLM):
    """Plays ``steps`` (``{"tool": name, "args": {...}}``) one per turn, then a final answer.

    The turn is derived from the conversation (how many tool results it holds), so the same
    instance replays correctly however CrewAI builds its messages.

    Example:
        >>> llm = ScriptedLLM(model="scripted", steps=[{"tool": "search_knowledge_base",
        ...                                             "args": {"query": "refund"}}])
    """

    steps: list[dict[str, Any]] = Field(default_factory=list)
    native: bool = True
    observations: list[str] = Field(default_factory=list)
    _calls: int = PrivateAttr(default=0)

    def supports_function_calling(self) -> bool:
        return self.native

    def get_input_tokens_count(self, messages: Any, tools: Any = None, response_model: Any = None) -> int:
        # The base class warns on every call that it only estimates; an estimate is all a script needs.
        text = messages if isinstance(messages, str) else " ".join(str(m.get("content", "")) for m in messages)
        return len(text) // 4 + 1

    def call(self, messages: Any, tools: Any = None, callbacks: Any = None, available_functions: Any = None,
             from_task: Any = None, from_agent: Any = None, response_model: Any = None) -> Any:
        self._calls += 1
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        if self.native:
            results = [str(m.get("content", "")) for m in msgs if m.get("role") == "tool"]
            self.observations[:] = results
            turn = len(results)
            if turn < len(self.steps):
                step = self.steps[turn]
                return [{"id": f"call_{turn + 1}", "type": "function",
                         "function": {"name": step["tool"], "arguments": json.dumps(step["args"])}}]
            return "Final summary: " + " | ".join(results)
        # The system prompt explains the format and so contains "Observation:" itself.
        text = "\n".join(str(m.get("content", "")) for m in msgs if m.get("role") != "system")
        results = [chunk.strip().split("\nThought:")[0].strip() for chunk in re.split(r"Observation:", text)[1:]]
        self.observations[:] = results
        turn = len(results)
        if turn < len(self.steps):
            step = self.steps[turn]
            return (f"Thought: I should use {step['tool']}\nAction: {step['tool']}\n"
                    f"Action Input: {json.dumps(step['args'])}")
        summary = " | ".join(r.replace("\n", " ") for r in results)
        return f"Thought: I now know the final answer\nFinal Answer: {summary or 'nothing to do'}"
