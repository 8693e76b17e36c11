"""Migrations: a database made by an older revision is upgraded in place, its ids and undo keys kept."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from undolog_core.storage import migrate as _migrate
from undolog_core.storage import schema as t
from undolog_core.storage.base import _MIGRATION_LOCK_KEY, Store
from undolog_core.testing import internals

from ..support.toolkit import setup

# Every open runs the real migrations: these tests are about them, so no copy of the session's template.
pytestmark = pytest.mark.real_migrations

T0 = dt.datetime(2026, 11, 1, 9, 0, tzinfo=dt.UTC)
SERVER_TABLES = {"undolog_api_keys", "undolog_approver_groups", "undolog_webhook_targets", "undolog_webhook_deliveries",
                 "undolog_notification_policies", "undolog_escalations", "undolog_server_settings",
                 "undolog_alembic_version"}


def _old_database(db, rows) -> None:
    """A database at 0002_server (the layout before 0003) holding ``rows``, written with raw SQL."""
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0002_server")
        with store.engine.begin() as c:
            for sql, params in rows:
                c.execute(sa.text(sql), params)
    finally:
        store.dispose()


def _stamp(minutes: int) -> str:
    # The text each database's DateTime column holds: naive UTC on SQLite; PostgreSQL reads the zone.
    text = (T0 + dt.timedelta(minutes=minutes)).replace(tzinfo=None).isoformat(" ", "microseconds")
    return text if _KIND == ["sqlite"] else text + "+00:00"


_KIND: list[str] = []


@pytest.fixture(autouse=True)
def _kind(db):
    _KIND[:] = [db.kind]


def _effect(effect_id, call_id, tool, tier, state, minutes, result=None):
    return (
        "INSERT INTO undolog_effect_log (effect_id, session_id, call_id, tool_name, tool_revision, tier, state, "
        "args_snapshot, args_digest, result_snapshot, owner, lease_until, recovery_attempts, created_at, updated_at) "
        "VALUES (:effect_id, 's-old', :call_id, :tool, 1, :tier, :state, :args, :digest, :result, NULL, NULL, 0, "
        ":at, :at)",
        {"effect_id": effect_id, "call_id": call_id, "tool": tool, "tier": tier, "state": state,
         "args": json.dumps({"user_id": "u1", "amount": 5}), "digest": "0" * 64,
         "result": json.dumps(result) if result is not None else None, "at": _stamp(minutes)},
    )


def _undo(undo_id, effect_id, minutes):
    return (
        "INSERT INTO undolog_undo_stack (undo_id, effect_id, session_id, compensation_name, compensation_version, "
        "args_snapshot, state, attempts, created_at, updated_at) "
        "VALUES (:undo_id, :effect_id, 's-old', 'cancel_refund_email', 1, :args, 'armed', 0, :at, :at)",
        {"undo_id": undo_id, "effect_id": effect_id, "args": json.dumps({"user_id": "u1", "amount": 5}),
         "at": _stamp(minutes)},
    )


def _rows():
    session = (
        "INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, created_by, on_failure, "
        "pinned_revisions, created_at, updated_at) "
        "VALUES ('s-old', 'bot', 'active', 3, 'test', 'rollback', '{}', :at, :at)",
        {"at": _stamp(0)},
    )
    return [
        session,
        _effect("e-first", "c1", "send_refund_email", "compensable", "committed", 1, {"message_id": "m1"}),
        _undo(5, "e-first", 1),
        _effect("e-gate", "c2", "delete_user_account", "irreversible", "rejected", 2),
        _effect("e-second", "c3", "send_refund_email", "compensable", "committed", 3, {"message_id": "m3"}),
        _undo(9, "e-second", 3),
    ]


def _seqs(u) -> dict[str, int]:
    with internals(u).sql_engine.connect() as c:
        return dict(c.execute(sa.select(t.effect_log.c.effect_id, t.effect_log.c.seq)).all())


def test_upgrade_keeps_undo_ids_and_numbers_the_rest_after_them(db):
    _old_database(db, _rows())
    u = db.open()  # UndoLog.open upgrades to the newest revision
    assert _migrate.current(internals(u).sql_engine) == _migrate.head()
    # An effect with an undo entry takes its id as seq (keys already handed out stay the same); the others follow.
    assert _seqs(u) == {"e-first": 5, "e-second": 9, "e-gate": 10}
    with internals(u).sql_engine.connect() as c:
        undo = c.execute(sa.select(t.undo_stack.c.undo_id, t.undo_stack.c.effect_id)
                         .order_by(t.undo_stack.c.undo_id)).all()
        cursor = c.execute(sa.select(t.recovery_cursor)).one()
    assert [tuple(r) for r in undo] == [(5, "e-first"), (9, "e-second")]
    assert (cursor.cursor_id, cursor.effect_seq) == (1, 0)


def test_upgraded_session_goes_on_and_rolls_back_lifo_with_the_old_keys(db):
    _old_database(db, _rows())
    u = db.open()
    world, tools = setup(u)
    s = u.session(session_id="s-old")
    s.call_sync(tools["send_refund_email"], user_id="u2", amount=7)
    new_effect = max(_seqs(u).items(), key=lambda kv: kv[1])
    assert new_effect[1] == 11  # numbering goes on after the migrated rows, on both databases
    report = s.rollback_sync(actor="test")
    assert [st.outcome for st in report.steps] == ["compensated"] * 3
    keys = [detail[1] for what, detail in world.calls if what == "cancel"]
    assert keys == ["undo-11", "undo-9", "undo-5"]


def test_migrated_schema_is_the_declared_one(db):
    _old_database(db, [])
    u = db.open()
    with internals(u).sql_engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c), t.metadata)
        names = {r[0] for r in c.execute(sa.text(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            if db.kind == "postgres" else "SELECT name FROM sqlite_master WHERE type = 'index'"))}
    drift = [d for d in diff if not (d[0] == "remove_table" and d[1].name in SERVER_TABLES)
             and not (d[0] == "remove_index" and d[1].table.name in SERVER_TABLES)]
    if db.kind == "sqlite":
        # Declared for PostgreSQL only (ddl_if); the comparison does not know that.
        drift = [d for d in drift if not (d[0] == "add_index" and d[1].name == "ix_undolog_effect_in_flight")]
        assert "ix_undolog_effect_in_flight" not in names
    else:
        assert "ix_undolog_effect_in_flight" in names
    assert drift == []
    assert "ix_undolog_undo_session" not in names and "ix_undolog_undo_compensating" in names


def test_a_migration_that_would_break_references_changes_nothing(db):
    # An undo entry pointing at an effect that does not exist.
    orphan = _undo(3, "e-missing", 1)
    _old_database(db, [_rows()[0]])
    store = Store(db.url, schema=db.schema)
    try:
        if db.kind == "postgres":
            # PostgreSQL keeps its references on through the migration (it alters in place): such a row
            # cannot exist there in the first place.
            with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as c:
                c.execute(sa.text(orphan[0]), orphan[1])
            return
        # SQLite rebuilds the tables with references off, so it checks them before committing.
        with store.engine.connect() as c:
            raw = c.connection.driver_connection
            raw.execute("PRAGMA foreign_keys=OFF")
            c.execute(sa.text(orphan[0]), orphan[1])
            c.commit()
            raw.execute("PRAGMA foreign_keys=ON")
        with pytest.raises(Exception, match="would break their references"):
            _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY)
        assert _migrate.current(store.engine) == "0002_server"
        with store.engine.connect() as c:
            cols = [r[1] for r in c.exec_driver_sql("PRAGMA table_info(undolog_effect_log)")]
        assert "seq" not in cols  # the old layout, untouched
    finally:
        store.dispose()


def test_downgrade_to_0002_and_back_keeps_every_id(db):
    u = db.open()
    world, tools = setup(u)
    s = u.session(agent_id="round-trip")
    for amount in (1, 2):
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=amount)
    with internals(u).sql_engine.connect() as c:
        before = sorted(tuple(r) for r in c.execute(sa.select(t.undo_stack.c.undo_id, t.undo_stack.c.effect_id)))
    sid = s.id
    u.close()
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.downgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0002_server")
        assert _migrate.current(store.engine) == "0002_server"
        with store.engine.connect() as c:
            cols = {col["name"] for col in sa.inspect(c).get_columns("undolog_effect_log")}
            tables = set(sa.inspect(c).get_table_names())
            old = sorted(tuple(r) for r in c.execute(sa.text("SELECT undo_id, effect_id FROM undolog_undo_stack")))
        assert "seq" not in cols and "undolog_recovery_cursor" not in tables
        assert old == before
    finally:
        store.dispose()
    u2 = db.open()  # and forward again
    world2, tools2 = setup(u2)
    with internals(u2).sql_engine.connect() as c:
        again = sorted(tuple(r) for r in c.execute(sa.select(t.undo_stack.c.undo_id, t.undo_stack.c.effect_id)))
    assert again == before
    report = u2.session(session_id=sid).rollback_sync(actor="test")
    assert [st.outcome for st in report.steps] == ["compensated", "compensated"]
    assert [d[1] for w, d in world2.calls if w == "cancel"] == [f"undo-{i}" for i, _ in sorted(before, reverse=True)]


def test_an_audit_trail_of_one_chain_upgrades_to_several_and_still_verifies(db):
    """Revision 0009: the events of a database made before it stay in chain 1 with their hashes; appends go on
    after them (PostgreSQL's new id sequence starts past them) and the whole trail verifies."""
    from undolog_core.storage.audit import GENESIS_HASH, event_hash

    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0008_archive")
        with store.engine.begin() as c:
            # 0001 builds the events table from today's schema: take the column away, as the older code made it.
            c.execute(sa.text("DROP INDEX IF EXISTS ix_undolog_events_chain"))
            c.execute(sa.text("ALTER TABLE undolog_approval_events DROP COLUMN chain"))
            prev = GENESIS_HASH
            for i in (1, 2, 3):
                at = T0 + dt.timedelta(minutes=i)
                h = event_hash(event_id=i, approval_request_id=None, subject="policy", action="policy.set",
                               actor="ana", payload="{}", created_at=at, prev_hash=prev)
                c.execute(sa.text("INSERT INTO undolog_approval_events (event_id, approval_request_id, subject, "
                                  "action, actor, payload, created_at, prev_hash, hash) VALUES (:i, NULL, 'policy', "
                                  "'policy.set', 'ana', '{}', :at, :prev, :h)"),
                          {"i": i, "at": _stamp(i), "prev": prev, "h": h})
                prev = h
            c.execute(sa.text("UPDATE undolog_audit_head SET last_event_id = 3, last_hash = :h WHERE head_id = 1"),
                      {"h": prev})
    finally:
        store.dispose()
    u = db.open()  # upgrades to head
    report = u.verify_audit()
    assert report.ok and report.events_checked == 3 and report.head_hash == prev, report.problem
    with internals(u).sql_engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(t.audit_head)).scalar_one() == t.AUDIT_CHAINS
        assert set(c.execute(sa.select(t.approval_events.c.chain)).scalars()) == {1}
    u.policy.set(actor="bo", approval_timeout_seconds=600)
    report = u.verify_audit()
    assert report.ok and report.events_checked == 4 and report.head_position == 4, report.problem


@pytest.mark.sqlite_only
def test_sqlite_prewrite_moves_from_the_registry_trigger_to_the_view_and_back(db):
    """Revision 0010 (SQLite): the effect log's AFTER INSERT trigger goes, the pre-write view and its trigger
    come; a database upgraded with calls in it goes on writing effects with their undo entries, and a downgrade
    puts the old trigger back."""
    assert _objects_at(db, _migrate.upgrade) == {"trigger": {"undolog_effect_undo_entry"}, "view": set()}
    u = db.open()  # upgrades to head
    with internals(u).sql_engine.connect() as c:
        assert _sqlite_objects(c) == {"trigger": {"undolog_prewrite_insert"}, "view": {"undolog_prewrite"}}
    world, tools = setup(u)
    s = u.session(agent_id="after-0010")
    s.call_sync(tools["send_refund_email"], user_id="u2", amount=7)
    with internals(u).sql_engine.connect() as c:
        undo = c.execute(sa.select(t.undo_stack.c.undo_id, t.undo_stack.c.compensation_name, t.effect_log.c.seq)
                         .join(t.effect_log, t.effect_log.c.effect_id == t.undo_stack.c.effect_id)).all()
    assert len(undo) == 1 and undo[0].undo_id == undo[0].seq and undo[0].compensation_name
    report = s.rollback_sync(actor="test")
    assert [st.outcome for st in report.steps] == ["compensated"]
    u.close()
    assert _objects_at(db, _migrate.downgrade) == {"trigger": {"undolog_effect_undo_entry"}, "view": set()}


def _objects_at(db, move) -> dict[str, set[str]]:
    """Move the database to revision 0009 (``migrate.upgrade`` or ``downgrade``); its triggers and views then."""
    store = Store(db.url, schema=db.schema)
    try:
        move(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0009_audit_chains")
        with store.engine.connect() as c:
            return _sqlite_objects(c)
    finally:
        store.dispose()


def _sqlite_objects(c) -> dict[str, set[str]]:
    rows = c.execute(sa.text("SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'view') "
                             "AND name NOT LIKE 'undolog_events_%' AND name NOT LIKE 'undolog_audit_head_%'")).all()
    return {kind: {n for k, n in rows if k == kind} for kind in ("trigger", "view")}


@pytest.mark.storage
def test_session_owners_come_with_0013_on_a_database_of_0011_and_go_with_its_downgrade(db):
    """Revision 0013: ``undolog_session_owners`` (who serves a session, and a rollback filed for it) and the
    client keys' partial unique index are made on a database of the previous release, which goes on working
    (client-keyed ids are unique across sessions, other ids per session); running the upgrade again changes
    nothing; the downgrade drops both."""
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0011_due_index")
        assert "undolog_session_owners" not in sa.inspect(store.engine).get_table_names(schema=db.schema)
    finally:
        store.dispose()
    u = db.open()  # upgrades to head
    index = {ix["name"]: ix for ix in sa.inspect(u.store.engine).get_indexes("undolog_effect_log",
                                                                             schema=db.schema)}
    assert index["ux_undolog_effect_client_key"]["unique"]
    world, tools = setup(u)
    s = u.session(agent_id="after-0013")
    s.call_sync(tools["send_refund_email"], user_id="u2", amount=7)
    u.owners.hold([s.id])
    row = u.store.owners.session_owner(s.id)
    assert row.owner == u.leases.owner and row.lease_until > dt.datetime.now(dt.UTC)
    other = u.session(agent_id="after-0013")
    other.call_sync(tools["send_refund_email"], call_id="c-1", user_id="u1", amount=1)
    s.call_sync(tools["send_refund_email"], call_id="c-1", user_id="u1", amount=1)  # per session: fine
    s.call_sync(tools["send_refund_email"], call_id="ck:shared", user_id="u1", amount=2)
    with pytest.raises(Exception):  # noqa: B017,PT011 - the index refuses it, whatever the engine makes of that
        other.call_sync(tools["send_refund_email"], call_id="ck:shared", user_id="u1", amount=2)
    assert world.count("send") == 4  # the refused one never ran
    report = u.rollback(s.id, actor="test")  # held by this very process: run here, not filed
    assert report.complete and not report.ran_without_live_upstream and report.ran_by is None
    u.close()
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema)  # again: idempotent
        _migrate.downgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0011_due_index")
        assert "undolog_session_owners" not in sa.inspect(store.engine).get_table_names(schema=db.schema)
        names = {ix["name"] for ix in sa.inspect(store.engine).get_indexes("undolog_effect_log", schema=db.schema)}
        assert "ux_undolog_effect_client_key" not in names
    finally:
        store.dispose()


def test_the_head_revision_without_alembic_is_alembics_own_head(db):
    assert _migrate.head() == _migrate.HEAD == _migrate.alembic_heads()


def test_opening_a_database_at_head_imports_no_alembic(db):
    """``UndoLog.open`` on a database at head (every CLI command, every gateway start) checks the revision
    without Alembic; one child process, since this one has Alembic loaded."""
    db.open().close()
    child = ("import sys\nfrom undolog_core import UndoLog\n"
             f"u = UndoLog.open({db.url!r}, schema={db.schema!r})\n"
             "print(sorted(m for m in sys.modules if m == 'alembic' or m.startswith('alembic.')))\nu.close()\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
