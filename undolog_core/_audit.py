"""The audit trail: verifying the one global hash chain. Its SQL (append, outbox, reads) is ``storage.audit``."""

from __future__ import annotations

from dataclasses import dataclass

from .storage.audit import GENESIS_HASH, AuditSQL, event_hash


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


__all__ = ["GENESIS_HASH", "AuditReport", "event_hash", "verify"]
