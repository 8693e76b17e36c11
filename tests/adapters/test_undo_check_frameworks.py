"""check_undo on the support examples through each framework: a real LangGraph agent (create_agent with the
middleware), a real CrewAI crew with wrapped tools and a real Semantic Kernel with the filter, all driven by
scripted models; and one deliberately broken compensation caught through a framework."""

from __future__ import annotations

import pytest

from undolog_core.testing import check_undo


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    from undolog_core._saga import Saga

    monkeypatch.setattr(Saga, "backoff_seconds", 0.001)


@pytest.fixture
def support_world(tmp_path, monkeypatch):
    from examples.support_agent import undo_check as uc

    monkeypatch.setenv("SUPPORT_WORLD", str(tmp_path / "world.sqlite"))
    uc.world.cache_clear()
    yield uc
    uc.world.cache_clear()


def test_langgraph_support_agent_refund_emails(undolog, support_world):
    uc = support_world
    report = check_undo(uc.refunds, snapshot=uc.snapshot, reset=uc.reset, undolog=undolog)
    assert report.ok, report.explain()
    # B-7 and B-8 were queued, B-9 was refused by the outbox (its compensation checks it sent nothing).
    assert [(s.tool, s.compensation) for s in report.steps] == [("send_refund_email", "cancel_refund_email")] * 3
    assert all(s.restored and s.idempotent and s.tolerates_never_happened for s in report.steps)
    assert report.scenario_error is None
    # The recall really happened each time (a trace on purpose, left out of the snapshot).
    assert uc.world().operations("recall") == []  # reset at the end
    assert uc.snapshot() == {"accounts": {"u-1042": "active", "u-2002": "active", "u-3003": "active"}, "emails": {}}


def test_langgraph_agent_stops_before_the_irreversible_deletion(undolog, support_world):
    uc = support_world
    report = check_undo(uc.refund_then_delete, snapshot=uc.snapshot, reset=uc.reset, undolog=undolog)
    assert report.ok, report.explain()
    assert [s.tool for s in report.steps] == ["send_refund_email"]
    assert "delete_user_account" in (report.stopped_before or "")
    assert undolog.approvals.pending() == []


def test_a_broken_recall_is_caught_through_the_langgraph_agent(undolog, support_world, monkeypatch):
    """The deliberately broken compensation: it 'recalls' by looking the email up only by its result, so a call
    that crashed before the tool ran (no result) makes it raise, and recovery cannot compensate it."""
    uc = support_world
    from examples.support_agent import tools as support_tools

    real = support_tools.make_tools

    def broken_make_tools(world):
        tools = real(world)
        from undolog_core import compensation

        @compensation("cancel_refund_email")
        def cancel_refund_email(ctx):
            world.recall(ctx.result["message_id"])  # BUG: no result when the send never happened

        return type(tools)(tools.search_knowledge_base, tools.send_refund_email, cancel_refund_email,
                           tools.delete_user_account)

    monkeypatch.setattr(support_tools, "make_tools", broken_make_tools)
    report = check_undo(uc.refund_then_delete, snapshot=uc.snapshot, reset=uc.reset, undolog=undolog)
    (step,) = report.steps
    assert step.restored and step.idempotent
    assert step.tolerates_never_happened is False and not report.ok
    assert "TypeError" in " ".join(step.errors)


@pytest.fixture
def shared_backends():
    """The CrewAI and SK examples' back ends are module globals: their outbox clock is put back after a test."""
    from examples.crewai_support_crew.support import BACKEND as crew
    from examples.semantic_kernel_support.support import BACKEND as sk

    held = [(b, b.delivery_delay, b.clock) for b in (crew, sk)]
    yield
    for b, delay, clock in held:
        b.delivery_delay, b.clock = delay, clock
        b.reset()


def test_crewai_support_crew_refund_emails(undolog, shared_backends):
    from examples.crewai_support_crew import undo_check as uc

    report = check_undo(uc.refunds, snapshot=uc.snapshot, reset=uc.reset, undolog=undolog)
    assert report.ok, report.explain()
    assert uc.BACKEND.delivery_delay == 5.0  # the outbox holds mail, on a frozen clock
    assert [s.tool for s in report.steps] == ["send_refund_email", "send_refund_email"]
    assert "delete_user_account" in (report.stopped_before or "")
    assert all(s.restored and s.idempotent and s.tolerates_never_happened for s in report.steps)
    assert report.scenario_error is None


def test_semantic_kernel_support_refund_emails(undolog, shared_backends):
    from examples.semantic_kernel_support import undo_check as uc

    report = check_undo(uc.refunds, snapshot=uc.snapshot, reset=uc.reset, undolog=undolog)
    assert report.ok, report.explain()
    assert [s.tool for s in report.steps] == ["support-send_refund_email", "support-send_refund_email"]
    assert "support-delete_user_account" in (report.stopped_before or "")
    assert all(s.restored and s.idempotent and s.tolerates_never_happened for s in report.steps)
    assert report.scenario_error is None


def test_the_readme_crewai_release_callback(undolog):
    """The CrewAI section's `book_callback` / `release_callback` (a plain function as the compensation of a
    third-party tool, given in `tiers=`), run from docs/how-to/crewai.md through a real crew. The tool keeps no state, so
    the world is empty: what this proves is that the compensation runs after the call, runs again under the same
    key, and copes with a call that never happened (it reads only `ctx.args`), without raising."""
    import re
    from pathlib import Path

    from undolog_adapters.crewai import wrap_tools

    section = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "crewai.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", section, re.S) if "def release_callback" in c)
    scope = {"__name__": "readme_crewai", "undolog": undolog, "wrap_tools": wrap_tools}
    exec(compile(code, "docs/how-to/crewai.md", "exec"), scope)  # noqa: S102 - the docs' own example
    more = scope["more"]

    def scenario(ul, run):
        from examples.crewai_support_crew.demo import build_crew

        steps = [{"tool": "book_callback", "args": {"day": "monday"}}]
        return more.kickoff(build_crew(more, steps), inputs={"ticket": "call me back"}, session_id=f"cb-{run.id}")

    report = check_undo(scenario, snapshot=dict, reset=lambda: None, undolog=undolog)
    assert report.ok, report.explain()
    assert [(s.tool, s.compensation) for s in report.steps] == [("book_callback", "release_callback")]


def test_a_clock_that_moves_would_race_the_delivery(undolog, shared_backends):
    """Why the check freezes the outbox's clock: with one that moves past the delay between the send and the
    harness's rollback, the email is delivered first and the recall honestly fails, so the step is reported as
    not restored although the compensation is right."""
    from examples.crewai_support_crew import undo_check as uc
    from examples.support_backend_check import FROZEN_NOW

    ticks = iter(range(10**6))

    def racing_reset():
        uc.reset()
        uc.BACKEND.clock = lambda: FROZEN_NOW + 10.0 * next(ticks)  # every look at the clock: 10 s later

    report = check_undo(uc.refunds, snapshot=uc.snapshot, reset=racing_reset, undolog=undolog, never_happened=False)
    assert not report.ok and report.steps[0].restored is False
    assert "TooLateToRecall" in report.explain()
