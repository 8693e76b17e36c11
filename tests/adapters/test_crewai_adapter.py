"""CrewAI adapter: real crews (native function calling and text ReAct) with a scripted LLM."""

from __future__ import annotations

import datetime as dt
import importlib
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from crewai import Agent, Crew, Task
from crewai.hooks import InterceptionPoint, clear_all_global_hooks
from crewai.tools import tool

from examples.crewai_support_crew import support
from examples.crewai_support_crew.demo import build_crew
from examples.crewai_support_crew.llm import ScriptedLLM
from undolog_adapters.crewai import UndoLogTool, wrap_tools
from undolog_core import errors
from undolog_core.testing import internals

ROOT = Path(__file__).resolve().parents[2]
LATER = dt.datetime.now(dt.UTC) + dt.timedelta(days=60)

SEARCH = {"tool": "search_knowledge_base", "args": {"query": "refund policy"}}
REFUND_U1 = {"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 42.5}}
REFUND_U2 = {"tool": "send_refund_email", "args": {"user_id": "u2", "amount": 10.0}}
DELETE_U1 = {"tool": "delete_user_account", "args": {"user_id": "u1"}}

PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "react"])


@pytest.fixture(autouse=True)
def backend():
    support.BACKEND.reset()
    clear_all_global_hooks()
    yield support.BACKEND
    clear_all_global_hooks()


def toolset(undolog, **kw):
    return wrap_tools(support.TOOLS, undolog=undolog, compensations=support.COMPENSATIONS, **kw)


def kickoff(tools, steps, *, native=True, session_id=None):
    crew = build_crew(tools, steps, native=native)
    run = tools.kickoff(crew, inputs={"ticket": "help u1"}, session_id=session_id)
    llm = crew.agents[0].llm
    return run, llm.observations


def test_wrapped_tools_keep_names_descriptions_and_schemas(undolog):
    tools = toolset(undolog)
    plain = [tool(fn.__name__)(fn) for fn in support.TOOLS]
    assert [t.name for t in tools] == [p.name for p in plain]
    assert [t.description for t in tools] == [p.description for p in plain]
    assert [t.args_schema.model_json_schema() for t in tools] == [p.args_schema.model_json_schema() for p in plain]
    assert all(isinstance(t, UndoLogTool) for t in tools)
    assert [t.tier.value for t in tools] == ["safe", "compensable", "irreversible"]


def test_unclassified_tool_is_refused_at_wrap_time_naming_it(undolog):
    @tool("wire_money")
    def wire_money(amount: int) -> str:
        """Wire money."""
        return "wired"

    with pytest.raises(errors.ToolNotClassified, match="wire_money"):
        wrap_tools([wire_money], undolog=undolog)


def test_tiers_mapping_classifies_a_plain_crewai_tool(undolog):
    calls = []

    @tool("lookup_order")
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        calls.append(order_id)
        return f"order {order_id}: shipped"

    tools = wrap_tools([lookup_order], undolog=undolog, tiers={"lookup_order": "safe"})
    run, seen = kickoff(tools, [{"tool": "lookup_order", "args": {"order_id": "o-9"}}])
    assert calls == ["o-9"] and seen == ["order o-9: shipped"]
    assert undolog.tool_spec("lookup_order").tier.value == "safe"


@PATHS
def test_safe_and_compensable_calls_run_once_and_are_undoable(undolog, backend, native):
    tools = toolset(undolog)
    run, seen = kickoff(tools, [SEARCH, REFUND_U1], native=native)
    assert "Refunds are confirmed by email" in seen[0]
    assert "msg-1" in seen[1]
    assert [m["status"] for m in backend.outbox] == ["sent"]
    assert run.session_id == tools.session_id
    report = undolog.rollback(run.session_id)
    assert [s.tool_name for s in report.steps] == ["send_refund_email"]
    assert [m["status"] for m in backend.outbox] == ["cancelled"]


def test_each_plain_kickoff_is_its_own_session_unless_overridden(undolog):
    tools = toolset(undolog)
    ids = []
    for _ in range(2):
        build_crew(tools, [REFUND_U1]).kickoff(inputs={"ticket": "t"})
        ids.append(tools.last_session_id)
    assert ids[0] and ids[1] and ids[0] != ids[1]
    for sid in ids:
        assert undolog.sessions.get(sid).state == "active"

    fixed = toolset(undolog, session_id="ticket-7")
    run, _ = kickoff(fixed, [SEARCH])
    assert run.session_id == "ticket-7"
    run, _ = kickoff(tools, [SEARCH], session_id="ticket-8")
    assert run.session_id == "ticket-8"


@PATHS
def test_irreversible_awaits_then_a_later_kickoff_runs_the_approved_call_once(undolog, backend, native):
    tools = toolset(undolog)
    first, seen = kickoff(tools, [REFUND_U1, DELETE_U1], native=native)
    assert "u1" in backend.accounts
    assert first.awaiting_approval and len(first.pending_approvals) == 1
    request = first.pending_approvals[0]
    assert f"awaiting approval, request {request.approval_request_id}" in seen[1]
    assert request.tool_name == "delete_user_account" and request.proposed_args == {"user_id": "u1"}

    # The agent asks again before anyone decided: the same request, not a second one.
    again, seen = kickoff(tools, [DELETE_U1], native=native, session_id=first.session_id)
    assert [r.approval_request_id for r in again.pending_approvals] == [request.approval_request_id]

    undolog.approvals.approve(request.approval_request_id, approver="ana")
    second, seen = kickoff(tools, [DELETE_U1], native=native, session_id=first.session_id)
    assert "u1" not in backend.accounts
    assert "'deleted': 'u1'" in seen[0] and not second.awaiting_approval

    # Exactly once: asking a third time replays the stored result instead of deleting again.
    third, seen = kickoff(tools, [DELETE_U1], native=native, session_id=first.session_id)
    assert "'deleted': 'u1'" in seen[0]
    assert [m["status"] for m in backend.outbox] == ["sent"]


@PATHS
def test_modified_approval_runs_the_approvers_arguments(undolog, backend, native):
    tools = toolset(undolog)
    first, _ = kickoff(tools, [DELETE_U1], native=native)
    request = first.pending_approvals[0]
    undolog.approvals.modify(request.approval_request_id, approver="ana", args={"user_id": "u2"},
                             reason="u1 is the wrong account")
    _, seen = kickoff(tools, [DELETE_U1], native=native, session_id=first.session_id)
    assert sorted(backend.accounts) == ["u1"]
    assert "'deleted': 'u2'" in seen[0]


@PATHS
def test_rejected_approval_tells_the_agent_why_and_nothing_runs(undolog, backend, native):
    tools = toolset(undolog)
    first, _ = kickoff(tools, [DELETE_U1], native=native)
    request = first.pending_approvals[0]
    undolog.approvals.reject(request.approval_request_id, approver="ana", reason="customer keeps the data")
    second, seen = kickoff(tools, [DELETE_U1], native=native, session_id=first.session_id)
    assert "u1" in backend.accounts
    assert "rejected by ana: customer keeps the data" in seen[0]
    assert "did NOT run" in seen[0]
    assert second.output.tool_failures and second.output.tool_failures[0].failure.code == "approval_rejected"


def test_timed_out_approval_tells_the_agent(undolog, backend):
    tools = toolset(undolog)
    first, _ = kickoff(tools, [DELETE_U1])
    request = first.pending_approvals[0]
    # As if the timeout had passed: no sleeping in tests.
    undolog.approvals.expire([request.approval_request_id], now=LATER)
    _, seen = kickoff(tools, [DELETE_U1], session_id=first.session_id)
    assert "u1" in backend.accounts
    assert "timed out" in seen[0]


def test_waiting_kickoff_sees_the_approval_time_out(undolog, backend):
    undolog.policy.set(actor="test", approval_timeout_seconds=1)
    # The wait's own limit is far beyond the 1 s timeout: a run back before it was ended by the timeout, not by the
    # limit (before: a 10 s limit and "back within 8 s", which a loaded machine's slow kickoff could miss).
    tools = toolset(undolog, wait_for_approval=60, poll_interval=0.05)
    started = time.monotonic()
    run, seen = kickoff(tools, [DELETE_U1])
    assert 1 <= time.monotonic() - started < 60
    assert "timed out" in seen[0] and "u1" in backend.accounts
    assert undolog.sessions.get(run.session_id).state == "halted"


def test_waiting_kickoff_runs_once_another_thread_approves(db, undolog, backend):
    # Generous bounds (the approver looks for 60 s, the run waits 90 s; 15 s and 20 s before): on a loaded machine
    # the kickoff can take a while to reach the call, and both end as soon as the decision is made.
    tools = toolset(undolog, wait_for_approval=90, poll_interval=0.05)
    decided = []

    def approver():
        other = db.open()  # its own UndoLog, as an approval API or CLI would have
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pending = other.approvals.pending()
                if pending:
                    other.approvals.modify(pending[0].approval_request_id, approver="ana",
                                           args={"user_id": "u2"})
                    decided.append(pending[0].approval_request_id)
                    return
                time.sleep(0.05)
        finally:
            other.close()

    thread = threading.Thread(target=approver)
    thread.start()
    run, seen = kickoff(tools, [DELETE_U1])
    thread.join()
    assert decided and sorted(backend.accounts) == ["u1"]
    assert "'deleted': 'u2'" in seen[0]
    assert not run.awaiting_approval


@PATHS
def test_waiting_kickoff_sees_a_rejection_made_by_another_process(db, undolog, backend, native):
    script = textwrap.dedent(
        """
        import time
        from undolog_core import UndoLog
        ul = UndoLog.open()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pending = ul.approvals.pending()
            if pending:
                ul.approvals.reject(pending[0].approval_request_id, approver="cli", reason="not today")
                break
            time.sleep(0.05)
        ul.close()
        """
    )
    env = {**__import__("os").environ, **db.env}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT)
    try:
        tools = toolset(undolog, wait_for_approval=60, poll_interval=0.05)
        run, seen = kickoff(tools, [DELETE_U1], native=native)
    finally:
        assert proc.wait(timeout=60) == 0
    assert "u1" in backend.accounts
    assert "rejected by cli: not today" in seen[0]


def test_wait_that_runs_out_reports_awaiting_approval(undolog, backend):
    tools = toolset(undolog, wait_for_approval=0.4, poll_interval=0.05)
    started = time.monotonic()
    run, seen = kickoff(tools, [DELETE_U1])
    assert time.monotonic() - started >= 0.4
    assert "awaiting approval, request" in seen[0] and run.awaiting_approval
    assert "u1" in backend.accounts


@PATHS
def test_compensable_failure_rolls_back_the_session(undolog, backend, native):
    backend.mail_down_for.add("u2")
    tools = toolset(undolog)
    run, seen = kickoff(tools, [REFUND_U1, REFUND_U2], native=native)
    assert [m["status"] for m in backend.outbox] == ["cancelled"]
    assert "mail server refused" in seen[1] and "rolled back" in seen[1]
    assert undolog.sessions.get(run.session_id).state == "rolled_back"
    assert run.output.tool_failures[-1].failure.code == "tool_failed"


def test_calls_after_a_rollback_are_refused(undolog, backend):
    backend.mail_down_for.add("u2")
    tools = toolset(undolog)
    _, seen = kickoff(tools, [REFUND_U2, REFUND_U1])
    assert "UndoLog refused send_refund_email" in seen[1]
    assert backend.outbox == []


@PATHS
def test_crashing_policy_hook_fails_closed(undolog, backend, native):
    def buggy(ctx):
        raise ValueError("policy engine crashed")

    tools = toolset(undolog, hooks=[buggy])
    _, seen = kickoff(tools, [REFUND_U1], native=native)
    assert backend.outbox == []
    assert "policy hook failed" in seen[0]


def test_policy_hook_can_refuse(undolog, backend):
    tools = toolset(undolog, hooks=[lambda ctx: ctx.tool_input.get("amount", 0) < 10])
    _, seen = kickoff(tools, [REFUND_U1])
    assert backend.outbox == [] and "refused" in seen[0]


@PATHS
def test_unwrapped_tool_is_refused_by_the_gate(undolog, native):
    ran = []

    @tool("wire_money")
    def wire_money(amount: int) -> str:
        """Wire money."""
        ran.append(amount)
        return "wired"

    tools = toolset(undolog)
    llm = ScriptedLLM(model="scripted", steps=[{"tool": "wire_money", "args": {"amount": 5}}], native=native)
    agent = Agent(role="a", goal="g", backstory="b", llm=llm, tools=[*tools, wire_money], max_iter=4)
    crew = Crew(agents=[agent], tasks=[Task(description="d", expected_output="e", agent=agent)])
    tools.kickoff(crew)
    assert ran == []
    assert "no UndoLog tier" in llm.observations[0]


@pytest.fixture
def tool_hook_points(monkeypatch):
    """The tool-call hook points CrewAI dispatches, in order: it emits an event for each one (a pydantic model, an
    entry in its event record, a hop to its handler thread), about as much as UndoLog's whole SAFE call."""
    dispatch = importlib.import_module("crewai.hooks.dispatch")  # the package's ``dispatch`` is its function
    points = []
    emit = dispatch._emit_telemetry

    def counted(point, *args):
        if point in (InterceptionPoint.PRE_TOOL_CALL, InterceptionPoint.POST_TOOL_CALL):
            points.append(point.value)
        return emit(point, *args)

    monkeypatch.setattr(dispatch, "_emit_telemetry", counted)
    return points


@PATHS
def test_a_kickoff_that_refuses_nothing_dispatches_only_the_gate(undolog, backend, native, tool_hook_points):
    """The after-hook only rewrites a refused call's text; it joins the kickoff's hooks when the gate refuses one.
    Failed before: every call dispatched both points."""
    tools = toolset(undolog)
    _, seen = kickoff(tools, [SEARCH, REFUND_U1], native=native)
    assert "msg-1" in seen[1]
    assert tool_hook_points == ["pre_tool_call", "pre_tool_call"]


@PATHS
def test_the_after_hook_joins_the_kickoff_at_its_first_refusal(undolog, native, tool_hook_points):
    @tool("wire_money")
    def wire_money(amount: int) -> str:
        """Wire money."""
        return "wired"

    tools = toolset(undolog)
    steps = [SEARCH, {"tool": "wire_money", "args": {"amount": 5}}, {"tool": "wire_money", "args": {"amount": 6}}]
    llm = ScriptedLLM(model="scripted", steps=steps, native=native)
    agent = Agent(role="a", goal="g", backstory="b", llm=llm, tools=[*tools, wire_money], max_iter=5)
    tools.kickoff(Crew(agents=[agent], tasks=[Task(description="d", expected_output="e", agent=agent)]))
    assert ["no UndoLog tier" in o for o in llm.observations] == [False, True, True]
    assert tool_hook_points == ["pre_tool_call", "pre_tool_call", "post_tool_call", "pre_tool_call", "post_tool_call"]
    del tool_hook_points[:]
    kickoff(tools, [SEARCH], native=native)  # the next kickoff starts without it again
    assert tool_hook_points == ["pre_tool_call"]


def test_gate_hooks_are_scoped_to_the_kickoff(undolog):
    ran = []

    @tool("wire_money")
    def wire_money(amount: int) -> str:
        """Wire money."""
        ran.append(amount)
        return "wired"

    toolset(undolog)  # wrapping alone installs nothing global
    llm = ScriptedLLM(model="scripted", steps=[{"tool": "wire_money", "args": {"amount": 5}}])
    agent = Agent(role="a", goal="g", backstory="b", llm=llm, tools=[wire_money], max_iter=4)
    Crew(agents=[agent], tasks=[Task(description="d", expected_output="e", agent=agent)]).kickoff()
    assert ran == [5]


def test_invalid_arguments_are_refused_naming_the_field(undolog, backend):
    tools = toolset(undolog)
    _, seen = kickoff(tools, [{"tool": "send_refund_email", "args": {"user_id": "u1", "amount": "lots"}}])
    assert backend.outbox == []
    assert "amount" in seen[0]


def test_demo_runs_offline_both_ways(db, capsys):
    from examples.crewai_support_crew.demo import main

    for reject in (False, True):
        ul = db.open()
        try:
            assert main(reject=reject, undolog=ul) == 0
        finally:
            ul.close()
    out = capsys.readouterr().out
    assert "ana approved" in out and "ana rejected" in out



@pytest.fixture
def store_traffic(undolog, monkeypatch):
    """Every connection taken from the hot path's pools ("durable"/"fast") and every statement run through the
    store's SQLAlchemy engines ("sql"), once the test starts recording (``traffic.on()``)."""
    from sqlalchemy import event

    class Traffic(list):
        def on(self):
            self.clear()
            self.recording = True

    seen = Traffic()
    seen.recording = False
    hot, store = undolog.engine.hot, undolog.engine.store
    for pool, name in ((hot.durable, "durable"), (hot.fast, "fast")):
        real = pool.checkout

        def checkout(*, wait=True, real=real, name=name):
            if seen.recording:
                seen.append(name)
            return real(wait=wait)

        monkeypatch.setattr(pool, "checkout", checkout)

    def count(conn, cursor, statement, *args):
        if seen.recording:
            seen.append("sql")

    engines = {store.engine, store.fast}
    for engine in engines:
        event.listen(engine, "before_cursor_execute", count)
    yield seen
    for engine in engines:
        event.remove(engine, "before_cursor_execute", count)


@pytest.mark.storage
@PATHS
def test_a_kickoff_of_safe_calls_reads_its_new_session_once_and_writes_nothing(undolog, native, store_traffic):
    """A session's first kickoff reads it (its state and pins) and writes nothing when its calls are all SAFE; its
    row is written by its first logged call, or with the SAFE calls' count. Failed before: the kickoff's start
    inserted the row with an fsync, several times what UndoLog adds to the calls of a SAFE kickoff."""
    tools = toolset(undolog)
    again = {"tool": "search_knowledge_base", "args": {"query": "refund time"}}
    crew = build_crew(tools, [SEARCH, again], native=native)
    store_traffic.on()
    run = tools.kickoff(crew, session_id="ticket-safe")
    assert len(crew.agents[0].llm.observations) == 2
    assert store_traffic == ["durable"]
    store_traffic.on()
    tools.kickoff(build_crew(tools, [SEARCH], native=native), session_id="ticket-safe")
    assert store_traffic == []
    assert run.pending_approvals == []
    internals(undolog).flush()
    assert undolog.sessions.get("ticket-safe").tool_calls_total == 3


@pytest.mark.storage
@PATHS
def test_a_kickoff_of_safe_calls_in_a_session_it_mints_asks_the_store_nothing(undolog, native, store_traffic):
    """``tools.kickoff(crew)`` mints its session's id: the store cannot have it, so it is not even read. Failed
    before: the kickoff's start read the id and inserted the row with an fsync."""
    tools = toolset(undolog)
    crew = build_crew(tools, [SEARCH], native=native)
    store_traffic.on()
    run = tools.kickoff(crew)
    assert "Refunds are confirmed by email" in crew.agents[0].llm.observations[0]
    assert store_traffic == []
    _, seen = kickoff(tools, [REFUND_U1], native=native, session_id=run.session_id)  # known here: no read either
    assert "msg-1" in seen[0]
    assert "durable" in store_traffic
    internals(undolog).flush()
    row = undolog.sessions.get(run.session_id)
    assert (row.agent_id, row.tool_calls_total) == ("crewai", 2)


@PATHS
def test_a_sessions_first_logged_call_writes_its_row_first(undolog, backend, native):
    """The row of a session first seen in a kickoff of SAFE calls is written by its first COMPENSABLE call, with the
    toolset's agent id and the SAFE calls' count, before the tool runs."""
    tools = toolset(undolog)
    kickoff(tools, [SEARCH], native=native, session_id="ticket-comp")
    _, seen = kickoff(tools, [SEARCH, REFUND_U1], native=native, session_id="ticket-comp")
    assert "msg-1" in seen[1]
    row = undolog.sessions.get("ticket-comp")
    assert (row.state, row.agent_id) == ("active", "crewai")
    assert [s.tool_name for s in undolog.rollback("ticket-comp").steps] == ["send_refund_email"]
    internals(undolog).flush()
    assert undolog.sessions.get("ticket-comp").tool_calls_total == 3


@PATHS
def test_a_tool_added_to_the_toolset_later_is_gated_by_its_tier(undolog, backend, native):
    """The gate's names are built once, not per call: a wrapped tool appended afterwards still passes (it failed while
    the names were frozen at wrap time), and a plain CrewAI tool put into the list is refused (before the names were
    built once, any name in the list passed, so that tool ran without a tier)."""
    looked_up, wired = [], []

    @tool("lookup_order")
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        looked_up.append(order_id)
        return f"order {order_id}: shipped"

    @tool("wire_money")
    def wire_money(amount: int) -> str:
        """Wire money."""
        wired.append(amount)
        return "wired"

    tools = toolset(undolog)
    tools.append(wrap_tools([lookup_order], undolog=undolog, tiers={"lookup_order": "safe"})[0])
    tools += [wire_money]
    _, seen = kickoff(tools, [{"tool": "lookup_order", "args": {"order_id": "o-9"}},
                              {"tool": "wire_money", "args": {"amount": 5}}], native=native)
    assert looked_up == ["o-9"] and seen[0].startswith("order o-9: shipped")
    assert wired == [] and "no UndoLog tier" in seen[1]
    del tools[-1]
    assert "wire_money" not in tools._gated and "lookup_order" in tools._gated
