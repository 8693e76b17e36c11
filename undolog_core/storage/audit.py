"""The audit trail's SQL: the hash chains over ``undolog_approval_events`` and the outbox written beside it.

The events form ``schema.AUDIT_CHAINS`` chains (column ``chain``; each chain is its events in ``event_id`` order,
each event's ``prev_hash`` the hash of the one before it in its chain). A transaction appends to exactly one chain:
on PostgreSQL the first head row it can lock without waiting (``FOR UPDATE SKIP LOCKED``), so concurrent writers
append side by side instead of queuing on one row, and one lock per transaction means two appending transactions
can never deadlock on heads. A lone writer always gets chain 1. Event ids come from a sequence taken while the head
is locked, so they grow along every chain. SQLite serialises writers anyway and appends to chain 1 only.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._json import canonical_json, sha256_hex
from . import schema as t
from .base import Store, utcnow
from .outbox import OutboxItem, OutboxSQL
from .records import StoredEvent
from .schema import AUDIT_CHAINS

GENESIS_HASH = "0" * 64

#: The PostgreSQL sequence of event ids (revision 0009).
EVENT_ID_SEQUENCE = "undolog_audit_event_id_seq"

# Where a transaction's chain is remembered between two appends of the same transaction: in the connection's info,
# next to the transaction object it belongs to (a later transaction on the same pooled connection is not it).
_CHAIN_KEY = "undolog_audit_chain"


# Every statement with a shape of its own is a named constant; the rest are SQLAlchemy Core on ``schema``'s tables.
_HEAD = sa.select(t.audit_head.c.last_event_id, t.audit_head.c.last_hash)
_MAX_EVENT_ID = sa.select(sa.func.max(t.approval_events.c.event_id))
_EVENTS_IN_CHAIN_ORDER = sa.select(t.approval_events).order_by(t.approval_events.c.chain, t.approval_events.c.event_id)
_HEADS = sa.select(t.audit_head).order_by(t.audit_head.c.head_id)

# PostgreSQL only. The lock is inside the subquery, the sequence above it: nextval runs for the row once it is locked
# (in the flat form the planner may evaluate it below the lock, for rows then skipped or before the lock is held).
_FREE_HEAD = sa.text("SELECT head_id, last_event_id, last_hash FROM undolog_audit_head ORDER BY head_id LIMIT 1 "
                     "FOR UPDATE SKIP LOCKED")
_FREE_HEAD_ONE = sa.text(
    "SELECT h.head_id, h.last_event_id, h.last_hash, nextval('" + EVENT_ID_SEQUENCE + "') AS next_id FROM ("
    "SELECT head_id, last_event_id, last_hash FROM undolog_audit_head ORDER BY head_id LIMIT 1 "
    "FOR UPDATE SKIP LOCKED) AS h")
_NEXT_IDS = sa.text("SELECT nextval('" + EVENT_ID_SEQUENCE + "') FROM generate_series(1, :n)")


@dataclass(frozen=True)
class ChainHead:
    """One chain's head row: the last event appended to chain ``chain`` (0 and the genesis hash: none yet)."""

    chain: int
    last_event_id: int
    last_hash: str


@dataclass(frozen=True)
class PendingEvent:
    """One audit event to append with ``append_events_in`` (the arguments of ``append_event_in``)."""

    subject: str
    action: str
    actor: str
    payload: Mapping[str, Any]
    approval_request_id: str | None = None
    outbox: Sequence[OutboxItem] = ()


def event_hash(
    *,
    event_id: int,
    approval_request_id: str | None,
    subject: str,
    action: str,
    actor: str,
    payload: str,
    created_at: dt.datetime,
    prev_hash: str,
) -> str:
    """The hash of one event: every stored column but the hash itself, canonical JSON, SHA-256."""
    created = created_at.astimezone(dt.UTC).isoformat(timespec="microseconds")
    return sha256_hex(canonical_json([event_id, approval_request_id, subject, action, actor, payload, created, prev_hash]))


class AuditChainReader:
    """The chain as one read transaction sees it: the events in order, then the head (see ``AuditSQL.chain``)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def events(self) -> Iterator[tuple[int, StoredEvent]]:
        """Every event as (chain, event), chain by chain, each chain in ``event_id`` order."""
        for r in self._conn.execute(_EVENTS_IN_CHAIN_ORDER).yield_per(1000):
            yield int(r.chain), StoredEvent(int(r.event_id), r.approval_request_id, r.subject, r.action, r.actor,
                                            r.payload, r.created_at, r.prev_hash, r.hash)

    def heads(self) -> list[ChainHead]:
        """Every chain's head row, by chain."""
        return [ChainHead(int(r.head_id), int(r.last_event_id), str(r.last_hash)) for r in self._conn.execute(_HEADS)]


class AuditSQL:
    """``store.audit``: the hash-chained events (``undolog_approval_events``) and their chain heads
    (``undolog_audit_head``); appending (inside the caller's transaction, with the outbox rows that report the
    event) and the reads of verification. The contract is ``contract.AuditRepository``.

    Example:
        >>> with storage.tx() as conn:
        ...     storage.audit.append_event_in(conn, subject="policy", action="policy.set", actor="ana", payload={})
    """

    def __init__(self, store: Store, *, outbox: OutboxSQL) -> None:
        self._store = store
        self._outbox = outbox

    def append_event_in(
        self,
        conn: Connection,
        *,
        subject: str,
        action: str,
        actor: str,
        payload: Mapping[str, Any],
        approval_request_id: str | None = None,
        outbox: Iterable[OutboxItem] = (),
        now: dt.datetime | None = None,
    ) -> int:
        """Append one audit event (and its outbox rows) inside the caller's transaction; returns the event id.

        The chain's head row is locked first (see the module's docstring for which chain), so two writers never
        fork a chain.
        """
        chain, prev, (event_id,) = self._claim_chain_in(conn, 1)
        # Microseconds only: both databases keep exactly that, so the hash recomputes from what was stored.
        created_at = now or utcnow()
        body = canonical_json(dict(payload))
        h = event_hash(
            event_id=event_id,
            approval_request_id=approval_request_id,
            subject=subject,
            action=action,
            actor=actor,
            payload=body,
            created_at=created_at,
            prev_hash=prev,
        )
        conn.execute(
            t.approval_events.insert().values(
                event_id=event_id,
                approval_request_id=approval_request_id,
                subject=subject,
                action=action,
                actor=actor,
                payload=body,
                created_at=created_at,
                prev_hash=prev,
                hash=h,
                chain=chain,
            )
        )
        conn.execute(
            t.audit_head.update().where(t.audit_head.c.head_id == chain).values(last_event_id=event_id, last_hash=h)
        )
        self._outbox.write_in(conn, outbox, now=created_at)
        return event_id

    def append_events_in(self, conn: Connection, events: Sequence[PendingEvent], *,
                         now: dt.datetime | None = None) -> list[int]:
        """Append a batch of audit events (and their outbox rows) in order, inside the caller's transaction.

        One chain's head is locked once for the whole batch and each hash is computed from the one before it, so
        a sweep of 500 timeouts queues once on the head instead of 500 times; the chain is the same as if the
        events had been appended one by one. Returns the event ids, in order.
        """
        if not events:
            return []
        created_at = now or utcnow()
        # The outbox rows first: they do not depend on the chain, so concurrent sweepers write them in parallel
        # and hold the chain head (until their commit) only for the events themselves.
        self._outbox.write_many_in(conn, [item for ev in events for item in ev.outbox], now=created_at)
        bodies = [canonical_json(dict(ev.payload)) for ev in events]
        chain, prev, ids = self._claim_chain_in(conn, len(events))
        rows: list[dict[str, Any]] = []
        for ev, body, event_id in zip(events, bodies, ids, strict=True):
            h = event_hash(event_id=event_id, approval_request_id=ev.approval_request_id, subject=ev.subject,
                           action=ev.action, actor=ev.actor, payload=body, created_at=created_at, prev_hash=prev)
            rows.append({"event_id": event_id, "approval_request_id": ev.approval_request_id, "subject": ev.subject,
                         "action": ev.action, "actor": ev.actor, "payload": body, "created_at": created_at,
                         "prev_hash": prev, "hash": h, "chain": chain})
            prev = h
        self._store.insert_many_in(conn, t.approval_events, rows)
        conn.execute(
            t.audit_head.update().where(t.audit_head.c.head_id == chain).values(last_event_id=ids[-1], last_hash=prev)
        )
        return [int(r["event_id"]) for r in rows]

    def _claim_chain_in(self, conn: Connection, n: int) -> tuple[int, str, list[int]]:
        """Lock this transaction's chain head and take ``n`` event ids: (chain, its last hash, the ids in order).

        The first append of a transaction picks the chain; later appends of the same transaction reuse it (its lock
        is held until commit), so a transaction holds one head lock at most.
        """
        h = t.audit_head
        mine = conn.info.get(_CHAIN_KEY)
        txn = conn.get_transaction()
        if mine is not None and mine[0] is txn:
            chain = int(mine[1])
            row = conn.execute(self._store.for_update(_HEAD.where(h.c.head_id == chain))).one()
            last_id, prev = int(row.last_event_id), str(row.last_hash)
        elif not self._store.is_postgres:
            # One writer at a time (BEGIN IMMEDIATE): chain 1.
            chain = 1
            row = conn.execute(_HEAD.where(h.c.head_id == 1)).one()
            last_id, prev = int(row.last_event_id), str(row.last_hash)
        else:
            # The lowest-numbered head nobody holds right now, and (for one event) its id in the same round trip:
            # the id is taken above the lock, once the row is ours.
            free = conn.execute(_FREE_HEAD_ONE if n == 1 else _FREE_HEAD).first()
            if free is None:
                # Every head held (many more writers than chains): wait for one picked by the connection, so the
                # waiters spread over the chains.
                pick = 1 + id(conn) // 64 % AUDIT_CHAINS
                free = conn.execute(sa.select(h.c.head_id, h.c.last_event_id, h.c.last_hash)
                                    .where(h.c.head_id == pick).with_for_update()).one()
            chain, last_id, prev = int(free.head_id), int(free.last_event_id), str(free.last_hash)
            if n == 1 and getattr(free, "next_id", None) is not None:
                conn.info[_CHAIN_KEY] = (txn, chain)
                return chain, prev, [int(free.next_id)]
        conn.info[_CHAIN_KEY] = (txn, chain)
        if not self._store.is_postgres:
            # The writer lock is held (BEGIN IMMEDIATE): the next ids after the largest in use, one index probe.
            top = conn.execute(_MAX_EVENT_ID).scalar()
            first = max(int(top or 0), last_id) + 1
            return chain, prev, list(range(first, first + n))
        # Taken while the head is locked: a later holder of this chain takes larger ids, so ids grow along it.
        ids = conn.execute(_NEXT_IDS, {"n": n}).scalars().all()
        return chain, prev, sorted(int(i) for i in ids)

    def append_event(self, *, subject: str, action: str, actor: str, payload: Mapping[str, Any],
                     approval_request_id: str | None = None, outbox: Iterable[OutboxItem] = (),
                     now: dt.datetime | None = None) -> int:
        """``append_event_in`` in a transaction of its own."""
        with self._store.tx() as conn:
            return self.append_event_in(conn, subject=subject, action=action, actor=actor, payload=payload,
                                        approval_request_id=approval_request_id, outbox=outbox, now=now)

    @contextmanager
    def chain(self) -> Iterator[AuditChainReader]:
        """Every chain and its head in one read transaction (what ``verify`` recomputes).

        One snapshot for both reads (REPEATABLE READ on PostgreSQL; a read transaction on SQLite is one already):
        under READ COMMITTED the heads, read after the events, could include events appended meanwhile, and an
        intact trail being appended to would read as "events were removed".
        """
        with self._store.read() as conn:
            if self._store.is_postgres:
                conn.execution_options(isolation_level="REPEATABLE READ")
            yield AuditChainReader(conn)

    def locked_heads(self) -> list[ChainHead]:
        """Every chain's head, read holding every head row's lock: what a checkpoint signs.

        An append holds its chain's head lock from taking its event id until it commits, so once every head is
        held no append is half done: every event id taken so far is committed (and below the highest head) or
        rolled back for good, and every later append takes a larger id. The heads read here are a cut with
        nothing missing below it, which is what lets ``verify`` refuse any event at or below a checkpoint's
        position outside its chain's signed range. The locks are released at once (the commit).
        """
        with self._store.tx() as conn:
            rows = conn.execute(self._store.for_update(_HEADS)).all()
        return [ChainHead(int(r.head_id), int(r.last_event_id), str(r.last_hash)) for r in rows]
