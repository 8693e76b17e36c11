"""The storage contract for the call path, the saga and recovery: what every database's ``Storage`` must do.

Each test drives the storage methods directly (no engine in between), on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest

from undolog_core import ToolTier, compensation, undolog_tool
from undolog_core.errors import DatabaseUnavailable
from undolog_core.storage.base import new_id, utcnow
from undolog_core.storage.pool import IntegrityConflict
from undolog_core.storage.schema import EffectState, SessionState
from undolog_core.testing import internals


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="conf_undo")
def conf_write(x: int) -> int:
    return x


@compensation("conf_undo")
def conf_undo(ctx: object) -> None:
    return None


@pytest.fixture
def u(undolog):
    undolog.register(conf_write, conf_undo)
    return undolog


def _session(u, sid: str | None = None) -> str:
    s = u.session(session_id=sid or new_id())
    return s.id


def _prewrite(u, sid: str, call_id: str, *, count: int = 0) -> str:
    spec = u.tool_spec("conf_write")
    effect_id = new_id()
    now = time.time()
    assert u.engine.hot.prewrite(sid, count, effect_id, call_id, spec.name, spec.revision, '{"x":1}', "d" * 64,
                                 u.leases.owner, now, now + 30, "conf_undo", 1)
    return effect_id


def test_prewrite_writes_the_effect_and_its_undo_entry_in_one_commit(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    [entry] = u.store.undo.undo_plan(sid)
    assert entry["effect_id"] == eid and entry["compensation_name"] == "conf_undo"
    assert entry["effect_state"] == EffectState.PENDING


def test_prewrite_refused_by_a_session_that_takes_no_calls(u):
    sid = _session(u)
    with internals(u).write() as conn:
        u.store.sessions.halt_in(conn, sid, "a person must look", utcnow())
    spec = u.tool_spec("conf_write")
    now = time.time()
    for count in (0, 3):  # with and without counts to carry
        assert not u.engine.hot.prewrite(sid, count, new_id(), new_id(), spec.name, spec.revision, "{}", "d" * 64,
                                         u.leases.owner, now, now + 30, "conf_undo", 1)
    assert u.store.undo.undo_plan(sid) == []


def test_the_same_call_id_twice_is_a_conflict_never_a_second_row(u):
    sid = _session(u)
    _prewrite(u, sid, "c1")
    with pytest.raises(IntegrityConflict):
        _prewrite(u, sid, "c1")
    assert len(u.store.undo.undo_plan(sid)) == 1


def test_commit_mark_only_moves_an_effect_in_flight(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    assert u.engine.hot.mark(eid, '{"ok":true}', time.time(), fast=False)
    assert not u.engine.hot.mark(eid, '{"ok":true}', time.time(), fast=False)  # already committed
    assert u.store.effects.mark_committed(eid, "{}", utcnow(), fast=False) == EffectState.COMMITTED
    assert u.store.effects.mark_committed("nope", "{}", utcnow(), fast=False) == ""


def test_guard_counts_calls_and_refuses_a_halted_session(u):
    sid = _session(u)
    with internals(u).write() as conn:
        assert u.store.sessions.guard_in(conn, sid, 5, None) is None
    assert u.sessions.get(sid).tool_calls_total == 5
    with internals(u).write() as conn:
        u.store.sessions.halt_in(conn, sid, "stop", utcnow())
    with internals(u).write() as conn:
        refused = u.store.sessions.guard_in(conn, sid, 1, None)
    assert refused.state == SessionState.HALTED and refused.halted_reason == "stop"


def test_release_and_reclaim_by_compare_and_swap(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    assert u.store.effects.release_effect(eid) == EffectState.PENDING
    assert u.store.effects.release_effect("missing") is None
    now = utcnow()
    claims = []

    def claim() -> None:
        with internals(u).write() as conn:
            claims.append(u.store.effects.claim_effect_in(conn, eid, from_state=EffectState.RELEASED,
                                                  to_state=EffectState.PENDING, owner="x|1|1|i",
                                                  lease_until=now + dt.timedelta(seconds=30), now=now))

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # The winner gets its new ownership epoch (the fencing token, 2 after the pre-write's 1), the losers 0.
    assert sorted(claims) == [0, 0, 0, 2]


def test_rollback_intent_is_written_and_ended_with_the_session_state(u):
    sid = _session(u)
    now = utcnow()
    with internals(u).write() as conn:
        assert u.store.sessions.rollback_intent_in(conn, sid) is None
        u.store.sessions.write_intent_in(conn, sid, exists=False, actor="ana", reason="asked", owner="me",
                                lease_until=now, now=now)
    assert u.sessions.get(sid).state == SessionState.ROLLING_BACK
    with internals(u).write() as conn:
        intent = u.store.sessions.rollback_intent_in(conn, sid)
        assert (intent.actor, intent.reason, intent.owner) == ("ana", "asked", "me")
    assert [r.session_id for r in u.store.effects.in_flight().intents] == [sid]
    assert u.store.sessions.claim_intent(sid, "me", "recoverer", now)
    assert not u.store.sessions.claim_intent(sid, "me", "another", now)  # the owner moved: compare-and-swap fails
    with internals(u).write() as conn:
        u.store.sessions.mark_rolled_back_in(conn, sid, now)
    assert u.sessions.get(sid).state == SessionState.ROLLED_BACK
    assert u.store.effects.in_flight().intents == []


def test_undo_claims_are_exclusive_and_outcomes_recorded(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    [entry] = u.store.undo.undo_plan(sid)
    until = utcnow() + dt.timedelta(seconds=30)
    assert u.store.undo.claim_undo(entry["undo_id"], seen_state="armed", seen_owner=None, owner="a", lease_until=until)
    assert not u.store.undo.claim_undo(entry["undo_id"], seen_state="armed", seen_owner=None, owner="b",
                                  lease_until=until)
    assert [r.undo_id for r in u.store.effects.in_flight().undos] == [entry["undo_id"]]
    u.store.undo.undo_attempt_failed(entry["undo_id"], "boom")
    u.store.effects.undo_compensated(entry["undo_id"], eid)
    assert u.store.undo.undo_plan(sid) == []
    assert u.store.effects.in_flight().undos == []


def test_in_flight_finds_every_pending_effect_once_settled_it_is_gone(u):
    sid = _session(u)
    ids = [_prewrite(u, sid, f"c{i}") for i in range(3)]
    assert sorted(r.effect_id for r in u.store.effects.in_flight().effects) == sorted(ids)
    u.engine.hot.mark(ids[1], "{}", time.time(), fast=False)
    assert sorted(r.effect_id for r in u.store.effects.in_flight().effects) == sorted([ids[0], ids[2]])
    u.store.effects.release_effect(ids[0])  # handed back by a framework: not in flight
    u.engine.hot.mark(ids[2], "{}", time.time(), fast=False)
    assert u.store.effects.in_flight().effects == []  # (on SQLite the cursor moves past all three)
    # The oldest effect goes back in flight (its re-issue claims it): recovery still finds it.
    now = utcnow()
    row = u.store.effects.effect_by_call(sid, "c0")
    with internals(u).write() as conn:
        assert u.store.effects.claim_effect_in(conn, ids[0], from_state=EffectState.RELEASED, to_state=EffectState.PENDING,
                                       owner="x", lease_until=now, now=now)
        u.store.effects.back_in_flight_in(conn, row.seq)
    assert [r.effect_id for r in u.store.effects.in_flight().effects] == [ids[0]]


def test_recovery_claims_an_in_doubt_effect_once_and_dead_letters_after_the_limit(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    [r] = u.store.effects.in_flight().effects
    until = utcnow() + dt.timedelta(seconds=30)
    assert u.store.effects.claim_in_doubt(eid, r.state, r.owner, "rec-1", until)
    assert not u.store.effects.claim_in_doubt(eid, r.state, r.owner, "rec-2", until)
    for n in (1, 2):
        assert u.store.recovery.recovery_attempt_failed(eid, sid, "nope", dead_letter_after=3, halt_reason="x {attempts}") == n
    assert u.store.recovery.recovery_attempt_failed(eid, sid, "nope", dead_letter_after=3, halt_reason="x {attempts}") == 3
    assert u.store.effects.effect(eid).state == EffectState.DEAD_LETTER
    rec = u.sessions.get(sid)
    assert rec.state == SessionState.HALTED and rec.halted_reason == "x 3"


def _hold_the_row(u, eid: str):
    """Another connection's open transaction that wrote the effect's row (PostgreSQL: its row lock; SQLite: the
    write lock), as a process killed in mid-transaction leaves it until its database session ends."""

    from undolog_core.storage import schema as t

    holder = internals(u).sql_engine.connect()
    tx = holder.begin()
    e = t.effect_log
    holder.execute(e.update().where(e.c.effect_id == eid).values(updated_at=e.c.updated_at))

    def let_go() -> None:
        tx.rollback()
        holder.close()

    return let_go


def test_a_claim_waits_for_a_row_lock_a_killed_transaction_left_then_takes_the_effect(u):
    """CI (PostgreSQL, loaded): a ``recover()`` right after a SIGKILL skipped two effects whose rows the killed
    child's backend still locked (SKIP LOCKED), and left them in flight. The claim now waits for such a lock."""
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    [r] = u.store.effects.in_flight().effects
    let_go = _hold_the_row(u, eid)
    timer = threading.Timer(0.4, let_go)
    timer.start()
    try:
        assert u.store.effects.claim_in_doubt(eid, r.state, r.owner, "rec-1", utcnow() + dt.timedelta(seconds=30))
    finally:
        timer.join()
    assert u.store.effects.effect(eid).owner == "rec-1"


def test_a_claim_gives_up_on_a_row_locked_past_its_wait_and_takes_it_once_free(u, monkeypatch):
    """A lock kept longer than ``CLAIM_LOCK_WAIT``: the claim returns False (recover() never hangs on it) and
    changes nothing; once the lock is gone, the next claim takes the effect."""
    from undolog_core.storage import effects

    monkeypatch.setattr(effects, "CLAIM_LOCK_WAIT", 0.2)
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    [r] = u.store.effects.in_flight().effects
    until = utcnow() + dt.timedelta(seconds=30)
    let_go = _hold_the_row(u, eid)
    try:
        if internals(u).is_postgres:
            assert not u.store.effects.claim_in_doubt(eid, r.state, r.owner, "rec-1", until)
            assert u.store.effects.effect(eid).owner == r.owner
    finally:
        let_go()
    assert u.store.effects.claim_in_doubt(eid, r.state, r.owner, "rec-1", until)
    assert u.store.effects.effect(eid).owner == "rec-1"


def _deadlocks(u) -> int:
    if not internals(u).is_postgres:
        return 0
    with internals(u).read() as c:
        return int(c.exec_driver_sql(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").scalar() or 0)


def test_recoverys_record_of_a_compensation_locks_rows_in_the_call_paths_order(u):
    """CI (PostgreSQL history run 3): ``recover()`` died with a deadlock. Its one-statement record of a compensation
    locked the session before the effect, while a late finish held the effect and went on to halt the session.
    Now the record locks the effect, its undo entry, then the session: it waits for the late finish, which ends."""

    from undolog_core.storage import schema as t

    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    undo_id = int(u.store.effects.effect(eid).seq)
    assert u.store.recovery.settle_and_claim_undos([], [undo_id], "rec-1", utcnow() + dt.timedelta(seconds=30)) == {undo_id}
    before = _deadlocks(u)
    e, s = t.effect_log, t.sessions
    finisher = internals(u).sql_engine.connect()
    tx = finisher.begin()
    # A late finish's first write: the effect's row.
    finisher.execute(e.update().where(e.c.effect_id == eid).values(updated_at=e.c.updated_at))
    errors: list[BaseException] = []

    def record() -> None:
        try:
            u.store.recovery.compensated_in_recovery(undo_id, eid, sid, "recovered")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    recorder = threading.Thread(target=record)
    recorder.start()
    try:
        deadline = time.monotonic() + 60
        if internals(u).is_postgres:  # until the record waits for the effect's row
            # A transaction per look: PostgreSQL keeps one snapshot of pg_stat_activity for a whole transaction, so
            # a loop in one transaction never sees the record start waiting after its first look (CI saw that).
            while True:
                with internals(u).read() as c:
                    if c.exec_driver_sql(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                            "AND datname = current_database()").scalar():
                        break
                assert time.monotonic() < deadline, "the record never waited for the effect's row"
                time.sleep(0.02)
        else:
            time.sleep(0.3)
        # The late finish's second write: its session halted. The record must not hold that row.
        finisher.execute(s.update().where(s.c.session_id == sid).values(updated_at=s.c.updated_at))
        tx.commit()
    finally:
        # Whatever failed above, the row lock is let go (else the record, and the test's schema drop, wait forever).
        finisher.close()
        recorder.join(30)
    assert not errors, errors
    assert u.store.effects.effect(eid).state == EffectState.COMPENSATED
    assert u.sessions.get(sid).state == SessionState.HALTED
    assert _deadlocks(u) == before


def test_settle_effect_records_the_verdict_and_halts_when_asked(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    u.store.recovery.settle_effect(eid, EffectState.COMMITTED, result={"probe": True}, halt=(sid, "look at it"))
    row = u.store.effects.effect(eid)
    assert row.state == EffectState.COMMITTED and row.result_snapshot == {"probe": True} and row.owner is None
    assert u.sessions.get(sid).state == SessionState.HALTED


def test_renewing_leases_touches_only_the_owners_rows(u):
    sid = _session(u)
    eid = _prewrite(u, sid, "c1")
    later = utcnow() + dt.timedelta(hours=1)
    u.store.effects.renew_leases("someone-else", [eid], [], [], later)
    assert u.store.effects.effect(eid).lease_until < later
    u.store.effects.renew_leases(u.leases.owner, [eid], [], [], later)
    assert abs((u.store.effects.effect(eid).lease_until - later).total_seconds()) < 1


def test_a_store_that_is_gone_raises_database_unavailable(u, tmp_path):
    if not internals(u).is_postgres:
        from undolog_core import UndoLog

        # A SQLite file whose folder vanished: the next connection cannot be opened.
        folder = tmp_path / "gone"
        folder.mkdir()
        v = UndoLog.open(f"sqlite:///{folder}/x.db")
        v.close()
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        with pytest.raises(DatabaseUnavailable):
            with internals(v).read() as conn:
                conn.exec_driver_sql("SELECT 1")
        return
    # PostgreSQL: every connection of this store is terminated behind its back.
    import psycopg

    with internals(u).read() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(DatabaseUnavailable):
        with internals(u).read() as conn:
            conn.exec_driver_sql("SELECT 1")
    with internals(u).read() as conn:  # and the next one connects afresh
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
