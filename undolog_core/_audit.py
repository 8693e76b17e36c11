"""The audit trail: verifying the one global hash chain. Its SQL (append, outbox, reads) is ``storage.audit``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError
from .storage.audit import GENESIS_HASH, AuditSQL, OutboxItem, event_hash

if TYPE_CHECKING:
    from ._store import Store


@dataclass(frozen=True)
class AuditReport:
    """Result of ``undolog audit verify``."""

    ok: bool
    events_checked: int
    first_bad_event_id: int | None = None
    problem: str | None = None


def verify(storage: AuditSQL) -> AuditReport:
    """Recompute the chain; any edit, deletion or reordering behind the triggers' back shows up here.

    Example:
        >>> verify(undolog.store).ok
        True
    """
    prev = GENESIS_HASH
    expected_id = 1
    count = 0
    with storage.audit_chain() as chain:
        for r in chain.events():
            count += 1
            if r.event_id != expected_id:
                return AuditReport(False, count, r.event_id, f"event {expected_id} is missing (found {r.event_id})")
            if r.prev_hash != prev:
                return AuditReport(False, count, r.event_id, "prev_hash does not match the previous event's hash")
            h = event_hash(
                event_id=r.event_id,
                approval_request_id=r.approval_request_id,
                subject=r.subject,
                action=r.action,
                actor=r.actor,
                payload=r.payload,
                created_at=r.created_at,
                prev_hash=r.prev_hash,
            )
            if h != r.hash:
                return AuditReport(False, count, r.event_id, "the event's content does not match its hash")
            prev = r.hash
            expected_id += 1
        last_event_id, last_hash = chain.head()
    if last_event_id != expected_id - 1 or last_hash != prev:
        return AuditReport(False, count, last_event_id, "events after the last one found were removed")
    return AuditReport(True, count)


# -- the engine's and the saga's spelling, until they call the storage directly ----------------------


def append_event(
    conn: Any,
    store: Store,
    *,
    subject: str,
    action: str,
    actor: str,
    payload: Mapping[str, Any],
    approval_request_id: str | None = None,
    outbox: Iterable[OutboxItem] = (),
    now: dt.datetime | None = None,
) -> int:
    """``store.append_event_in(conn, ...)``: one audit event (and its outbox rows) in the caller's transaction."""
    if not isinstance(store, AuditSQL):
        raise ConfigurationError("UndoLog works on a Storage (undolog_core.storage.open_storage), not a bare Store")
    return store.append_event_in(conn, subject=subject, action=action, actor=actor, payload=payload,
                                 approval_request_id=approval_request_id, outbox=outbox, now=now)


def write_outbox(conn: Any, items: Iterable[OutboxItem], *, now: dt.datetime | None = None) -> None:
    """``AuditSQL.write_outbox_in``: outbox rows in the caller's transaction."""
    AuditSQL.write_outbox_in(conn, items, now=now)


__all__ = ["GENESIS_HASH", "AuditReport", "append_event", "event_hash", "verify", "write_outbox"]
