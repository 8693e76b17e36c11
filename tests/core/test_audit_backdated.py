"""Signed checkpoints cover everything below them (issue 34, hole 2): a backdated forgery is caught.

The attack, with write access to the database and no key: an ``approve`` event inserted with an id in a gap below
the signed position (PostgreSQL sequences gap on rolled-back appends, dropped connections and after a crash) into a
chain that was empty at signing, or into a new chain 17. Every existing hash still checks; before the fix
``verify --checkpoints`` answered "intact ... matching 1 signed checkpoint(s)". A checkpoint signed while appends
run concurrently must give no false alarm under the same rule.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from undolog_core import UndoLog
from undolog_core.storage import schema as t
from undolog_core.storage.audit import GENESIS_HASH, event_hash

from ..support.toolkit import setup
from .test_audit_checkpoints import approvals, run

pytestmark = pytest.mark.storage


def _drop_head_guards(c: Any, postgres: bool) -> None:
    """What an attacker with write access does first: the head table's trigger (revision 0015) off."""
    if postgres:
        c.exec_driver_sql("ALTER TABLE undolog_audit_head DISABLE TRIGGER USER")
    else:
        for name in t.SQLITE_AUDIT_HEAD_GUARDS:
            c.exec_driver_sql(f"DROP TRIGGER IF EXISTS {name}")


def insert_event(u: UndoLog, chain: int, event_id: int, *, action: str = "approve", actor: str = "mallory",
                 request: str | None = None, new_head: bool = False) -> None:
    """Append one event with a chosen id to ``chain``, linked to that chain's head, and move the head: every hash
    checks. ``new_head``: the chain has no head row yet (the attacker adds one, triggers off)."""
    e, h = t.approval_events, t.audit_head
    with u.store.tx() as c:
        if new_head:
            _drop_head_guards(c, u.store.is_postgres)
            c.execute(h.insert().values(head_id=chain, last_event_id=0, last_hash=GENESIS_HASH))
        prev = c.execute(sa.select(h.c.last_hash).where(h.c.head_id == chain)).scalar_one()
        now = dt.datetime.now(dt.UTC)
        hsh = event_hash(event_id=event_id, approval_request_id=request, subject="req", action=action, actor=actor,
                         payload="{}", created_at=now, prev_hash=prev)
        c.execute(e.insert().values(event_id=event_id, approval_request_id=request, subject="req", action=action,
                                    actor=actor, payload="{}", created_at=now, prev_hash=prev, hash=hsh, chain=chain))
        c.execute(h.update().where(h.c.head_id == chain).values(last_event_id=event_id, last_hash=hsh))
        if u.store.is_postgres:  # the ids up to it were taken (the gap): later appends take larger ones
            c.exec_driver_sql("SELECT setval('undolog_audit_event_id_seq', GREATEST((SELECT last_value FROM "
                              f"undolog_audit_event_id_seq), {event_id}))")


def keys(tmp_path: Path) -> tuple[Path, Path]:
    from undolog_core._checkpoints import generate_keypair

    return generate_keypair(tmp_path / "k")


@pytest.fixture
def undolog(db: Any) -> UndoLog:
    u = db.open()
    setup(u)
    return u


def signed_with_a_gap(u: UndoLog, tmp_path: Path) -> tuple[Path, Path]:
    """Events 1-2 (chain 1), a gap 3..9 (ids taken by appends that rolled back), event 10 (chain 1), signed."""
    key, pub = keys(tmp_path)
    approvals(u, 1)
    insert_event(u, 1, 10, action="policy.set", actor="ana")
    cp = Path(u.checkpoint_audit(key=key, out=tmp_path / "cp"))
    body = json.loads(cp.read_text())["checkpoint"]
    assert body["position"] == 10
    # Every chain pinned, the empty ones at 0.
    assert sorted(h[0] for h in body["heads"]) == list(range(1, t.AUDIT_CHAINS + 1))
    assert {h[0]: h[1] for h in body["heads"]}[2] == 0
    return tmp_path / "cp", pub


def test_a_backdated_event_in_a_chain_empty_at_signing_is_caught(undolog: UndoLog, db: Any, tmp_path: Path) -> None:
    out, pub = signed_with_a_gap(undolog, tmp_path)
    insert_event(undolog, 2, 5)  # in the gap, into chain 2 (empty when signed): the head only moves forward
    assert undolog.verify_audit().ok  # every hash checks
    r = undolog.verify_audit(checkpoints=out, public_key=pub)
    assert not r.ok and r.first_bad_event_id == 5, r.problem
    assert "chain 2" in (r.problem or "") and "backdated" in (r.problem or "")
    cli = run(db, "audit", "verify", "--checkpoints", str(out), "--public-key", str(pub))
    assert cli.exit_code == 1, cli.output
    assert "BROKEN at event 5" in cli.stderr and "Traceback" not in cli.output


def test_a_backdated_event_in_a_new_chain_is_caught(undolog: UndoLog, db: Any, tmp_path: Path) -> None:
    out, pub = signed_with_a_gap(undolog, tmp_path)
    insert_event(undolog, t.AUDIT_CHAINS + 1, 6, new_head=True)
    assert undolog.verify_audit().ok
    r = undolog.verify_audit(checkpoints=out, public_key=pub)
    assert not r.ok and r.first_bad_event_id == 6 and f"chain {t.AUDIT_CHAINS + 1}" in (r.problem or ""), r.problem
    assert "does not name" in (r.problem or "")
    cli = run(db, "audit", "verify", "--checkpoints", str(out), "--public-key", str(pub))
    assert cli.exit_code == 1 and "BROKEN at event 6" in cli.stderr, cli.output


def test_a_new_chain_is_refused_above_the_signed_position_too(undolog: UndoLog, tmp_path: Path) -> None:
    out, pub = signed_with_a_gap(undolog, tmp_path)
    insert_event(undolog, t.AUDIT_CHAINS + 1, 50, new_head=True)
    r = undolog.verify_audit(checkpoints=out, public_key=pub)
    assert not r.ok and r.first_bad_event_id == 50 and "does not name" in (r.problem or ""), r.problem


def test_appends_after_the_checkpoint_in_any_chain_verify(undolog: UndoLog, tmp_path: Path) -> None:
    out, pub = signed_with_a_gap(undolog, tmp_path)
    insert_event(undolog, 3, 11, action="policy.set", actor="ana")  # after the position: legitimate
    approvals(undolog, 1)
    r = undolog.verify_audit(checkpoints=out, public_key=pub)
    assert r.ok, r.problem


def test_a_single_chain_checkpoint_covers_every_chain_below_it(undolog: UndoLog, tmp_path: Path) -> None:
    """A file of format /1 gets the same rule: the chains it did not know were empty when it was signed."""
    import base64

    from undolog_core._checkpoints import CHECKPOINT_FORMAT_V1, Checkpoint, key_id, load_private_key

    key, pub = keys(tmp_path)
    private = load_private_key(key)
    approvals(undolog, 1)
    insert_event(undolog, 1, 10, action="policy.set", actor="ana")
    report = undolog.verify_audit()
    old = Checkpoint(report.head_position, report.head_hash, "2026-11-01T00:00:00+00:00", "x",
                     key_id(private.public_key()), format=CHECKPOINT_FORMAT_V1)
    signed = Checkpoint(**{**old.__dict__, "signature": base64.b64encode(private.sign(old.signed_bytes())).decode()})
    out = tmp_path / "cp"
    out.mkdir()
    (out / "checkpoint-000000000010-old.json").write_text(signed.to_json())
    insert_event(undolog, 4, 12, action="policy.set", actor="ana")  # after it, in another chain: fine
    assert undolog.verify_audit(checkpoints=out, public_key=pub).ok
    insert_event(undolog, 2, 7)
    r = undolog.verify_audit(checkpoints=out, public_key=pub)
    assert not r.ok and r.first_bad_event_id == 7 and "backdated" in (r.problem or ""), r.problem


def test_the_checkpointer_refuses_to_sign_over_a_backdated_event(undolog: UndoLog, tmp_path: Path) -> None:
    from undolog_core.errors import AuditChainBroken

    out, pub = signed_with_a_gap(undolog, tmp_path)
    insert_event(undolog, 2, 5)
    with pytest.raises(AuditChainBroken) as err:
        undolog.checkpoint_audit(key=tmp_path / "k", out=out)
    assert "event 5" in str(err.value)


def test_the_head_rows_only_move_forward(undolog: UndoLog) -> None:
    """Revision 0015's trigger: no new chain, none removed, renumbered or cut back; moving forward is allowed."""
    h = t.audit_head
    approvals(undolog, 1)
    attempts = [
        h.insert().values(head_id=t.AUDIT_CHAINS + 1, last_event_id=0, last_hash=GENESIS_HASH),
        h.delete().where(h.c.head_id == 2),
        h.update().where(h.c.head_id == 1).values(last_event_id=1),
        h.update().where(h.c.head_id == 2).values(head_id=99),
    ]
    for stmt in attempts:
        with pytest.raises(sa_exc.DBAPIError) as err, undolog.store.engine.begin() as c:
            c.execute(stmt)
        assert "only moves forward" in str(err.value)
    with undolog.store.engine.begin() as c:
        c.execute(h.update().where(h.c.head_id == 1).values(last_event_id=h.c.last_event_id))
        c.execute(h.update().where(h.c.head_id == 2).values(last_event_id=3))
    with undolog.store.engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(h)).scalar_one() == t.AUDIT_CHAINS


def test_checkpoints_signed_while_appends_run_give_no_false_alarm(undolog: UndoLog, tmp_path: Path) -> None:
    """Writers append to several chains (side by side on PostgreSQL) while checkpoints are signed: each
    checkpoint is a cut with nothing missing below it, so the rule never refuses an event appended meanwhile."""
    key, pub = keys(tmp_path)
    out = tmp_path / "cp"
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        i = 0
        try:
            while not stop.is_set():
                i += 1
                with undolog.store.tx() as c:
                    undolog.store.audit.append_event_in(c, subject=f"w{n}", action="policy.set", actor=f"w{n}",
                                                  payload={"i": i})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    try:
        for _ in range(15):
            undolog.checkpoint_audit(key=key, out=out)
            r = undolog.verify_audit(checkpoints=out, public_key=pub)
            assert r.ok, r.problem
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors
    r = undolog.verify_audit(checkpoints=out, public_key=pub)
    assert r.ok and r.checkpoints_checked == 15, r.problem
    with undolog.store.engine.connect() as c:
        used = c.execute(sa.select(sa.func.count(sa.distinct(t.approval_events.c.chain)))).scalar_one()
    assert used >= (2 if undolog.store.is_postgres else 1)


def test_a_database_of_the_previous_release_upgrades_and_its_checkpoints_keep_verifying(db: Any,
                                                                                         tmp_path: Path) -> None:
    """Revision 0015 on a database made at 0011 with events in it: the trigger comes, the trail verifies and is
    signed, a backdated event is caught. The migration is idempotent: down and up again leaves the same."""
    from undolog_core.storage import migrate as _migrate
    from undolog_core.storage.base import _MIGRATION_LOCK_KEY, Store

    key, pub = keys(tmp_path)
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0011_due_index")
    finally:
        store.dispose()
    # The previous release's trail: events appended before 0015 existed.
    store = Store(db.url, schema=db.schema)
    try:
        with store.engine.begin() as c:
            prev = GENESIS_HASH
            now = dt.datetime.now(dt.UTC)
            for i in (1, 2, 9):  # 3..8: a gap (ids taken by appends that rolled back)
                hsh = event_hash(event_id=i, approval_request_id=None, subject="policy", action="policy.set",
                                 actor="ana", payload="{}", created_at=now, prev_hash=prev)
                c.execute(t.approval_events.insert().values(event_id=i, approval_request_id=None, subject="policy",
                                                            action="policy.set", actor="ana", payload="{}",
                                                            created_at=now, prev_hash=prev, hash=hsh, chain=1))
                prev = hsh
            c.execute(t.audit_head.update().where(t.audit_head.c.head_id == 1).values(last_event_id=9,
                                                                                      last_hash=prev))
            if db.kind == "postgres":
                c.exec_driver_sql("SELECT setval('undolog_audit_event_id_seq', 9)")
            names = {r[0] for r in c.execute(sa.text(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = 'undolog_audit_head'::regclass AND NOT tgisinternal"
                if db.kind == "postgres" else "SELECT name FROM sqlite_master WHERE type = 'trigger'"))}
            assert not any("audit_head" in n for n in names)
    finally:
        store.dispose()
    u = db.open()  # upgrades to head
    setup(u)
    u.checkpoint_audit(key=key, out=tmp_path / "cp")
    for _ in range(2):  # idempotent: down to 0011 and up again
        _migrate.downgrade(u.store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0011_due_index")
        _migrate.upgrade(u.store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="heads")
    with pytest.raises(sa_exc.DBAPIError), u.store.engine.begin() as c:
        c.execute(t.audit_head.delete().where(t.audit_head.c.head_id == 5))
    approvals(u, 1)
    assert u.verify_audit(checkpoints=tmp_path / "cp", public_key=pub).ok
    insert_event(u, 7, 5)
    r = u.verify_audit(checkpoints=tmp_path / "cp", public_key=pub)
    assert not r.ok and r.first_bad_event_id == 5 and "backdated" in (r.problem or ""), r.problem
