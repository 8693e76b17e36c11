"""The support-crew demo: refund, then an account deletion that waits for a person.

Run offline with ``python -m examples.crewai_support_crew`` (``--reject`` for the other ending).
"""

from __future__ import annotations

import os
import tempfile

# CrewAI phones home and prompts on first run unless told not to; this demo runs offline.
for _key, _value in {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "CREWAI_TESTING": "true",
    "CREWAI_DISABLE_VERSION_CHECK": "true",
}.items():
    os.environ.setdefault(_key, _value)

from crewai import Agent, Crew, Task  # noqa: E402

from undolog_adapters.crewai import UndoLogToolset, wrap_tools  # noqa: E402
from undolog_core import UndoLog  # noqa: E402

from .llm import ScriptedLLM  # noqa: E402
from .support import BACKEND, COMPENSATIONS, TOOLS  # noqa: E402

TICKET = "Ada (u1) was double charged 42.50 and wants a refund, then her account deleted."

FIRST_TURN = [
    {"tool": "search_knowledge_base", "args": {"query": "refund policy"}},
    {"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 42.5}},
    {"tool": "delete_user_account", "args": {"user_id": "u1"}},
]
# After the decision the app continues the session (tools.resume) with the same task: a real model given it again
# repeats all of it, so the script does too. The continuation runs the SAFE search again (it reads
# only); the refund already sent is replayed, not sent twice; the approved deletion runs once.
SECOND_TURN = FIRST_TURN


def build_crew(tools: UndoLogToolset, steps: list[dict], *, native: bool = True) -> Crew:
    """One support agent with the wrapped tools, driven by a scripted LLM."""
    llm = ScriptedLLM(model="scripted-support", steps=steps, native=native)
    agent = Agent(role="Support agent", goal="Resolve the customer's ticket", backstory="Careful and polite.",
                  llm=llm, tools=tools, max_iter=8, verbose=False)
    task = Task(description="Ticket: {ticket}", expected_output="What was done for the customer", agent=agent)
    return Crew(agents=[agent], tasks=[task], verbose=False)


def main(reject: bool = False, database_url: str | None = None, undolog: UndoLog | None = None) -> int:
    """Run the demo; returns the process exit code.

    Example:
        >>> from examples.crewai_support_crew.demo import main   # doctest: +SKIP
        >>> main(reject=True)
        0
    """
    BACKEND.reset()
    workdir = tempfile.mkdtemp(prefix="undolog-crewai-demo-")
    # With UNDOLOG_DATABASE_URL (and UNDOLOG_SCHEMA) set, UndoLog.open(None) uses them.
    url = database_url or (None if os.environ.get("UNDOLOG_DATABASE_URL") else f"sqlite:///{workdir}/undolog.db")
    ul = undolog or UndoLog.open(url)
    try:
        tools = wrap_tools(TOOLS, undolog=ul, compensations=COMPENSATIONS, agent_id="support-crew")
        print(f"ticket: {TICKET}")
        first = tools.kickoff(build_crew(tools, FIRST_TURN), inputs={"ticket": TICKET})
        print(f"\n[kickoff 1] session {first.session_id}")
        print(f"  agent: {first.raw}")
        print(f"  outbox: {[(m['message_id'], m['status']) for m in BACKEND.outbox]}")
        if not first.pending_approvals:
            print("expected the account deletion to wait for approval")
            return 1
        request = first.pending_approvals[0]
        print(f"  waiting for a person: request {request.approval_request_id}: {request.tool_name}"
              f"({request.proposed_args}) because {request.reason!r}")

        if reject:
            ul.approvals.reject(request.approval_request_id, approver="ana",
                                reason="the customer asked to keep her data")
            print("\n[approver] ana rejected the deletion")
        else:
            ul.approvals.approve(request.approval_request_id, approver="ana")
            print("\n[approver] ana approved the deletion")

        again = build_crew(tools, SECOND_TURN)
        second = tools.resume(again, inputs={"ticket": TICKET}, session_id=first.session_id)
        print(f"\n[kickoff 2: a continuation] same session {second.session_id}; the agent repeats its whole task")
        for step, seen in zip(SECOND_TURN, again.agents[0].llm.observations, strict=False):
            how = "replayed, not run again" if "replayed" in seen else "ran"
            print(f"  {step['tool']}({step['args']}): {how}")
        print(f"  agent: {second.raw}")
        if reject:
            report = ul.rollback(first.session_id)
            print(f"\n[operator] rolled the ticket back: {[(s.tool_name, s.outcome) for s in report.steps]}")
        print(f"\naccounts left: {sorted(BACKEND.accounts)}")
        print(f"outbox: {[(m['message_id'], m['user_id'], m['status']) for m in BACKEND.outbox]}")
        deleted = "u1" not in BACKEND.accounts
        if deleted == reject:
            print("unexpected end state")
            return 1
        return 0
    finally:
        if undolog is None:
            ul.close()
