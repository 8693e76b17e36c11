"""The storage conformance suite: what every backend must do. CI runs it on SQLite and on PostgreSQL."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import sqlalchemy as sa

from undolog_core import UndoLog, _migrate, errors
from undolog_core import _schema as t
from undolog_core._audit import append_event
from undolog_core._store import Store, utcnow

CORE_TABLES = {
    "undolog_sessions", "undolog_effect_log", "undolog_undo_stack", "undolog_approval_requests",
    "undolog_approval_events", "undolog_tool_registry", "undolog_outbox", "undolog_org_policy", "undolog_audit_head",
    "undolog_recovery_cursor",
}


def test_migrations_create_every_table_and_are_idempotent(db):
    u = db.open()
    with u.store.read() as c:
        names = set(sa.inspect(c).get_table_names())
    assert CORE_TABLES <= names
    assert _migrate.current(u.store.engine) == _migrate.head()
    db.open()  # a second open is a no-op
    with u.store.read() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(t.org_policy)).scalar() == 1


def test_concurrent_first_opens_migrate_once(db):
    errs: list[BaseException] = []

    def opener() -> None:
        try:
            db.open()
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errs == []
    with db.opened[-1].store.read() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(t.org_policy)).scalar() == 1


def test_durability_settings(undolog):
    with undolog.store.engine.connect() as c:
        if undolog.store.is_postgres:
            assert c.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
        else:
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    with undolog.store.fast.connect() as c:
        if undolog.store.is_postgres:
            assert c.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        else:
            assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 0  # OFF, for the fast commit mark only


def _session_row(sid: str, **kw):
    now = utcnow()
    return {"session_id": sid, "state": "active", "tool_calls_total": 0, "on_failure": "rollback",
            "pinned_revisions": {}, "created_at": now, "updated_at": now, **kw}


def test_times_round_trip_as_aware_utc_to_the_microsecond(undolog):
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=5)))
    with undolog.store.tx() as c:
        c.execute(t.sessions.insert().values(**_session_row("s", created_at=when)))
    got = undolog.sessions.get("s").created_at
    assert got == when and got.tzinfo == dt.UTC
    with pytest.raises(sa.exc.StatementError, match="naive"):
        with undolog.store.tx() as c:
            c.execute(t.sessions.insert().values(**_session_row("n", created_at=dt.datetime(2026, 1, 1))))


def test_json_round_trip(undolog):
    doc = {"s": "ü ✓", "n": 1.5, "i": 2**53, "l": [1, None, True], "nested": {"a": {"b": []}}}
    with undolog.store.tx() as c:
        c.execute(t.sessions.insert().values(**_session_row("j", pinned_revisions=doc)))
    assert undolog.sessions.get("j").pinned_revisions == doc


@pytest.mark.parametrize("column,value", [("state", "exploded"), ("on_failure", "shrug")])
def test_check_constraints(undolog, column, value):
    with pytest.raises(sa.exc.IntegrityError):
        with undolog.store.tx() as c:
            c.execute(t.sessions.insert().values(**_session_row("x", **{column: value})))


def test_call_id_is_unique_per_session(undolog):
    now = utcnow()
    with undolog.store.tx() as c:
        c.execute(t.sessions.insert().values(**_session_row("s")))
    row = {"session_id": "s", "call_id": "c", "tool_name": "x", "tool_revision": 1, "tier": "irreversible",
           "state": "awaiting_approval", "args_snapshot": {}, "args_digest": "d", "recovery_attempts": 0,
           "created_at": now, "updated_at": now}
    with undolog.store.tx() as c:
        c.execute(t.effect_log.insert().values(effect_id="e1", **row))
    with pytest.raises(sa.exc.IntegrityError):
        with undolog.store.tx() as c:
            c.execute(t.effect_log.insert().values(effect_id="e2", **row))
    with pytest.raises(sa.exc.IntegrityError):  # effects belong to a session that exists
        with undolog.store.tx() as c:
            c.execute(t.effect_log.insert().values(effect_id="e3", **{**row, "session_id": "ghost", "call_id": "z"}))


def test_a_failed_transaction_leaves_nothing_behind(undolog):
    with pytest.raises(RuntimeError):
        with undolog.store.tx() as c:
            c.execute(t.sessions.insert().values(**_session_row("half")))
            raise RuntimeError("crash mid-transaction")
    with pytest.raises(errors.SessionNotFound):
        undolog.sessions.get("half")


def test_concurrent_appends_keep_one_chain(undolog):
    def writer(k: int) -> None:
        for i in range(10):
            with undolog.store.tx() as c:
                append_event(c, undolog.store, subject=f"w{k}", action="test", actor=f"w{k}", payload={"i": i})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    report = undolog.verify_audit()
    assert report.ok and report.events_checked == 40


def test_bad_urls_are_clear_errors(tmp_path):
    with pytest.raises(errors.ConfigurationError, match="unsupported database URL"):
        Store("mysql://x")
    with pytest.raises(errors.ConfigurationError, match="in-memory"):
        Store("sqlite:///:memory:")
    with pytest.raises(errors.ConfigurationError, match="does not exist"):
        Store(f"sqlite:///{tmp_path}/missing/dir/x.db")
    with pytest.raises(errors.ConfigurationError, match="lease_seconds"):
        UndoLog(Store(f"sqlite:///{tmp_path}/ok.db"), lease_seconds=0)


def test_default_url_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("UNDOLOG_DATABASE_URL", f"sqlite:///{tmp_path}/env.db")
    assert Store().url.endswith("env.db")
    monkeypatch.delenv("UNDOLOG_DATABASE_URL")
    monkeypatch.chdir(tmp_path)
    assert Store().url == "sqlite:///undolog.db"
    assert Store("postgresql://u@h/db").url == "postgresql+psycopg://u@h/db"


def test_a_compensable_effect_is_never_stored_without_its_undo_entry(undolog):
    from tests.core.toolkit import setup

    _world, tools = setup(undolog)
    s = undolog.session(agent_id="pairs")
    d = undolog.engine.intercept(s.id, "send_refund_email", {"user_id": "u1", "amount": 3})
    with undolog.store.read() as c:
        pair = c.execute(
            sa.select(t.effect_log.c.seq, t.undo_stack.c.undo_id, t.undo_stack.c.compensation_name,
                      t.undo_stack.c.compensation_version)
            .select_from(t.effect_log.join(t.undo_stack, t.undo_stack.c.undo_id == t.effect_log.c.seq))
            .where(t.effect_log.c.effect_id == d.effect_id)
        ).one()
    assert pair.undo_id == pair.seq and (pair.compensation_name, pair.compensation_version) == ("cancel_refund_email", 1)
    # The one-statement pre-write of a session that does not take writes writes neither row.
    now = utcnow()
    assert undolog.engine.hot.prewrite(
        "no-such-session", 0, "e-orphan", "c", "send_refund_email", 1, "{}", "d", "o", now.timestamp(),
        now.timestamp() + 30, "cancel_refund_email", 1,
    ) is False
    if not undolog.store.is_postgres:
        # SQLite's trigger refuses an effect whose tool revision declares no compensation, instead of storing it
        # without an undo entry.
        with pytest.raises(sa.exc.IntegrityError, match="needs its tool revision"):
            with undolog.store.tx() as c:
                c.execute(t.effect_log.insert().values(
                    effect_id="e-unknown", session_id=s.id, call_id="x", tool_name="never_registered",
                    tool_revision=1, tier="compensable", state="pending", args_snapshot={}, args_digest="d",
                    recovery_attempts=0, created_at=now, updated_at=now))
    with undolog.store.read() as c:
        effects = c.execute(sa.select(sa.func.count()).select_from(t.effect_log)
                            .where(t.effect_log.c.effect_id.in_(["e-orphan", "e-unknown"]))).scalar()
        orphans = c.execute(sa.select(sa.func.count()).select_from(
            t.undo_stack.outerjoin(t.effect_log, t.effect_log.c.seq == t.undo_stack.c.undo_id))
            .where(t.effect_log.c.seq.is_(None))).scalar()
    assert (effects, orphans) == (0, 0)
