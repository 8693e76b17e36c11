"""Decisions under contention: the desk's admission lanes, and one lock order for decisions and agents' calls.

What the load test (``test_load.py``) found, pinned down deterministically: a decision queued behind the agents'
traffic for the desk's threads and its write lock, and on PostgreSQL a decision and an agent's call in the same
session could deadlock (a 500).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from undolog_core.storage import schema as core
from undolog_core.testing import internals
from undolog_server.state import ServerSettings

from ..support.upstream import Upstream
from .conftest import Desk, make_desk, problem


def _wait_until(what: str, cond: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.01)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream().start()
    yield u
    u.stop()


def _desk_with_lanes(db: Any, upstream: Upstream, tmp_path: Path, lanes: int) -> Iterator[Desk]:
    """A desk proxying to ``upstream`` that admits ``lanes`` requests at a time (decisions apart) and answers 503
    after 0.5 s of waiting."""
    cfg = tmp_path / "tools.toml"
    # The tests hold the upstream's answers on events; the proxy's 5 s read timeout would turn a hold that a loaded
    # machine stretches past it into an outcome_unknown the test is not about (CI at load 13 did that).
    cfg.write_text(upstream.config().replace("timeout = 5\n", "timeout = 60\n"))
    d = make_desk(db, proxy_config=str(cfg),
                  settings=ServerSettings(background=False, max_concurrent_requests=lanes, queue_timeout=0.5))
    yield d
    d.close()
    d.undolog.close()


@pytest.fixture
def one_lane(db: Any, upstream: Upstream, tmp_path: Path) -> Iterator[Desk]:
    """A desk that admits one request at a time (decisions apart) and answers 503 after 0.5 s of waiting."""
    yield from _desk_with_lanes(db, upstream, tmp_path, 1)


def test_a_decision_does_not_queue_behind_a_full_desk(one_lane: Desk, upstream: Upstream) -> None:
    """The only general slot is taken by an agent's rollback whose compensation is held in flight upstream: another
    request waits and is answered 503 ``server_busy`` with Retry-After (never left hanging), the liveness probe
    still answers, and a person's decision goes through its own lane at once. (A rollback keeps its slot while
    its compensations run; a proxied call gives its slot back while it waits, see the next test.)"""
    d = one_lane
    rid, _ = d.pending()
    rid2, _ = d.pending()
    r = d.client("agent").post("/v1/sessions", json={"agent_id": "busy"})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    done = d.client("agent").post(f"/v1/sessions/{sid}/tools/refund:invoke", json={"order_id": "o1", "amount": 5})
    assert done.status_code == 200, done.text
    held = threading.Event()
    upstream.hold["/refund/cancel"] = held
    answer: dict[str, httpx.Response] = {}

    def rollback() -> None:
        with httpx.Client(base_url=d.url, timeout=60,
                          headers={"Authorization": f"Bearer {d.token('agent')}"}) as c:
            answer["rollback"] = c.post(f"/v1/sessions/{sid}:rollback")

    t = threading.Thread(target=rollback)
    t.start()
    try:
        _wait_until("the compensation reaches the upstream", lambda: upstream.to("/refund/cancel"))
        busy = problem(d.client("approver").get("/v1/approvals"), 503, "server_busy")
        assert busy["retry_after"] == 1
        assert d.client("approver").get("/v1/approvals").headers["retry-after"] == "1"
        assert d.client(None).get("/v1/health").status_code == 200
        decided = d.client("approver").post(f"/v1/approvals/{rid}:approve", json={"reason": "fine"})
        assert decided.status_code == 200, decided.text
        assert decided.json()["state"] == "approved"
        rejected = d.client("approver").post(f"/v1/approvals/{rid2}:reject", json={"reason": "no"})
        assert rejected.status_code == 200, rejected.text
        assert t.is_alive() and "rollback" not in answer  # all of it while the rollback was still in flight
    finally:
        held.set()
        t.join(30)
    assert answer["rollback"].status_code == 200, answer["rollback"].text
    assert d.client("approver").get("/v1/approvals").status_code == 200


@pytest.fixture
def two_lanes(db: Any, upstream: Upstream, tmp_path: Path) -> Iterator[Desk]:
    """A desk that admits two requests at a time (decisions apart) and answers 503 after 0.5 s of waiting."""
    yield from _desk_with_lanes(db, upstream, tmp_path, 2)


def test_proxied_calls_waiting_on_their_upstream_leave_the_lane_to_others(two_lanes: Desk,
                                                                         upstream: Upstream) -> None:
    """Two proxied calls wait for an upstream that holds its answer, in a lane of two. The wait needs no slot (no
    database, no CPU): other agents' requests are admitted meanwhile, not queued and answered 503. They used to
    hold both slots until the upstream answered. Once it does, both calls take a slot again to record their
    outcome: 200, and their effects committed."""
    d = two_lanes
    held = threading.Event()
    upstream.hold["/refund"] = held
    agent = d.client("agent")
    sids = [agent.post("/v1/sessions", json={"agent_id": f"slow-{i}"}).json()["session_id"] for i in range(2)]
    answer: dict[int, httpx.Response] = {}

    def invoke(i: int) -> None:
        with httpx.Client(base_url=d.url, timeout=60,
                          headers={"Authorization": f"Bearer {d.token('agent')}"}) as c:
            answer[i] = c.post(f"/v1/sessions/{sids[i]}/tools/refund:invoke", json={"order_id": f"o{i}", "amount": 5})

    calls = [threading.Thread(target=invoke, args=(i,)) for i in range(2)]
    for t in calls:
        t.start()
    try:
        _wait_until("both calls reach the upstream", lambda: len(upstream.to("/refund")) == 2)
        me = agent.get("/v1/me")
        assert me.status_code == 200, me.text
        sid = agent.post("/v1/sessions", json={"agent_id": "quick"})
        assert sid.status_code == 201, sid.text
        safe = agent.post(f"/v1/sessions/{sid.json()['session_id']}/tools/lookup_order:invoke",
                          json={"order_id": "o9"})
        assert safe.status_code == 200, safe.text
        assert all(t.is_alive() for t in calls) and not answer  # all of it while both calls were in flight
    finally:
        held.set()
        for t in calls:
            t.join(30)
    for i in range(2):
        assert answer[i].status_code == 200, answer[i].text
        assert answer[i].json()["path"] == "/refund"
        effects = d.undolog.sessions.effects(sids[i])
        assert [(e["tool_name"], e["state"]) for e in effects] == [("refund", "committed")], effects
    # Every slot came back: the lane admits two at once again.
    assert d.client("approver").get("/v1/approvals").status_code == 200


def test_a_proxied_call_whose_upstream_answered_waits_for_a_slot_and_is_never_refused(one_lane: Desk,
                                                                                      upstream: Upstream) -> None:
    """A proxied call waits for its upstream with its slot given back; meanwhile a rollback, held in flight by its
    compensation, takes the lane's only slot. The upstream answers: the call waits for a slot to record its outcome
    longer than the queue timeout (after which a new request is answered 503), and is not refused: the upstream has
    acted. Once the rollback is done, the call answers 200 with its effect committed."""
    d = one_lane
    agent = d.client("agent")
    sid_call, sid_undo = (agent.post("/v1/sessions", json={"agent_id": n}).json()["session_id"] for n in "ab")
    done = agent.post(f"/v1/sessions/{sid_undo}/tools/refund:invoke", json={"order_id": "o0", "amount": 1})
    assert done.status_code == 200, done.text
    call_held, undo_held = threading.Event(), threading.Event()
    upstream.hold["/refund/cancel"] = undo_held
    answer: dict[str, httpx.Response] = {}

    def post(name: str, path: str, body: Any) -> None:
        with httpx.Client(base_url=d.url, timeout=60,
                          headers={"Authorization": f"Bearer {d.token('agent')}"}) as c:
            answer[name] = c.post(path, json=body)

    call = threading.Thread(target=post, args=("call", f"/v1/sessions/{sid_call}/tools/refund:invoke",
                                               {"order_id": "o1", "amount": 5}))
    upstream.hold["/refund"] = call_held
    call.start()
    undo = threading.Thread(target=post, args=("rollback", f"/v1/sessions/{sid_undo}:rollback", None))
    try:
        _wait_until("the call reaches the upstream", lambda: len(upstream.to("/refund")) == 2)
        undo.start()
        _wait_until("the compensation reaches the upstream", lambda: upstream.to("/refund/cancel"))
        call_held.set()  # the upstream answers; the lane's one slot is the rollback's
        time.sleep(1.0)  # twice the queue timeout
        assert call.is_alive() and "call" not in answer, answer.get("call")
    finally:
        call_held.set()
        undo_held.set()
        for t in (call, undo):
            if t.ident is not None:
                t.join(30)
    assert answer["rollback"].status_code == 200, answer["rollback"].text
    assert answer["call"].status_code == 200, answer["call"].text
    effects = d.undolog.sessions.effects(sid_call)
    assert [(e["tool_name"], e["state"]) for e in effects] == [("refund", "committed")], effects


def test_a_proxied_call_keeps_its_slot_when_no_thread_is_left_to_spare(db: Any, upstream: Upstream,
                                                                         tmp_path: Path) -> None:
    """Every call waiting outside the lanes still holds a thread of the pool (anyio's 40), and the lanes' own
    requests must always find one. Here the two lanes take all 40 (1 general, 39 decisions): a proxied call waiting
    for its upstream keeps its slot, and another request is answered 503 as before."""
    cfg = tmp_path / "tools.toml"
    # The tests hold the upstream's answers on events; the proxy's 5 s read timeout would turn a hold that a loaded
    # machine stretches past it into an outcome_unknown the test is not about (CI at load 13 did that).
    cfg.write_text(upstream.config().replace("timeout = 5\n", "timeout = 60\n"))
    d = make_desk(db, proxy_config=str(cfg), settings=ServerSettings(
        background=False, max_concurrent_requests=1, decision_lane=39, queue_timeout=0.5))
    try:
        held = threading.Event()
        upstream.hold["/lookup"] = held
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "busy"}).json()["session_id"]
        answer: dict[str, httpx.Response] = {}

        def invoke() -> None:
            with httpx.Client(base_url=d.url, timeout=60,
                              headers={"Authorization": f"Bearer {d.token('agent')}"}) as c:
                answer["invoke"] = c.post(f"/v1/sessions/{sid}/tools/lookup_order:invoke", json={"order_id": "o1"})

        t = threading.Thread(target=invoke)
        t.start()
        try:
            _wait_until("the call reaches the upstream", lambda: upstream.to("/lookup"))
            problem(d.client("agent").get("/v1/me"), 503, "server_busy")
        finally:
            held.set()
            t.join(30)
        assert answer["invoke"].status_code == 200, answer["invoke"].text
        assert d.client("agent").get("/v1/me").status_code == 200
    finally:
        d.close()
        d.undolog.close()


@pytest.mark.postgres_only
def test_a_decision_and_an_agent_call_in_its_session_take_locks_in_one_order(desk: Desk) -> None:
    """An agent's call locks its session row first and an audit chain head last. While a transaction holds the
    session row (an agent's call in the same session), a decision waits for that row before it takes anything:
    every audit head is free meanwhile. It used to take a head first and then wait for the row, which the agent's
    call, wanting that head, waited for: PostgreSQL aborted the decision as a deadlock (a 500 under the load test).
    """
    rid, sid = desk.pending()
    s, head = core.sessions, core.audit_head
    answer: dict[str, httpx.Response] = {}
    with internals(desk.undolog).sql_engine.connect() as agent:
        tx = agent.begin()
        try:
            agent.execute(s.update().where(s.c.session_id == sid).values(tool_calls_total=s.c.tool_calls_total))
            pid = agent.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()

            def decide() -> None:
                answer["decision"] = desk.client("approver").post(f"/v1/approvals/{rid}:approve",
                                                                  json={"reason": "ok"})

            t = threading.Thread(target=decide)
            t.start()
            with internals(desk.undolog).sql_engine.connect() as watch:
                def blocked() -> bool:
                    n = watch.execute(sa.text("SELECT count(*) FROM pg_stat_activity "
                                              "WHERE :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}).scalar_one()
                    watch.rollback()
                    return bool(n) or not t.is_alive()

                _wait_until("the decision waits for the session row", blocked)
            heads = set(agent.execute(sa.select(head.c.head_id)).scalars())
            free = set(agent.execute(sa.select(head.c.head_id).with_for_update(skip_locked=True)).scalars())
            assert free == heads, f"the decision holds audit head(s) {sorted(heads - free)} while it waits"
        finally:
            tx.commit()
        t.join(30)
    assert answer["decision"].status_code == 200, answer["decision"].text
    assert desk.undolog.approvals.get(rid).state == "approved"
    assert desk.undolog.verify_audit().ok


@pytest.mark.sqlite_only
def test_a_database_that_does_not_answer_is_503_with_retry_after(desk: Desk) -> None:
    """The database file's folder is gone (a lost mount): new connections cannot open it. The desk answers 503
    ``database_unavailable`` with Retry-After, and answers again once the folder is back. (On PostgreSQL the same
    refusal comes from a server that is down or out of connections; this shared test server cannot be.)"""
    folder = Path(desk.undolog.store.url.removeprefix("sqlite:///")).parent
    moved = folder.with_name(folder.name + "-gone")
    internals(desk.undolog).sql_engine.dispose()  # idle connections would still read the moved file
    folder.rename(moved)
    try:
        gone = desk.client("approver").get("/v1/approvals")
        body = problem(gone, 503, "database_unavailable")
        assert gone.headers["retry-after"] == "1", body
        health = desk.client(None).get("/v1/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
    finally:
        moved.rename(folder)
    assert desk.client("approver").get("/v1/approvals").status_code == 200


@pytest.mark.sqlite_only
def test_a_decision_goes_ahead_of_the_writes_queued_for_sqlite(desk: Desk, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve writes queue for SQLite's in-process write lock while it is held; then a person approves a request.
    When the lock is freed, the decision's transaction goes ahead of the queued writes (all but at most the two
    at the front see the request approved), instead of waiting for every one of them."""
    rid, _ = desk.pending()
    store = desk.undolog.store
    r = core.approval_requests
    assert desk.client("approver").get("/v1/me").status_code == 200  # the key's "last used" write is done
    saw: list[str] = []
    answer: dict[str, httpx.Response] = {}

    def write() -> None:
        with store.tx() as conn:
            saw.append(conn.execute(sa.select(r.c.state).where(r.c.approval_request_id == rid)).scalar_one())

    def decide() -> None:
        answer["decision"] = desk.client("approver").post(f"/v1/approvals/{rid}:approve", json={"reason": "ok"})

    # The decision's arrival at the lock is watched, not guessed with a sleep: under a loaded CI machine the
    # request took longer than any fixed pause to get through the server to its transaction.
    lock = store.write_lock
    plain_acquire = lock.acquire
    urgent_arrived = threading.Event()

    def watched_acquire(blocking: bool = True, *, urgent: bool = False) -> bool:
        if urgent:
            urgent_arrived.set()
        return plain_acquire(blocking, urgent=urgent)

    monkeypatch.setattr(lock, "acquire", watched_acquire)
    lock.acquire()
    writers = [threading.Thread(target=write) for _ in range(12)]
    decision = threading.Thread(target=decide)
    try:
        for t in writers:
            t.start()
        # Time for the writers to queue (if one has not yet, it queues behind the decision: the check below
        # only gets easier), then for the decision to reach the lock.
        time.sleep(0.3)
        decision.start()
        assert urgent_arrived.wait(30), "the decision never reached SQLite's write lock"
        deadline = time.monotonic() + 30
        while not lock._urgent and time.monotonic() < deadline:  # counted as waiting: the writers now step aside
            time.sleep(0.005)
    finally:
        store.write_lock.release()
    for t in [*writers, decision]:
        t.join(30)
    assert answer["decision"].status_code == 200, answer["decision"].text
    assert len(saw) == 12 and saw.count("pending") <= 2, saw


def test_proxied_calls_share_one_tls_context(one_lane: Desk, upstream: Upstream,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every upstream call used to build a TLS context (parsing the whole CA bundle, ~20 ms of CPU with the GIL
    held: most of the desk's CPU under the load test). Five calls now share one; each still has its own client."""
    import httpx._transports.default as transport

    agent = one_lane.client("agent")  # the test's own client, made before counting
    made: list[int] = []
    real = transport.create_ssl_context

    def counted(*a: Any, **kw: Any) -> Any:  # observes, changes nothing
        ctx = real(*a, **kw)
        made.append(id(ctx))
        return ctx

    monkeypatch.setattr(transport, "create_ssl_context", counted)
    sid = agent.post("/v1/sessions", json={"agent_id": "tls"}).json()["session_id"]
    for i in range(5):
        r = agent.post(f"/v1/sessions/{sid}/tools/lookup_order:invoke", json={"order_id": f"o{i}"})
        assert r.status_code == 200, r.text
    assert len(upstream.to("/lookup")) == 5 and len(made) == 5
    assert len(set(made)) == 1, f"{len(set(made))} TLS contexts for 5 calls"
