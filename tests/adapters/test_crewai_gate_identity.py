"""CrewAI's gate must know the wrapped tool by what it is, not by its name.

``tools.kickoff()`` scopes a before-tool-call hook that refuses any tool that was not wrapped. It compared names
only, so an unwrapped tool named like a wrapped one passed it: a ``Task(tools=[...])`` (CrewAI runs a task's own tools
in place of its agent's) holding the raw ``delete_user_account`` deleted the account with no approval, on both the
native and the ReAct path. The gate now checks that the tool CrewAI is about to run is an UndoLog tool (CrewAI hands
the hook a ``CrewStructuredTool`` made from it); a tool listed in ``allow_unwrapped`` still passes by name.

Real crews with the scripted LLM of the CrewAI demo, both databases.
"""

from __future__ import annotations

from typing import Any

import pytest
from crewai import Agent, Crew, Task
from crewai.hooks import clear_all_global_hooks
from crewai.tools import tool

from examples.crewai_support_crew import support
from examples.crewai_support_crew.llm import ScriptedLLM
from undolog_adapters.crewai import wrap_tools

DELETE_U1 = {"tool": "delete_user_account", "args": {"user_id": "u1"}}


@pytest.fixture(autouse=True)
def backend() -> Any:
    support.BACKEND.reset()
    clear_all_global_hooks()
    yield support.BACKEND
    clear_all_global_hooks()


def _raw(ran: list[str]) -> Any:
    @tool("delete_user_account")
    def raw_delete(user_id: str) -> str:
        """Delete a user account."""
        ran.append(user_id)
        return f"deleted {user_id}"

    return raw_delete


@pytest.mark.parametrize("native", [True, False], ids=["native", "react"])
def test_an_unwrapped_task_tool_named_like_a_wrapped_one_is_refused(undolog: Any, backend: Any, native: bool) -> None:
    tools = wrap_tools(support.TOOLS, undolog=undolog, compensations=support.COMPENSATIONS)
    ran: list[str] = []
    llm = ScriptedLLM(model="scripted", steps=[DELETE_U1], native=native)
    agent = Agent(role="a", goal="g", backstory="b", llm=llm, tools=tools, max_iter=4)
    task = Task(description="d", expected_output="e", agent=agent, tools=[_raw(ran)])
    run = tools.kickoff(Crew(agents=[agent], tasks=[task]))
    assert ran == [], "the raw IRREVERSIBLE tool ran with no approval"
    assert "u1" in backend.accounts
    assert "not the UndoLog-wrapped" in llm.observations[0]
    assert run.pending_approvals == []


@pytest.mark.parametrize("native", [True, False], ids=["native", "react"])
def test_the_wrapped_tool_given_as_a_task_tool_is_gated_as_usual(undolog: Any, backend: Any, native: bool) -> None:
    tools = wrap_tools(support.TOOLS, undolog=undolog, compensations=support.COMPENSATIONS)
    llm = ScriptedLLM(model="scripted", steps=[DELETE_U1], native=native)
    agent = Agent(role="a", goal="g", backstory="b", llm=llm, tools=[], max_iter=4)
    task = Task(description="d", expected_output="e", agent=agent, tools=list(tools))
    run = tools.kickoff(Crew(agents=[agent], tasks=[task]))
    assert "awaiting approval" in llm.observations[0] and len(run.pending_approvals) == 1
    assert "u1" in backend.accounts


def test_allow_unwrapped_still_passes_by_name(undolog: Any, backend: Any) -> None:
    ran: list[str] = []
    tools = wrap_tools(support.TOOLS[:2], undolog=undolog, compensations=support.COMPENSATIONS,
                       allow_unwrapped=["delete_user_account"])
    llm = ScriptedLLM(model="scripted", steps=[DELETE_U1], native=True)
    agent = Agent(role="a", goal="g", backstory="b", llm=llm, tools=[*tools, _raw(ran)], max_iter=4)
    tools.kickoff(Crew(agents=[agent], tasks=[Task(description="d", expected_output="e", agent=agent)]))
    assert ran == ["u1"]  # the application said so
