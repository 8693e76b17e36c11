"""CrewAI: a kickoff that continues a session after an approval does not repeat what was done.

A real model given the same ticket again repeats its whole task. Before the continuation, the README's flow (the
deletion waits; approve; a new kickoff on the same session) sent the refund twice: call ids live one kickoff, and
only IRREVERSIBLE calls were matched again. The scripted model here repeats its whole task, as a real one does.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from crewai.hooks import clear_all_global_hooks

from examples.crewai_support_crew import support
from examples.crewai_support_crew.demo import build_crew
from undolog_adapters.crewai import wrap_tools
from undolog_core.storage import schema as t

pytestmark = pytest.mark.reads_store

SEARCH = {"tool": "search_knowledge_base", "args": {"query": "refund policy"}}
REFUND_U1 = {"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 42.5}}
DELETE_U1 = {"tool": "delete_user_account", "args": {"user_id": "u1"}}
DELETE_U2 = {"tool": "delete_user_account", "args": {"user_id": "u2"}}
WHOLE_TASK = [SEARCH, REFUND_U1, DELETE_U1]

PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "react"])


@pytest.fixture(autouse=True)
def backend():
    support.BACKEND.reset()
    clear_all_global_hooks()
    yield support.BACKEND
    clear_all_global_hooks()


def toolset(undolog, **kw):
    return wrap_tools(support.TOOLS, undolog=undolog, compensations=support.COMPENSATIONS, **kw)


def effects(undolog, session_id):
    e = t.effect_log
    with undolog.store.engine.connect() as c:
        return c.execute(sa.select(e.c.tool_name, e.c.state, e.c.kickoff_id, e.c.args_snapshot)
                         .where(e.c.session_id == session_id).order_by(e.c.seq)).all()


def sent(backend):
    return [(m["user_id"], m["status"]) for m in backend.outbox]


@PATHS
def test_approve_then_continue_sends_the_refund_once_and_deletes_once(undolog, backend, native):
    tools = toolset(undolog)
    crew = build_crew(tools, WHOLE_TASK, native=native)
    first = tools.kickoff(crew, inputs={"ticket": "help u1"})
    assert first.awaiting_approval and sent(backend) == [("u1", "sent")]
    undolog.approvals.approve(first.pending_approvals[0].approval_request_id, approver="ana")

    again = build_crew(tools, WHOLE_TASK, native=native)  # the model repeats its whole task
    second = tools.resume(again, inputs={"ticket": "help u1"}, session_id=first.session_id)
    seen = again.agents[0].llm.observations
    assert sent(backend) == [("u1", "sent")]  # before: [("u1", "sent"), ("u1", "sent")]
    assert "u1" not in backend.accounts and not second.awaiting_approval
    assert "msg-1" in seen[1] and "replayed: it did not run again" in seen[1]
    assert "'deleted': 'u1'" in seen[2] and "replayed" not in seen[2]
    rows = effects(undolog, first.session_id)
    assert [(r.tool_name, r.state) for r in rows] == [("send_refund_email", "committed"),
                                                      ("delete_user_account", "committed")]
    assert rows[0].kickoff_id and rows[0].kickoff_id == rows[1].kickoff_id

    # A continuation of a session whose work is done replays everything: nothing runs a second time.
    third_crew = build_crew(tools, WHOLE_TASK, native=native)
    tools.resume(third_crew, inputs={"ticket": "help u1"}, session_id=first.session_id)
    assert sent(backend) == [("u1", "sent")]
    assert "'deleted': 'u1'" in third_crew.agents[0].llm.observations[2]
    assert "replayed" in third_crew.agents[0].llm.observations[2]
    assert len(effects(undolog, first.session_id)) == 2


def test_a_plain_kickoff_on_the_same_session_runs_every_call_as_a_new_task(undolog, backend):
    tools = toolset(undolog, session_id="ticket-long-lived")
    tools.kickoff(build_crew(tools, [REFUND_U1]), inputs={"ticket": "t"})
    tools.kickoff(build_crew(tools, [REFUND_U1]), inputs={"ticket": "t"})
    assert sent(backend) == [("u1", "sent"), ("u1", "sent")]
    kickoffs = [r.kickoff_id for r in effects(undolog, "ticket-long-lived")]
    assert len(kickoffs) == 2 and None not in kickoffs and kickoffs[0] != kickoffs[1]


def test_the_nth_repeat_takes_the_nth_effect_and_a_further_one_runs(undolog, backend):
    tools = toolset(undolog)
    first = tools.kickoff(build_crew(tools, [REFUND_U1, REFUND_U1, DELETE_U1]), inputs={"ticket": "t"})
    assert sent(backend) == [("u1", "sent"), ("u1", "sent")]
    undolog.approvals.reject(first.pending_approvals[0].approval_request_id, approver="ana", reason="keep it")
    # (a reject halts the session: a third refund is refused, the two recorded ones are replayed)
    crew = build_crew(tools, [REFUND_U1, REFUND_U1, REFUND_U1])
    tools.resume(crew, inputs={"ticket": "t"}, session_id=first.session_id)
    seen = crew.agents[0].llm.observations
    assert "msg-1" in seen[0] and "replayed" in seen[0]
    assert "msg-2" in seen[1] and "replayed" in seen[1]
    assert "halted" in seen[2] and "replayed" not in seen[2]
    assert sent(backend) == [("u1", "sent"), ("u1", "sent")]


def test_a_call_that_matches_nothing_runs_and_the_next_continuation_replays_it(undolog, backend):
    tools = toolset(undolog)
    first = tools.kickoff(build_crew(tools, [REFUND_U1, DELETE_U1]), inputs={"ticket": "t"})
    undolog.approvals.approve(first.pending_approvals[0].approval_request_id, approver="ana")
    # The continuation repeats the task and then asks for one more deletion, which waits.
    second = tools.resume(build_crew(tools, [REFUND_U1, DELETE_U1, DELETE_U2]), inputs={"ticket": "t"},
                          session_id=first.session_id)
    assert sorted(backend.accounts) == ["u2"] and second.awaiting_approval
    undolog.approvals.approve(second.pending_approvals[0].approval_request_id, approver="ana")
    crew = build_crew(tools, [REFUND_U1, DELETE_U1, DELETE_U2])
    tools.resume(crew, inputs={"ticket": "t"}, session_id=first.session_id)
    seen = crew.agents[0].llm.observations
    assert sorted(backend.accounts) == [] and sent(backend) == [("u1", "sent")]
    assert ["replayed" in s for s in seen] == [True, True, False]
    kickoffs = {r.kickoff_id for r in effects(undolog, first.session_id)}
    assert len(kickoffs) == 1  # the continuations log under the run they continue


def test_a_call_with_other_arguments_is_another_call_and_runs(undolog, backend):
    tools = toolset(undolog)
    first = tools.kickoff(build_crew(tools, [REFUND_U1, DELETE_U1]), inputs={"ticket": "t"})
    undolog.approvals.approve(first.pending_approvals[0].approval_request_id, approver="ana")
    other = {"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 10.0}}
    crew = build_crew(tools, [other, DELETE_U1])
    tools.resume(crew, inputs={"ticket": "t"}, session_id=first.session_id)
    assert sent(backend) == [("u1", "sent"), ("u1", "sent")] and "u1" not in backend.accounts
    assert not any("replayed" in s for s in crew.agents[0].llm.observations)


def test_resume_without_a_session_says_which_to_pass(undolog):
    tools = toolset(undolog)
    with pytest.raises(ValueError, match="pass session_id="):
        tools.resume(build_crew(tools, [REFUND_U1]))


@pytest.mark.parametrize("reject", [False, True], ids=["approve", "reject"])
def test_the_demo_continues_with_a_model_that_repeats_its_whole_task(undolog, backend, capsys, reject):
    from examples.crewai_support_crew.demo import FIRST_TURN, SECOND_TURN, main

    assert SECOND_TURN == FIRST_TURN  # the scripted model starts over, as a real one does
    assert main(reject=reject, undolog=undolog) == 0
    out = capsys.readouterr().out
    assert "[kickoff 2: a continuation]" in out
    assert "send_refund_email({'user_id': 'u1', 'amount': 42.5}): replayed, not run again" in out
    assert len(backend.outbox) == 1  # one refund email, whatever the ending
