"""Every read the server does goes through the store's read path.

On SQLite a write transaction begins with ``BEGIN IMMEDIATE`` (the database's one write lock); reads begin
with a deferred ``BEGIN`` and, in WAL mode, never wait for a writer. The desk used to read the core's tables
on plain connections, so every dashboard refresh took the write lock and queued behind any writer (up to
the 30 s busy timeout). These tests hold a write transaction open in another connection and show that the
desk's reads still answer at once, and that no read issues ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import event

from undolog_core.testing import internals

from .conftest import Desk

# How the desk's reads meet the database's write lock: database behaviour, so both databases.
pytestmark = pytest.mark.storage

#: Far below the 30 s busy timeout a read queued behind the writer would wait (15 s, 5 s before: room for a loaded
#: machine, still half the wait a queued read would show).
PROMPT = 15.0

CORE_TABLES = "undolog_sessions, undolog_effect_log, undolog_approval_requests, undolog_tool_registry"
SERVER_TABLES = "undolog_api_keys, undolog_approver_groups, undolog_webhook_targets"


@contextmanager
def writer_holding_the_lock(desk: Desk) -> Iterator[None]:
    """A write transaction, open in another connection, for the duration of the block.

    SQLite: the engine's ``BEGIN IMMEDIATE`` takes the database's write lock. PostgreSQL: ``EXCLUSIVE``
    table locks, which let plain reads through but block every write and ``SELECT ... FOR UPDATE``.
    """
    engine = internals(desk.undolog).sql_engine
    with engine.connect() as conn:
        conn.begin()
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text(f"LOCK TABLE {CORE_TABLES}, {SERVER_TABLES} IN EXCLUSIVE MODE"))
        else:
            conn.execute(sa.text("UPDATE undolog_org_policy SET context_calls = context_calls"))
        try:
            yield
        finally:
            conn.rollback()


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert m, html[:500]
    return m.group(1)


def _reads(desk: Desk, ui: httpx.Client, approval_id: str, session_id: str) -> list[tuple[httpx.Client, str]]:
    approver, admin = desk.client("approver"), desk.client("admin")
    return [
        (approver, "/v1/health"),
        (approver, "/v1/approvals"),
        (approver, "/v1/approvals?risk_tag=pii"),
        (approver, f"/v1/approvals/{approval_id}"),
        (approver, f"/v1/approvals/{approval_id}/events"),
        (approver, f"/v1/sessions/{session_id}"),
        (approver, "/v1/sessions"),
        (approver, "/v1/tools"),
        (admin, "/v1/keys"),
        (admin, "/v1/approver-groups"),
        (admin, "/v1/webhooks"),
        (ui, "/ui/"),
        (ui, f"/ui/approvals/{approval_id}"),
        (ui, "/ui/sessions"),
        (ui, f"/ui/sessions/{session_id}"),
    ]


def _login(desk: Desk) -> httpx.Client:
    ui = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=PROMPT)
    page = ui.get("/ui/login")
    r = ui.post("/ui/login", data={"api_key": desk.token("approver"), "csrf_token": _csrf(page.text)})
    assert r.status_code == 303, r.text
    return ui


def test_reads_answer_while_a_writer_holds_the_lock(desk: Desk) -> None:
    approval_id, session_id = desk.pending()
    ui = _login(desk)
    reads = _reads(desk, ui, approval_id, session_id)
    # Once before the lock: authentication records "last used" (a write, at most once a minute per key).
    for client, path in reads:
        assert client.get(path).status_code == 200, path
    with writer_holding_the_lock(desk):
        for client, path in reads:
            started = time.monotonic()
            r = client.get(path, timeout=PROMPT)
            assert r.status_code == 200, (path, r.text[:300])
            assert time.monotonic() - started < PROMPT, path
    ui.close()


def test_reads_never_begin_immediate(desk: Desk) -> None:
    approval_id, session_id = desk.pending()
    ui = _login(desk)
    reads = _reads(desk, ui, approval_id, session_id)
    for client, path in reads:
        client.get(path)
    # "Last used" is written by a thread of its own after a key's first request: let it finish before listening.
    _wait_touched(desk, "approver", "admin")
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    engine = internals(desk.undolog).sql_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        for client, path in reads:
            assert client.get(path).status_code == 200, path
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert seen, "the reads issued no statement at all"
    assert not [s for s in seen if s.strip().upper().startswith("BEGIN IMMEDIATE")]
    assert not [s for s in seen if re.match(r"\s*(INSERT|UPDATE|DELETE)\b", s, re.I)], seen
    ui.close()


def test_a_keys_first_request_is_not_held_up_by_a_writer(desk: Desk) -> None:
    """A key's first request each minute records "last used", a write. It was made on the request's path: with a
    writer holding the lock, a read by a key not used in the last minute waited for the lock (SQLite: the 30 s busy
    timeout, then a 503, since the database's refusal came as DatabaseUnavailable, which the "never fail
    authentication" guard did not catch; PostgreSQL: for as long as the lock was held)."""
    approval_id, session_id = desk.pending()
    desk.add_key("fresh", ["approver"])
    fresh = httpx.Client(base_url=desk.url, timeout=PROMPT,
                         headers={"Authorization": f"Bearer {desk.token('fresh')}"})
    with writer_holding_the_lock(desk):
        for path in ("/v1/me", "/v1/approvals", f"/v1/approvals/{approval_id}", f"/v1/sessions/{session_id}"):
            r = fresh.get(path)
            assert r.status_code == 200, (path, r.text[:300])
    # "Last used" is still recorded, once the writer is done.
    _wait_touched(desk, "fresh")
    fresh.close()


def _wait_touched(desk: Desk, *names: str) -> None:
    deadline = time.monotonic() + PROMPT
    for name in names:
        while desk.store.get_key(desk.key(name).key_id).last_used_at is None:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"the last use of {name} was never recorded"
            time.sleep(0.02)
