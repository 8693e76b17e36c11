"""The ``undolog`` CLI, driven through CliRunner against a real database (SQLite or PostgreSQL).

Each test builds its state with the Python API, runs the command, then checks both what was printed
and what the database holds afterwards: a CLI that prints "approved" but wrote nothing is a bug.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import sys
import textwrap
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from undolog_core import (
    ApprovalPending,
    CompensationDescriptor,
    ToolTier,
    UndoLog,
    compensation,
    undolog_tool,
)
from undolog_core.cli import PROGRESS_MIN_STEPS, app
from undolog_core.errors import ContractChanged
from undolog_core.storage import schema as t
from undolog_core.storage.base import Owner, utcnow
from undolog_core.testing import internals

runner = CliRunner()

# Variables from the developer's shell must not leak into the commands under test.
CLEAN_ENV = {"UNDOLOG_APP": None, "UNDOLOG_ACTOR": None, "UNDOLOG_DATABASE_URL": None, "UNDOLOG_SCHEMA": None,
             "COLUMNS": None}


def run(db: Any, *args: str, env: dict[str, str | None] | None = None, app_spec: str | None = None) -> Any:
    """Invoke ``undolog --db URL [--schema S] [--app A] ARGS`` and return the CliRunner result."""
    base = ["--db", db.url] + (["--schema", db.schema] if db.schema else [])
    if app_spec:
        base += ["--app", app_spec]
    return runner.invoke(app, [*base, *args], env={**CLEAN_ENV, **(env or {})}, catch_exceptions=False)


def assert_error(result: Any, code: str, exit_code: int = 2) -> str:
    """An expected failure: one ``error[code]: ...`` line on stderr, the right exit code, no traceback."""
    assert result.exit_code == exit_code, (result.exit_code, result.output)
    assert result.stderr.startswith(f"error[{code}]: "), result.stderr
    assert "Traceback" not in result.output
    return result.stderr


# -- an app module, as a user would write it, loaded with --app ------------------------------------

APP_SOURCE = '''
"""A test app: tools, compensations and the UndoLog they are registered with."""
from pathlib import Path
from typing import Any

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool

URL = {url!r}
SCHEMA = {schema!r}
LOG = Path({log!r})


@undolog_tool(tier=ToolTier.SAFE)
def search_kb(query: str) -> list[str]:
    return [query]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
def send_refund_email(user_id: str, amount: float) -> dict[str, Any]:
    return {{"sent_to": user_id, "amount": amount}}


@compensation("cancel_refund_email")
def cancel_refund_email(ctx: Any) -> None:
    with LOG.open("a") as fh:
        fh.write(f"cancel_refund_email {{ctx.args['user_id']}} {{ctx.idempotency_key}}\\n")


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("refund_card"))
def charge_card(card: str, amount: float) -> dict[str, Any]:
    return {{"charged": amount}}


@compensation("refund_card")
def refund_card(ctx: Any) -> None:
    raise RuntimeError("payment provider unavailable")


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes every record of the user", risk_tags=["pii"])
def delete_user_account(user_id: str) -> dict[str, Any]:
    return {{"deleted": user_id}}


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Moves money out", risk_tags=["billing"])
def wire_money(to: str, amount: float) -> dict[str, Any]:
    return {{"wired": amount, "to": to}}


TOOLS = [search_kb, send_refund_email, cancel_refund_email, charge_card, refund_card, delete_user_account,
         wire_money]


def make() -> UndoLog:
    undolog = UndoLog.open(URL, schema=SCHEMA)
    undolog.register(*TOOLS, registered_by="test-app")
    return undolog
'''


class App:
    """A generated app module: ``spec`` for --app, ``mod`` for the tools, ``undone()`` for what was compensated."""

    def __init__(self, db: Any, tmp_path: Path) -> None:
        self.name = f"cliapp_{uuid.uuid4().hex[:10]}"
        self.log = tmp_path / f"{self.name}.log"
        (tmp_path / f"{self.name}.py").write_text(
            textwrap.dedent(APP_SOURCE.format(url=db.url, schema=db.schema, log=str(self.log)))
        )
        self.mod = importlib.import_module(self.name)
        self.spec = f"{self.name}:make"
        self.undolog: UndoLog = self.mod.make()
        db.opened.append(self.undolog)

    def undone(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def cliapp(db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    monkeypatch.syspath_prepend(str(tmp_path))
    a = App(db, tmp_path)
    yield a
    sys.modules.pop(a.name, None)


def pending_delete(u: UndoLog, mod: Any, *, user_id: str = "u1", call_id: str = "c-7",
                   session_id: str | None = None) -> tuple[str, str]:
    """Raise one approval request for delete_user_account; returns (session_id, approval_request_id)."""
    with u.session(agent_id="support-bot", session_id=session_id) as s:
        s.call_sync(mod.search_kb, query="refund policy")
        s.call_sync(mod.send_refund_email, user_id=user_id, amount=25.0)
        with pytest.raises(ApprovalPending) as p:
            s.call_sync(mod.delete_user_account, user_id=user_id, call_id=call_id)
    return s.id, p.value.approval_request_id


def row(u: UndoLog, table: sa.Table, **where: Any) -> Any:
    with internals(u).read() as conn:
        q = sa.select(table)
        for k, v in where.items():
            q = q.where(table.c[k] == v)
        return conn.execute(q).one()


def events(u: UndoLog, action: str) -> list[Any]:
    with internals(u).read() as conn:
        return conn.execute(
            sa.select(t.approval_events).where(t.approval_events.c.action == action).order_by(t.approval_events.c.event_id)
        ).all()


# -- the command set and global behaviour -----------------------------------------------------------


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"], env=CLEAN_ENV)
    assert result.exit_code == 0
    for command in ("db", "tools", "sessions", "approvals", "policy", "recover", "audit", "demo", "serve", "keys"):
        assert command in result.output
    for group, subs in {"sessions": ("list", "show", "rollback", "resume", "revalidate"),
                        "approvals": ("list", "show", "approve", "reject", "modify"),
                        "policy": ("show", "set"), "audit": ("verify",), "db": ("upgrade",)}.items():
        out = runner.invoke(app, [group, "--help"], env=CLEAN_ENV).output
        for sub in subs:
            assert sub in out, (group, sub)


@pytest.mark.reads_store
def test_db_upgrade_creates_the_schema_then_is_a_no_op(db: Any) -> None:
    from undolog_core.storage import migrate as _migrate

    first = run(db, "db", "upgrade")
    assert first.exit_code == 0, first.output
    assert "upgraded" in first.stdout and "an empty database" in first.stdout
    second = run(db, "db", "upgrade")
    assert second.exit_code == 0
    assert "already at the latest schema revision" in second.stdout
    u = db.open(migrate=False)
    assert _migrate.current(internals(u).sql_engine) == _migrate.head()
    assert u.policy.get().approval_timeout_seconds == 3600


def test_commands_refuse_a_database_that_was_never_created(db: Any) -> None:
    err = assert_error(run(db, "sessions", "list"), "configuration_error")
    assert "undolog db upgrade" in err
    if db.kind == "sqlite":
        # Looking must not create an empty database file where the user mistyped the path.
        assert not Path(db.url.split("///", 1)[1]).exists()


def test_database_errors_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    result = runner.invoke(app, ["--db", "mysql://nope/x", "sessions", "list"], env=CLEAN_ENV)
    assert_error(result, "configuration_error")
    result = runner.invoke(app, ["--db", f"sqlite:///{tmp_path}/missing-dir/x.db", "db", "upgrade"], env=CLEAN_ENV)
    assert_error(result, "configuration_error")


def test_database_url_and_schema_come_from_the_environment(db: Any, cliapp: App) -> None:
    pending_delete(cliapp.undolog, cliapp.mod)
    result = runner.invoke(app, ["approvals", "list", "--json"], env={**CLEAN_ENV, **db.env})
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 1


# -- tools ------------------------------------------------------------------------------------------


def test_tools_shows_every_revision_with_fingerprints(db: Any) -> None:
    u = db.open()

    def v1() -> Any:
        @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account")
        def close_account(user_id: str) -> None: ...
        return close_account

    def v2() -> Any:
        @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account", risk_tags=["pii"])
        def close_account(user_id: str, notify: bool = True) -> None: ...
        return close_account

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("unsend", version=2))
    def send(to: str) -> None: ...

    @compensation("unsend", version=2)
    def unsend(ctx: Any) -> None: ...

    u.register(v1(), send, unsend, registered_by="ana")
    u.register(v2(), registered_by="bob")

    result = run(db, "tools")
    assert result.exit_code == 0, result.output
    history = u.registry.history()
    for r in history:
        assert r["fingerprint"][:16] in result.stdout
    assert "close_account" in result.stdout and "(old)" in result.stdout
    assert "unsend v2" in result.stdout and "ana" in result.stdout and "bob" in result.stdout

    data = json.loads(run(db, "tools", "--json").stdout)
    assert [(r["tool_name"], r["revision"]) for r in data] == [("close_account", 1), ("close_account", 2), ("send", 1)]
    assert set(data[0]) == {"tool_name", "revision", "tier", "fingerprint", "previous_fingerprint",
                            "compensation_name", "compensation_version", "registered_by", "registered_at", "contract"}
    assert data[1]["previous_fingerprint"] == data[0]["fingerprint"] != data[1]["fingerprint"]
    assert data[1]["registered_by"] == "bob" and data[1]["tier"] == "irreversible"
    assert data[2]["compensation_name"] == "unsend" and data[2]["compensation_version"] == 2

    only = json.loads(run(db, "tools", "--tool", "send", "--json").stdout)
    assert [r["tool_name"] for r in only] == ["send"]
    assert "never been registered" in assert_error(run(db, "tools", "--tool", "nope"), "invalid_input")


def test_tools_on_an_empty_registry(db: Any) -> None:
    db.open()
    result = run(db, "tools")
    assert result.exit_code == 0 and "no tools registered yet" in result.stdout
    assert json.loads(run(db, "tools", "--json").stdout) == []


# -- sessions ---------------------------------------------------------------------------------------


def test_sessions_list_and_filters(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    waiting, _ = pending_delete(u, cliapp.mod)
    with u.session(agent_id="other-bot") as s:
        s.call_sync(cliapp.mod.send_refund_email, user_id="u2", amount=5.0)
    s.complete()

    result = run(db, "sessions", "list")
    assert result.exit_code == 0, result.output
    assert waiting in result.stdout and s.id in result.stdout and "awaiting_approval" in result.stdout

    data = json.loads(run(db, "sessions", "list", "--json").stdout)
    assert {d["session_id"]: d["state"] for d in data} == {waiting: "awaiting_approval", s.id: "completed"}
    assert set(data[0]) >= {"session_id", "agent_id", "state", "tool_calls_total", "created_by", "halted_reason",
                            "pinned_revisions", "created_at"}
    done = json.loads(run(db, "sessions", "list", "--state", "completed", "--json").stdout)
    assert [d["session_id"] for d in done] == [s.id]
    assert run(db, "sessions", "list", "--state", "bogus").exit_code == 2


def test_sessions_show(db: Any, cliapp: App) -> None:
    sid, rid = pending_delete(cliapp.undolog, cliapp.mod)
    result = run(db, "sessions", "show", sid)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert sid in out and rid in out and "send_refund_email" in out and "delete_user_account" in out
    assert "cancel_refund_email (armed)" in out and "A rollback would run 1 compensation(s)" in out

    data = json.loads(run(db, "sessions", "show", sid, "--json").stdout)
    assert set(data) == {"session", "effects", "undo_plan", "approvals"}
    assert data["session"]["state"] == "awaiting_approval"
    assert [e["tool_name"] for e in data["effects"]] == ["send_refund_email", "delete_user_account"]
    assert data["effects"][0]["args_snapshot"] == {"user_id": "u1", "amount": 25.0}
    assert [a["approval_request_id"] for a in data["approvals"]] == [rid]
    assert [p["compensation_name"] for p in data["undo_plan"]] == ["cancel_refund_email"]


def test_unknown_session_ids_are_clear_errors(db: Any) -> None:
    db.open()
    for cmd in (["show"], ["rollback"], ["resume"], ["revalidate"]):
        err = assert_error(run(db, "sessions", *cmd, "no-such-session"), "session_not_found")
        assert "no-such-session" in err


@pytest.mark.reads_store
def test_rollback_runs_the_apps_compensations_newest_first_with_progress(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    n = PROGRESS_MIN_STEPS + 1
    with u.session(agent_id="bot") as s:
        for i in range(n):
            s.call_sync(cliapp.mod.send_refund_email, user_id=f"u{i}", amount=float(i))

    result = run(db, "sessions", "rollback", s.id, "--as", "ana", app_spec=cliapp.spec)
    assert result.exit_code == 0, result.output
    assert f"rolled back ({n} compensation(s) run)" in result.stdout
    # stderr is not a terminal under CliRunner: the progress is one line per step.
    assert f"[1/{n}]" in result.stderr and f"[{n}/{n}]" in result.stderr

    with internals(u).read() as conn:
        undo_keys = [f"undo-{r.undo_id}" for r in conn.execute(
            sa.select(t.undo_stack.c.undo_id).where(t.undo_stack.c.session_id == s.id)
            .order_by(t.undo_stack.c.undo_id.desc()))]
        states = {r.state for r in conn.execute(sa.select(t.effect_log.c.state)
                                                .where(t.effect_log.c.session_id == s.id))}
    assert cliapp.undone() == [f"cancel_refund_email u{i} {k}" for i, k in zip(reversed(range(n)), undo_keys, strict=True)]
    assert states == {"compensated"}
    assert u.sessions.get(s.id).state == "rolled_back"
    assert events(u, "session.rollback")[-1].actor == "ana"

    again = run(db, "sessions", "rollback", s.id, app_spec=cliapp.spec)
    assert again.exit_code == 0 and "already rolled back" in again.stdout
    assert len(cliapp.undone()) == n  # nothing ran twice


def test_rollback_json_report(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    with u.session() as s:
        s.call_sync(cliapp.mod.send_refund_email, user_id="u1", amount=1.0)
    result = run(db, "sessions", "rollback", s.id, "--json", app_spec=cliapp.spec)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["complete"] is True and report["already_rolled_back"] is False
    assert [(st["tool_name"], st["outcome"]) for st in report["steps"]] == [("send_refund_email", "compensated")]
    assert result.stderr == ""  # no progress lines in machine mode


@pytest.mark.reads_store
def test_rollback_without_the_app_changes_nothing(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    with u.session() as s:
        s.call_sync(cliapp.mod.send_refund_email, user_id="u1", amount=1.0)
    err = assert_error(run(db, "sessions", "rollback", s.id), "compensation_not_found")
    assert "--app" in err and "cancel_refund_email" in err
    assert u.sessions.get(s.id).state == "active"
    assert row(u, t.undo_stack, session_id=s.id).state == "armed"
    assert cliapp.undone() == []


def test_rollback_that_halts_exits_1_and_says_why(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    u.saga.backoff_seconds = 0.0
    with u.session() as s:
        s.call_sync(cliapp.mod.send_refund_email, user_id="u1", amount=1.0)
        s.call_sync(cliapp.mod.charge_card, card="4242", amount=9.0)
    result = run(db, "sessions", "rollback", s.id, app_spec=cliapp.spec)
    assert result.exit_code == 1, result.output
    assert "compensation_failed" in result.stdout
    assert "halted" in result.stderr and "payment provider unavailable" in result.stderr
    rec = u.sessions.get(s.id)
    assert rec.state == "halted" and "refund_card" in (rec.halted_reason or "")
    assert cliapp.undone() == []  # the walk stopped at the newest effect, LIFO


def test_app_on_another_database_than_db_is_refused(db: Any, cliapp: App, tmp_path: Path) -> None:
    result = runner.invoke(app, ["--db", f"sqlite:///{tmp_path}/other.db", "--app", cliapp.spec, "recover"],
                           env=CLEAN_ENV)
    err = assert_error(result, "configuration_error")
    assert "not the --db given" in err


def test_bad_app_spec_is_a_clear_error(db: Any) -> None:
    db.open()
    assert "module:attribute" in assert_error(run(db, "recover", app_spec="no_colon"), "configuration_error")
    assert "cannot import" in assert_error(run(db, "recover", app_spec="no_such_module_xyz:app"),
                                           "configuration_error")


@pytest.mark.reads_store
def test_resume_a_halted_session(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    sid, rid = pending_delete(u, cliapp.mod)
    u.approvals.reject(rid, approver="ana", reason="not without a ticket")
    assert u.sessions.get(sid).state == "halted"

    result = run(db, "sessions", "resume", sid, "--as", "bob", "--reason", "checked with the customer")
    assert result.exit_code == 0, result.output
    assert "resumed by bob" in result.stdout
    assert u.sessions.get(sid).state == "active"
    ev = events(u, "session.resume")[-1]
    assert ev.actor == "bob" and "checked with the customer" in ev.payload

    err = assert_error(run(db, "sessions", "resume", sid), "invalid_session_state")
    assert "not halted" in err


@pytest.mark.reads_store
def test_revalidate_pins_the_session_to_the_new_contract(db: Any) -> None:
    u = db.open()

    def refund_v(n: int) -> Any:
        if n == 1:
            @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Moves money")
            def refund(user_id: str) -> str:
                return "v1"
        else:
            @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Moves money", risk_tags=["billing"])
            def refund(user_id: str) -> str:
                return "v2"
        return refund

    u.register(refund_v(1))
    with u.session() as s:
        with pytest.raises(ApprovalPending):
            s.call_sync("refund", user_id="u1", call_id="a")
    sid = s.id

    # A new process with the changed contract: the session is pinned to revision 1.
    u2 = db.open()
    u2.register(refund_v(2))
    with pytest.raises(ContractChanged):
        u2.session(session_id=sid).call_sync("refund", user_id="u2", call_id="b")

    result = run(db, "sessions", "revalidate", sid, "--as", "ana")
    assert result.exit_code == 0, result.output
    assert "refund" in result.stdout and "ana" in result.stdout
    assert u2.sessions.get(sid).pinned_revisions == {"refund": 2}
    assert events(u2, "session.revalidate")[-1].actor == "ana"

    u3 = db.open()
    u3.register(refund_v(2))
    with pytest.raises(ApprovalPending):  # accepted again: a fresh approval request, not a contract error
        u3.session(session_id=sid).call_sync("refund", user_id="u2", call_id="b")

    again = json.loads(run(db, "sessions", "revalidate", sid, "--json").stdout)
    assert again == {"session_id": sid, "changed": {}}


# -- approvals --------------------------------------------------------------------------------------


def test_approvals_list_and_show(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    sid, rid = pending_delete(u, cliapp.mod)
    with u.session() as s2, pytest.raises(ApprovalPending) as p:
        s2.call_sync(cliapp.mod.wire_money, to="acct-9", amount=100.0, call_id="w1")
    rid2 = p.value.approval_request_id

    result = run(db, "approvals", "list")
    assert result.exit_code == 0, result.output
    assert rid in result.stdout and rid2 in result.stdout and "delete_user_account" in result.stdout

    data = json.loads(run(db, "approvals", "list", "--json").stdout)
    assert {d["approval_request_id"] for d in data} == {rid, rid2}
    assert set(data[0]) >= {"approval_request_id", "effect_id", "session_id", "tool_name", "proposed_args", "reason",
                            "risk_tags", "agent_context", "timeout_at", "state", "seconds_left"}
    only = json.loads(run(db, "approvals", "list", "--risk-tag", "billing", "--json").stdout)
    assert [d["approval_request_id"] for d in only] == [rid2]
    only = json.loads(run(db, "approvals", "list", "--session", sid, "--tool", "delete_user_account",
                          "--json").stdout)
    assert [d["approval_request_id"] for d in only] == [rid]

    shown = run(db, "approvals", "show", rid)
    assert shown.exit_code == 0, shown.output
    for text in (rid, sid, "Deletes every record of the user", "pii", "c-7", "send_refund_email", "requested"):
        assert text in shown.stdout, text
    detail = json.loads(run(db, "approvals", "show", rid, "--json").stdout)
    assert detail["proposed_args"] == {"user_id": "u1"} and detail["state"] == "pending"
    assert [e["action"] for e in detail["events"]] == ["requested"]
    assert detail["agent_context"][-1]["tool_name"] == "send_refund_email"

    u.approvals.approve(rid, approver="ana")
    assert [d["approval_request_id"] for d in json.loads(run(db, "approvals", "list", "--json").stdout)] == [rid2]
    every = json.loads(run(db, "approvals", "list", "--state", "all", "--json").stdout)
    assert {d["approval_request_id"]: d["state"] for d in every} == {rid: "approved", rid2: "pending"}
    assert "no approval requests in state rejected" in run(db, "approvals", "list", "--state", "rejected").stdout


@pytest.mark.reads_store
def test_approve_then_the_reissued_call_runs(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    sid, rid = pending_delete(u, cliapp.mod)
    result = run(db, "approvals", "approve", rid, "--as", "ana", "--reason", "ticket 42")
    assert result.exit_code == 0, result.output
    assert f"approved request {rid}" in result.stdout and "c-7" in result.stdout

    req = row(u, t.approval_requests, approval_request_id=rid)
    assert (req.state, req.decided_by, req.decision_reason) == ("approved", "ana", "ticket 42")
    assert row(u, t.effect_log, effect_id=req.effect_id).state == "approved"
    assert events(u, "approve")[-1].actor == "ana"
    assert u.sessions.get(sid).state == "active"

    out = u.session(session_id=sid).call_sync(cliapp.mod.delete_user_account, user_id="u1", call_id="c-7")
    assert out == {"deleted": "u1"}
    assert row(u, t.effect_log, effect_id=req.effect_id).state == "committed"


@pytest.mark.reads_store
def test_deciding_twice_and_unknown_ids_are_refused(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    _, rid = pending_delete(u, cliapp.mod)
    assert run(db, "approvals", "approve", rid, "--as", "ana").exit_code == 0
    for cmd in (["approve", rid], ["reject", rid, "--reason", "no"], ["modify", rid, "--args", '{"user_id": "u2"}']):
        err = assert_error(run(db, "approvals", *cmd, "--as", "bob"), "approval_already_decided")
        assert "already approved" in err
    req = row(u, t.approval_requests, approval_request_id=rid)
    assert (req.state, req.decided_by, req.approved_args) == ("approved", "ana", {"user_id": "u1"})
    assert len(events(u, "approve")) == 1 and events(u, "reject") == [] and events(u, "modify") == []

    for cmd in (["show", "nope"], ["approve", "nope"], ["reject", "nope", "--reason", "x"],
                ["modify", "nope", "--args", "{}"]):
        assert "'nope' does not exist" in assert_error(run(db, "approvals", *cmd), "approval_not_found")


@pytest.mark.pg_smoke
def test_reject_halts_the_session_and_cancels_its_other_requests(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    sid, rid = pending_delete(u, cliapp.mod)
    with u.session(session_id=sid) as s, pytest.raises(ApprovalPending) as p:
        s.call_sync(cliapp.mod.wire_money, to="acct-9", amount=100.0, call_id="w1")
    other = p.value.approval_request_id

    missing_reason = run(db, "approvals", "reject", rid, "--as", "ana")
    assert missing_reason.exit_code == 2 and "--reason" in missing_reason.output
    assert row(u, t.approval_requests, approval_request_id=rid).state == "pending"

    result = run(db, "approvals", "reject", rid, "--as", "ana", "--reason", "customer asked to keep it")
    assert result.exit_code == 0, result.output
    assert "rejected" in result.stdout and "halted" in result.stdout
    req = row(u, t.approval_requests, approval_request_id=rid)
    assert (req.state, req.decided_by, req.decision_reason) == ("rejected", "ana", "customer asked to keep it")
    assert row(u, t.effect_log, effect_id=req.effect_id).state == "rejected"
    assert row(u, t.approval_requests, approval_request_id=other).state == "cancelled"
    rec = u.sessions.get(sid)
    assert rec.state == "halted" and "customer asked to keep it" in (rec.halted_reason or "")


@pytest.mark.reads_store
def test_modify_with_good_and_bad_edits(db: Any, cliapp: App, tmp_path: Path) -> None:
    u = cliapp.undolog
    with u.session() as s, pytest.raises(ApprovalPending) as p:
        s.call_sync(cliapp.mod.wire_money, to="acct-9", amount=100.0, call_id="w1")
    rid = p.value.approval_request_id

    # Unparseable JSON: where it broke. Valid JSON of the wrong shape: what was expected.
    err = assert_error(run(db, "approvals", "modify", rid, "--args", '{"amount": 5'), "invalid_input")
    assert "not valid JSON" in err and "line 1 column" in err
    assert "JSON object" in assert_error(run(db, "approvals", "modify", rid, "--args", "[5]"), "invalid_input")
    # A value the schema refuses: the error names the field.
    err = assert_error(run(db, "approvals", "modify", rid, "--args", '{"to": "acct-9", "amount": "lots"}'),
                       "arguments_invalid")
    assert "amount" in err and "wire_money" in err
    err = assert_error(run(db, "approvals", "modify", rid, "--args", '{"amount": 5}'), "arguments_invalid")
    assert "to" in err and "Field required" in err
    assert "cannot read" in assert_error(run(db, "approvals", "modify", rid, "--args", f"@{tmp_path}/none.json"),
                                         "invalid_input")
    req = row(u, t.approval_requests, approval_request_id=rid)
    assert (req.state, req.approved_args) == ("pending", None)  # bad edits changed nothing
    assert events(u, "modify") == []

    result = run(db, "approvals", "modify", rid, "--args", '{"amount": 40}', "--merge", "--as", "ana")
    assert result.exit_code == 0, result.output
    assert '"amount": 40' in result.stdout
    req = row(u, t.approval_requests, approval_request_id=rid)
    assert (req.state, req.approved_args, req.decided_by) == ("approved", {"to": "acct-9", "amount": 40.0}, "ana")
    ev = events(u, "modify")[-1]
    assert ev.actor == "ana" and json.loads(ev.payload)["args"] == {"to": "acct-9", "amount": 40.0}

    out = u.session(session_id=s.id).call_sync(cliapp.mod.wire_money, to="acct-9", amount=100.0, call_id="w1")
    assert out == {"wired": 40.0, "to": "acct-9"}  # the approved edit ran, once


def test_modify_from_a_file_validates_against_the_stored_contract(db: Any, cliapp: App, tmp_path: Path) -> None:
    # No --app: the CLI has no tools loaded and validates against the registry's stored schema.
    _, rid = pending_delete(cliapp.undolog, cliapp.mod)
    edit = tmp_path / "edit.json"
    edit.write_text('{"user_id": "u1-archived"}')
    result = run(db, "approvals", "modify", rid, "--args", f"@{edit}", "--json", "--as", "ana")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["approved_args"] == {"user_id": "u1-archived"}


@pytest.mark.reads_store
def test_decisions_default_to_undolog_actor(db: Any, cliapp: App) -> None:
    _, rid = pending_delete(cliapp.undolog, cliapp.mod)
    result = run(db, "approvals", "approve", rid, env={"UNDOLOG_ACTOR": "carol@desk"})
    assert result.exit_code == 0, result.output
    assert row(cliapp.undolog, t.approval_requests, approval_request_id=rid).decided_by == "carol@desk"


@pytest.mark.reads_store
def test_reading_applies_due_timeouts(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    sid, rid = pending_delete(u, cliapp.mod)
    with internals(u).write() as conn:  # make it due without sleeping
        conn.execute(t.approval_requests.update().where(t.approval_requests.c.approval_request_id == rid)
                     .values(timeout_at=utcnow() - dt.timedelta(seconds=1)))
    listed = run(db, "approvals", "list", "--json")
    assert json.loads(listed.stdout) == []
    assert row(u, t.approval_requests, approval_request_id=rid).state == "timed_out"
    assert u.sessions.get(sid).state == "halted"
    assert "already timed_out" in assert_error(run(db, "approvals", "approve", rid), "approval_already_decided")


# -- policy -----------------------------------------------------------------------------------------


@pytest.mark.reads_store
def test_policy_show_and_set(db: Any) -> None:
    u = db.open()
    shown = run(db, "policy", "show")
    assert shown.exit_code == 0 and "approval_timeout_seconds" in shown.stdout and "3600" in shown.stdout
    assert json.loads(run(db, "policy", "show", "--json").stdout) == {
        "approval_timeout_seconds": 3600, "auto_approve_on_timeout": False, "context_calls": 10,
        "approved_ttl_seconds": 86400}

    result = run(db, "policy", "set", "--approval-timeout-seconds", "900", "--auto-approve-on-timeout", "true",
                 "--context-calls", "3", "--as", "admin:ana")
    assert result.exit_code == 0, result.output
    assert "admin:ana" in result.stdout
    pol = u.policy.get()
    assert (pol.approval_timeout_seconds, pol.auto_approve_on_timeout, pol.context_calls) == (900, True, 3)
    ev = events(u, "policy.set")[-1]
    assert ev.actor == "admin:ana" and json.loads(ev.payload)["before"]["approval_timeout_seconds"] == 3600

    assert run(db, "policy", "set", "--approved-ttl-seconds", "600").exit_code == 0
    assert u.policy.get().approved_ttl_seconds == 600

    data = json.loads(run(db, "policy", "set", "--auto-approve-on-timeout", "false", "--json").stdout)
    assert data["before"]["auto_approve_on_timeout"] is True and data["after"]["auto_approve_on_timeout"] is False


@pytest.mark.reads_store
def test_policy_set_refuses_bad_values(db: Any) -> None:
    u = db.open()
    assert "auto_approve_on_timeout" in assert_error(
        run(db, "policy", "set", "--auto-approve-on-timeout", "maybe"), "policy_invalid")
    assert "approval_timeout_seconds" in assert_error(
        run(db, "policy", "set", "--approval-timeout-seconds", "0"), "policy_invalid")
    assert "nothing to change" in assert_error(run(db, "policy", "set"), "invalid_input")
    assert run(db, "policy", "set", "--context-calls", "many").exit_code == 2  # not a number: usage error
    assert u.policy.get().to_dict() == {"approval_timeout_seconds": 3600, "auto_approve_on_timeout": False,
                                        "context_calls": 10, "approved_ttl_seconds": 86400}
    assert events(u, "policy.set") == []


# -- recovery ---------------------------------------------------------------------------------------


def _crashed_call(u: UndoLog, tool: str, **args: Any) -> str:
    """A COMPENSABLE call pre-written by a process that then died before the tool returned."""
    with u.session() as s:
        pass
    d = u.engine.intercept(s.id, tool, args, call_id=f"crash-{uuid.uuid4().hex[:6]}")
    dead_owner = f"{Owner.me().split('|', 1)[0]}|{2**22 + 12345}|1"  # this host, a pid that does not exist
    with internals(u).write() as conn:
        conn.execute(t.effect_log.update().where(t.effect_log.c.effect_id == d.effect_id)
                     .values(owner=dead_owner, lease_until=None))
    return d.effect_id


@pytest.mark.reads_store
def test_recover_needs_the_app_and_then_reconciles(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    effect_id = _crashed_call(u, "send_refund_email", user_id="u9", amount=3.0)

    without = run(db, "recover")
    assert without.exit_code == 1, without.output
    assert "not recovered" in without.stderr and "--app" in without.stderr
    assert row(u, t.effect_log, effect_id=effect_id).state == "pending"  # untouched

    result = run(db, "recover", app_spec=cliapp.spec)
    assert result.exit_code == 0, result.output
    assert effect_id in result.stdout and "compensated" in result.stdout
    assert row(u, t.effect_log, effect_id=effect_id).state == "compensated"
    assert cliapp.undone() == [f"cancel_refund_email u9 undo-{row(u, t.undo_stack, effect_id=effect_id).undo_id}"]

    nothing = run(db, "recover", "--json", app_spec=cliapp.spec)
    assert nothing.exit_code == 0
    assert json.loads(nothing.stdout) == {"reconciled": [], "rollbacks_resumed": [], "dead_lettered": [],
                                          "errors": [], "left_alive": 0}
    assert "nothing to recover" in run(db, "recover", app_spec=cliapp.spec).stdout


@pytest.mark.reads_store
def test_recover_many_effects_shows_progress(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    ids = [_crashed_call(u, "send_refund_email", user_id=f"u{i}", amount=1.0) for i in range(PROGRESS_MIN_STEPS)]
    result = run(db, "recover", app_spec=cliapp.spec)
    assert result.exit_code == 0, result.output
    n = len(ids)
    assert f"[{n}/{n}]" in result.stderr
    assert {row(u, t.effect_log, effect_id=e).state for e in ids} == {"compensated"}


# -- audit ------------------------------------------------------------------------------------------


def _tamper(u: UndoLog, event_id: int) -> None:
    """Edit an audit event behind the append-only triggers' back, as someone with table access could."""
    with internals(u).write() as conn:
        if internals(u).is_postgres:
            conn.exec_driver_sql("ALTER TABLE undolog_approval_events DISABLE TRIGGER undolog_events_no_update")
        else:
            conn.exec_driver_sql("DROP TRIGGER undolog_events_no_update")
        conn.execute(t.approval_events.update().where(t.approval_events.c.event_id == event_id)
                     .values(actor="mallory"))


@pytest.mark.pg_smoke
def test_audit_verify_passes_then_catches_tampering(db: Any, cliapp: App) -> None:
    u = cliapp.undolog
    _, rid = pending_delete(u, cliapp.mod)
    u.approvals.approve(rid, approver="ana")

    ok = run(db, "audit", "verify")
    assert ok.exit_code == 0, ok.output
    assert "intact" in ok.stdout and "2 event(s)" in ok.stdout
    assert json.loads(run(db, "audit", "verify", "--json").stdout)["ok"] is True

    approve_event = events(u, "approve")[-1].event_id
    _tamper(u, approve_event)
    bad = run(db, "audit", "verify")
    assert bad.exit_code == 1
    assert "BROKEN" in bad.stderr and f"event {approve_event}" in bad.stderr and "Traceback" not in bad.output
    data = json.loads(run(db, "audit", "verify", "--json").stdout)
    assert data["ok"] is False and data["first_bad_event_id"] == approve_event


# -- demo -------------------------------------------------------------------------------------------


def _fake_demo(monkeypatch: pytest.MonkeyPatch, name: str, signature: str) -> dict[str, Any]:
    calls: dict[str, Any] = {}
    mod = types.ModuleType(name)
    exec(f"def main({signature}):\n    calls.update(locals())\n    return 0", {"calls": calls}, mod.__dict__)
    monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_demo_delegates_to_the_framework_demos(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lg = _fake_demo(monkeypatch, "examples.support_agent.demo",
                    "reject=False, interactive=False, model=None, db_path=None")
    result = runner.invoke(app, ["demo", "--reject", "--model", "gpt-x", "--db", str(tmp_path / "d.db")],
                           env=CLEAN_ENV)
    assert result.exit_code == 0, result.output
    assert lg == {"reject": True, "interactive": False, "model": "gpt-x", "db_path": str(tmp_path / "d.db")}

    crew = _fake_demo(monkeypatch, "examples.crewai_support_crew.demo", "reject=False, database_url=None")
    assert runner.invoke(app, ["demo", "--framework", "crewai"], env=CLEAN_ENV).exit_code == 0
    assert crew == {"reject": False, "database_url": None}
    assert runner.invoke(app, ["demo", "--framework", "crewai", "--db", str(tmp_path / "c.db")],
                         env=CLEAN_ENV).exit_code == 0
    assert crew["database_url"] == f"sqlite:///{tmp_path / 'c.db'}"

    sk = _fake_demo(monkeypatch, "examples.semantic_kernel_support.demo", "reject=False")
    assert runner.invoke(app, ["demo", "--framework", "semantic-kernel", "--reject"], env=CLEAN_ENV).exit_code == 0
    assert sk == {"reject": True}
    assert_error(runner.invoke(app, ["demo", "--framework", "semantic-kernel", "--interactive"], env=CLEAN_ENV),
                 "invalid_input")


def test_demo_exit_code_and_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("examples.support_agent.demo")
    mod.main = lambda **kw: 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "examples.support_agent.demo", mod)
    assert runner.invoke(app, ["demo"], env=CLEAN_ENV).exit_code == 1
    monkeypatch.setitem(sys.modules, "examples.crewai_support_crew.demo", None)  # import fails
    err = assert_error(runner.invoke(app, ["demo", "--framework", "crewai"], env=CLEAN_ENV), "configuration_error")
    assert "undolog[crewai]" in err


# -- the server's commands --------------------------------------------------------------------------


def test_global_db_reaches_the_server_commands(db: Any) -> None:
    db.open()
    before = dict(os.environ)
    created = run(db, "keys", "create", "--name", "ana", "--role", "approver")
    assert created.exit_code == 0, created.output
    listed = run(db, "keys", "list")
    assert listed.exit_code == 0 and "ana" in listed.stdout and "approver" in listed.stdout
    assert dict(os.environ) == before  # the exported --db/--schema were restored


def test_narrow_terminals_drop_columns_but_never_cut_ids(db: Any, cliapp: App) -> None:
    sid, rid = pending_delete(cliapp.undolog, cliapp.mod)
    narrow = run(db, "approvals", "list", env={"COLUMNS": "80"})
    assert narrow.exit_code == 0, narrow.output
    assert rid in narrow.stdout and max(len(line) for line in narrow.stdout.splitlines()) <= 80
    assert sid not in narrow.stdout  # the session column went first
    wide = run(db, "approvals", "list", env={"COLUMNS": "200"})
    assert rid in wide.stdout and sid in wide.stdout and "pii" in wide.stdout
