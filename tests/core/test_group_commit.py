"""Group commit: durable writes of concurrent sessions share one commit, each keeping its own outcome.

SQLite's hot path groups the durable pre-writes and commit marks of threads that arrive while another one commits
(``undolog_core/storage/group.py``); PostgreSQL's server already shares a WAL flush between concurrent commits, so
its hot path has no group. The SQLite tests open their own SQLite store (they run on both test databases); the
concurrency test runs on the test database.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool
from undolog_core.storage.group import GroupCommit
from undolog_core.storage.pool import IntegrityConflict, WouldBlock
from undolog_core.testing import internals

RAN: list[str] = []
RAN_LOCK = threading.Lock()


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("gc_undo"))
def gc_book(slot: str) -> dict[str, str]:
    with RAN_LOCK:
        RAN.append(slot)
    return {"booked": slot}


@compensation("gc_undo")
def gc_undo(ctx: Any) -> None:
    return None


def _wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _open(db: Any) -> UndoLog:
    u = db.open()
    u.register(gc_book, gc_undo)
    return u


def test_concurrent_sessions_each_write_once_and_share_commits(db: Any) -> None:
    """Eight sessions' COMPENSABLE calls at once: each tool runs once, each effect is committed with its result;
    on SQLite the calls that queued behind a commit were written together (fewer commits than writes)."""
    u = _open(db)
    RAN.clear()
    n = 8
    sessions = [u.session(agent_id="gc", session_id=f"gc-{i}") for i in range(n)]
    errors: list[BaseException] = []
    group = getattr(u.engine.hot, "group", None)
    lock = u.engine.hot.write_lock if group is not None else None
    groups: list[list[bool]] = []  # per group written together: True for a pre-write, False for a commit mark
    if group is not None:
        write_many = group._write_many

        def recording(items: Any) -> Any:
            groups.append([bool(kind) for kind, _ in items])
            return write_many(items)

        group._write_many = recording

    def one(i: int) -> None:
        try:
            assert sessions[i].call_sync(gc_book, slot=f"s{i}") == {"booked": f"s{i}"}
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    if lock is not None:
        # Hold SQLite's write lock so that the first caller blocks while committing and the others queue behind it
        # (deterministically, where a free-running race would group only sometimes).
        lock.acquire()
    try:
        for th in threads:
            th.start()
        if group is not None:
            _wait_for(lambda: len(group._queue) == n - 1, "the other callers to queue behind the first")
    finally:
        if lock is not None:
            lock.release()
    for th in threads:
        th.join(30)
    assert not errors, errors
    assert sorted(RAN) == sorted(f"s{i}" for i in range(n))
    for i in range(n):
        effects = u.sessions.effects(f"gc-{i}")
        assert [(e["state"], e["result_snapshot"]) for e in effects] == [("committed", {"booked": f"s{i}"})]
    if group is not None:
        # The seven pre-writes that queued behind the first went in one transaction, one fsync. (Commit marks queue
        # as their tools finish, and may join that group or form others: how many is a race, so only the
        # pre-writes are pinned.)
        assert any(g.count(True) == n - 1 for g in groups), groups
        assert group.largest >= n - 1
        assert group.commits < group.writes == 2 * n  # every pre-write and commit mark went through it


def test_a_group_keeps_each_writes_own_outcome(tmp_path: Any) -> None:
    """One group holding a good pre-write, a call id written before, a halted session, a mark of an effect not
    in flight and a good mark: each gets its own answer, and only the good ones are stored."""
    u = UndoLog.open(f"sqlite:///{tmp_path / 'g.db'}")
    try:
        u.register(gc_book, gc_undo)
        hot = u.engine.hot
        spec = u.tool_spec("gc_book")
        u.session(agent_id="gc", session_id="ok")
        u.session(agent_id="gc", session_id="stopped")
        _halt(u, "stopped")
        now = time.time()

        def prewrite(sid: str, effect_id: str, call_id: str) -> Any:
            return hot.prewrite(sid, 0, effect_id, call_id, spec.name, spec.revision, '{"slot":"x"}', "d" * 64,
                                u.engine.owner, now, now + 30, "gc_undo", 1)

        assert prewrite("ok", "e-before", "c-dup") is True
        assert prewrite("ok", "e-marked", "c-marked") is True
        results: dict[str, Any] = {}

        def run(key: str, fn: Any) -> None:
            try:
                results[key] = fn()
            except BaseException as exc:  # noqa: BLE001 - the outcome under test
                results[key] = exc

        jobs = {
            "leader": lambda: prewrite("ok", "e-lead", "c-lead"),
            "good": lambda: prewrite("ok", "e-good", "c-good"),
            "dup": lambda: prewrite("ok", "e-dup", "c-dup"),
            "halted": lambda: prewrite("stopped", "e-halted", "c-halted"),
            "gone": lambda: hot.mark("e-nowhere", '"r"', now, fast=False),
            "mark": lambda: hot.mark("e-marked", '"r"', now, fast=False),
        }
        hot.write_lock.acquire()
        try:
            leader = threading.Thread(target=run, args=("leader", jobs["leader"]))
            leader.start()
            _wait_for(lambda: hot.group._leading, "the leader")
            others = [threading.Thread(target=run, args=(k, f)) for k, f in jobs.items() if k != "leader"]
            for th in others:
                th.start()
            _wait_for(lambda: len(hot.group._queue) == len(others), "the group to queue")
        finally:
            hot.write_lock.release()
        for th in [leader, *others]:
            th.join(30)
        assert results["leader"] is True and results["good"] is True and results["mark"] is True
        assert isinstance(results["dup"], IntegrityConflict)
        assert results["halted"] is False and results["gone"] is False
        assert hot.group.largest == len(others)
        stored = {e["effect_id"]: e["state"] for e in u.sessions.effects("ok")}
        assert stored == {"e-before": "pending", "e-marked": "committed", "e-lead": "pending", "e-good": "pending"}
        assert u.sessions.effects("stopped") == []
    finally:
        u.close()


def _halt(u: UndoLog, sid: str) -> None:
    from undolog_core.storage import schema as t

    with internals(u).write() as conn:
        conn.execute(t.sessions.update().where(t.sessions.c.session_id == sid).values(state="halted",
                                                                                        halted_reason="test"))


def test_a_caller_on_an_event_loop_never_waits_for_a_group() -> None:
    """``wait=False`` while another caller commits raises WouldBlock (the caller retries in a thread)."""
    release = threading.Event()
    started = threading.Event()

    def slow(item: Any, wait: bool) -> Any:
        started.set()
        release.wait(10)
        return item

    group = GroupCommit(slow, lambda items: list(items))
    t1 = threading.Thread(target=group.submit, args=("a",))
    t1.start()
    started.wait(10)
    with pytest.raises(WouldBlock):
        group.submit("b", wait=False)
    release.set()
    t1.join(10)
    assert group.submit("c", wait=False) == "c"  # alone again: written at once


def test_a_failed_group_fails_every_caller_in_it() -> None:
    """When the group's transaction fails, every caller of that group gets the error (none is told it was
    written), and the next caller leads a fresh group."""
    gate = threading.Event()
    first = threading.Event()

    def one(item: Any, wait: bool) -> Any:
        first.set()
        gate.wait(10)
        return item

    def many(items: Any) -> list[Any]:
        raise RuntimeError("disk full")

    group = GroupCommit(one, many)
    out: dict[str, Any] = {}

    def run(key: str) -> None:
        try:
            out[key] = group.submit(key)
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            out[key] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in ("lead", "x", "y")]
    threads[0].start()
    first.wait(10)
    for th in threads[1:]:
        th.start()
    _wait_for(lambda: len(group._queue) == 2, "two followers")
    gate.set()
    for th in threads:
        th.join(10)
    assert out["lead"] == "lead"
    assert isinstance(out["x"], RuntimeError) and isinstance(out["y"], RuntimeError)
    assert group.submit("z") == "z" and not group._leading
