"""Logs and traces: the ``undolog.*`` log records (caplog) and OpenTelemetry spans and metrics (the SDK's in-memory
exporter and reader), on a real store; and the core without OpenTelemetry installed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from undolog_core import ApprovalPending, _observe
from undolog_core.storage import schema as t
from undolog_core.testing import internals

from ..support.otel import in_memory_otel
from ..support.toolkit import setup

ROOT = Path(__file__).resolve().parents[2]


def _records(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


def _dead_owner() -> str:
    from undolog_core.storage.base import Owner

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return f"{Owner.me().split('|')[0]}|{p.pid}|1"


# ---------------------------------------------------------------------------------------------------- logging


def test_no_info_record_per_safe_or_compensable_call(undolog: Any, caplog: pytest.LogCaptureFixture) -> None:
    world, tools = setup(undolog)
    caplog.set_level(logging.INFO, logger="undolog")
    with undolog.session(session_id="quiet") as s:
        for i in range(5):
            s.call_sync(tools["search_knowledge_base"], query=f"q{i}")
            s.call_sync(tools["send_refund_email"], user_id="u1", amount=i)
    assert [r for r in caplog.records if r.name.startswith("undolog")] == []


def test_a_pause_a_decision_a_rollback_and_a_halt_are_logged_with_their_ids(
        undolog: Any, caplog: pytest.LogCaptureFixture) -> None:
    world, tools = setup(undolog)
    caplog.set_level(logging.INFO, logger="undolog")
    with undolog.session(session_id="s-log") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
        with pytest.raises(ApprovalPending) as paused:
            s.call_sync(tools["delete_user_account"], user_id="u1", call_id="c-del")
    rid, eid = paused.value.approval_request_id, paused.value.effect_id

    [pause] = _records(caplog, "undolog.engine")
    assert pause.levelno == logging.INFO and pause.getMessage().startswith("pause: delete_user_account")
    assert (pause.undolog_session_id, pause.undolog_effect_id, pause.undolog_approval_request_id) == (  # type: ignore[attr-defined]
        "s-log", eid, rid)
    assert rid in pause.getMessage() and "s-log" in pause.getMessage()

    caplog.clear()
    undolog.approvals.modify(rid, approver="ana", args={"user_id": "u2"})
    [decision] = _records(caplog, "undolog.approvals")
    assert decision.levelno == logging.INFO
    assert decision.getMessage().startswith(f"decision: modify on approval request {rid} for delete_user_account by ana")
    assert decision.undolog_effect_id == eid  # type: ignore[attr-defined]

    caplog.clear()
    report = undolog.saga.rollback_sync("s-log", reason="ticket closed", actor="ana")
    assert report.complete
    saga = _records(caplog, "undolog.saga")
    messages = [r.getMessage() for r in saga]
    assert messages[0].startswith("rollback: session s-log, 1 compensation(s) to run") and "ticket closed" in messages[0]
    assert messages[1].startswith("compensated: cancel_refund_email undid send_refund_email (session s-log")
    assert messages[2].startswith("rollback: session s-log rolled back")
    assert all(r.levelno == logging.INFO and r.undolog_session_id == "s-log" for r in saga)  # type: ignore[attr-defined]


def test_a_rejection_logs_the_decision_and_the_halt(undolog: Any, caplog: pytest.LogCaptureFixture) -> None:
    world, tools = setup(undolog)
    with undolog.session(session_id="s-rej") as s, pytest.raises(ApprovalPending) as paused:
        s.call_sync(tools["wire_transfer"], to="x", cents=5)
    caplog.set_level(logging.INFO, logger="undolog")
    undolog.approvals.reject(paused.value.approval_request_id, approver="bo", reason="not this week")
    [decision, halt] = _records(caplog, "undolog.approvals")
    assert decision.levelno == logging.WARNING and "decision: reject" in decision.getMessage()
    assert "not this week" in decision.getMessage()
    assert halt.levelno == logging.WARNING and halt.getMessage().startswith("halt: session s-rej halted")


def test_a_timeout_is_logged(undolog: Any, caplog: pytest.LogCaptureFixture) -> None:
    world, tools = setup(undolog)
    undolog.policy.set(actor="admin", approval_timeout_seconds=1)
    with undolog.session(session_id="s-to") as s, pytest.raises(ApprovalPending) as paused:
        s.call_sync(tools["wire_transfer"], to="x", cents=5)
    caplog.set_level(logging.INFO, logger="undolog")
    import datetime as dt

    undolog.approvals.expire_due(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5))
    [decision, halt] = _records(caplog, "undolog.approvals")
    assert decision.getMessage().startswith(f"decision: timeout on approval request {paused.value.approval_request_id}")
    assert halt.getMessage().startswith("halt: session s-to halted")


def test_a_failing_compensation_logs_each_attempt_the_failure_and_the_halt(
        undolog: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    world, tools = setup(undolog)
    monkeypatch.setattr(type(undolog.saga), "backoff_seconds", 0.0)
    with undolog.session(session_id="s-cf") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    world.fail_cancel = 99
    caplog.set_level(logging.INFO, logger="undolog")
    report = undolog.rollback("s-cf")
    assert not report.complete
    levels = [(r.levelname, r.getMessage().split(":")[0]) for r in _records(caplog, "undolog.saga")]
    assert levels == [("INFO", "rollback"), ("WARNING", "compensation attempt 1 of cancel_refund_email for "
                                                         "send_refund_email failed (session s-cf, effect "
                                                         f"{report.steps[0].effect_id})"),
                      ("WARNING", levels[2][1]), ("WARNING", levels[3][1]),
                      ("ERROR", "compensation failed"), ("WARNING", "halt")]


def test_a_recovery_action_is_logged(undolog: Any, caplog: pytest.LogCaptureFixture) -> None:
    world, tools = setup(undolog)
    undolog.session(session_id="s-rec")
    d = undolog.engine.intercept("s-rec", "send_refund_email", {"user_id": "u1", "amount": 3}, call_id="c")
    undolog.engine._inflight.discard(d.effect_id)
    with internals(undolog).write() as c:  # its process died mid-call
        c.execute(t.effect_log.update().where(t.effect_log.c.effect_id == d.effect_id).values(owner=_dead_owner()))
    caplog.set_level(logging.INFO, logger="undolog")
    report = undolog.recover()
    assert report.reconciled[0]["outcome"] == "compensated"
    rec = [r.getMessage() for r in _records(caplog, "undolog.recovery")]
    assert any(m.startswith("recovery: send_refund_email (session s-rec, effect "
                            f"{d.effect_id}) in flight after a crash: compensated") for m in rec), rec
    assert any(m.startswith("halt: session s-rec halted") for m in rec)
    assert rec[-1].startswith("recovery: 1 reconciled")


# ---------------------------------------------------------------------------------------------- OpenTelemetry


@pytest.fixture
def otel(monkeypatch: pytest.MonkeyPatch) -> Any:
    with in_memory_otel(monkeypatch) as exported:
        yield exported


def _metrics(reader: Any) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            if sm.scope.name != "undolog":
                continue
            for m in sm.metrics:
                out[m.name] = [(dict(p.attributes), getattr(p, "value", None) if hasattr(p, "value") else p.count)
                               for p in m.data.data_points]
    return out


def test_spans_and_metrics_of_gated_calls_rollback_and_recovery(undolog: Any, otel: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    exporter, reader = otel
    world, tools = setup(undolog)
    monkeypatch.setattr(type(undolog.saga), "backoff_seconds", 0.0)
    with undolog.session(session_id="s-ot") as s:
        s.call_sync(tools["search_knowledge_base"], query="q")
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5, call_id="c-refund")
        with pytest.raises(ApprovalPending) as paused:
            s.call_sync(tools["delete_user_account"], user_id="u1", call_id="c-del")
        rid = paused.value.approval_request_id
        undolog.approvals.approve(rid, approver="ana")
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="c-del")
    undolog.rollback("s-ot")
    undolog.recover()

    spans = exporter.get_finished_spans()
    names = [sp.name for sp in spans]
    # No span for the SAFE call; one per gated attempt (the gate that paused, the gate that let it through, the run).
    assert "execute_tool search_knowledge_base" not in names
    refund = next(sp for sp in spans if sp.name == "execute_tool send_refund_email")
    assert {k: refund.attributes[k] for k in ("gen_ai.operation.name", "gen_ai.tool.name", "gen_ai.tool.call.id",
                                               "undolog.tier", "undolog.session_id")} == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "send_refund_email",
        "gen_ai.tool.call.id": "c-refund", "undolog.tier": "compensable", "undolog.session_id": "s-ot"}
    assert refund.attributes["undolog.effect_id"]
    deletes = [sp for sp in spans if sp.name == "execute_tool delete_user_account"]
    # One span per attempt: the one that paused, then the one that ran (carrying the request and the decision).
    assert [sp.attributes["undolog.decision"] for sp in deletes] == ["awaiting_approval", "approve"]
    assert all(sp.attributes["undolog.approval_request_id"] == rid for sp in deletes)
    assert all(sp.attributes["gen_ai.tool.call.id"] == "c-del" for sp in deletes)
    assert deletes[0].attributes["undolog.effect_id"] == deletes[1].attributes["undolog.effect_id"]

    rollback = next(sp for sp in spans if sp.name == "undolog.rollback")
    assert rollback.attributes["undolog.outcome"] == "complete"
    comp = next(sp for sp in spans if sp.name == "undolog.compensate cancel_refund_email")
    assert comp.parent.span_id == rollback.context.span_id
    assert comp.attributes["undolog.compensation"] == "cancel_refund_email"
    assert comp.attributes["undolog.outcome"] == "compensated"
    assert any(sp.name == "undolog.recover" for sp in spans)

    m = _metrics(reader)
    calls = {(a["undolog.tier"], a["gen_ai.tool.name"]): v for a, v in m["undolog.tool.calls"]}
    assert calls == {("compensable", "send_refund_email"): 1, ("irreversible", "delete_user_account"): 1}
    assert [(a["undolog.decision"], v) for a, v in m["undolog.approvals"]] == [("approve", 1)]
    assert [v for _, v in m["undolog.approval.wait"]] == [1]  # one wait recorded in the histogram
    assert [(a["undolog.outcome"], v) for a, v in m["undolog.rollbacks"]] == [("complete", 1)]

    # A compensation that keeps failing: an error span, a halted rollback, a compensation failure counted.
    exporter.clear()
    with undolog.session(session_id="s-ot2") as s:
        s.call_sync(tools["send_refund_email"], user_id="u2", amount=5)
    world.fail_cancel = 99
    assert not undolog.rollback("s-ot2").complete
    comp = next(sp for sp in exporter.get_finished_spans() if sp.name.startswith("undolog.compensate"))
    assert comp.status.status_code.name == "ERROR" and comp.attributes["error.type"] == "compensation_failed"
    m = _metrics(reader)
    assert [(a["undolog.compensation"], v) for a, v in m["undolog.compensation.failures"]] == [
        ("cancel_refund_email", 1)]
    assert sorted((a["undolog.outcome"], v) for a, v in m["undolog.rollbacks"]) == [("complete", 1), ("halted", 1)]


def test_a_failing_tool_marks_its_span_and_a_rejection_its_gate(undolog: Any, otel: Any) -> None:
    exporter, _ = otel
    world, tools = setup(undolog)
    world.fail_send = 1
    with undolog.session(session_id="s-f") as s:
        with pytest.raises(RuntimeError, match="smtp exploded"):
            s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    span = next(sp for sp in exporter.get_finished_spans() if sp.name == "execute_tool send_refund_email")
    assert span.status.status_code.name == "ERROR" and span.attributes["error.type"] == "RuntimeError"
    assert span.attributes["undolog.rollback"] == "rolled_back"

    with undolog.session(session_id="s-r") as s:
        with pytest.raises(ApprovalPending) as paused:
            s.call_sync(tools["wire_transfer"], to="x", cents=1, call_id="w")
        undolog.approvals.reject(paused.value.approval_request_id, approver="ana", reason="no")
        exporter.clear()
        with pytest.raises(Exception, match="rejected"):
            s.call_sync(tools["wire_transfer"], to="x", cents=1, call_id="w")
    [gate] = exporter.get_finished_spans()
    assert gate.attributes["undolog.decision"] == "rejected" and gate.attributes["error.type"] == "approval_rejected"


async def test_spans_on_the_async_path(undolog: Any, otel: Any) -> None:
    exporter, _ = otel
    world, tools = setup(undolog)
    async with undolog.session(session_id="s-a") as s:
        await s.call(tools["lock_account"], user_id="u1", call_id="lk")
        with pytest.raises(ApprovalPending):
            await s.call(tools["delete_user_account"], user_id="u1", call_id="d")
    await undolog.saga.rollback("s-a")
    names = [sp.name for sp in exporter.get_finished_spans()]
    assert names[:2] == ["execute_tool lock_account", "execute_tool delete_user_account"]
    assert "undolog.compensate unlock_account" in names and "undolog.rollback" in names


def test_no_sdk_means_no_span_object(undolog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the API installed but no SDK configured, the gated paths make no span at all (not even a no-op one).
    assert not _observe.tracing() and not _observe.metering()
    import opentelemetry.trace as trace_api

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("a tracer was asked for without an SDK")

    monkeypatch.setattr(trace_api, "get_tracer", boom)
    world, tools = setup(undolog)
    with undolog.session(session_id="s-n") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
        with pytest.raises(ApprovalPending):
            s.call_sync(tools["delete_user_account"], user_id="u1")
    undolog.rollback("s-n")


def test_the_core_imports_and_runs_without_opentelemetry(db: Any, tmp_path: Path) -> None:
    # None in sys.modules makes `import opentelemetry...` fail, as if it were not installed.
    code = (
        "import sys\nfor n in ['opentelemetry', 'opentelemetry.trace', 'opentelemetry.metrics']: sys.modules[n] = None\n"
        "from undolog_core import UndoLog, undolog_tool, compensation, ToolTier, CompensationDescriptor, _observe\n"
        "assert _observe._trace is None and not _observe.tracing() and _observe.instruments() is None\n"
        f"u = UndoLog.open({str('sqlite:///' + str(tmp_path / 'x.db'))!r})\n"
        "@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new('undo_x'))\n"
        "def x(n: int) -> int:\n    return n\n"
        "@compensation('undo_x')\ndef undo_x(ctx):\n    pass\n"
        "u.register(x, undo_x)\n"
        "with u.session(session_id='s') as s:\n    s.call_sync(x, n=1)\n"
        "print(u.rollback('s').complete)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"

