"""The audit trail: verifying the one global hash chain. Its SQL (append, outbox, reads) is ``storage.audit``.

The chain alone catches edits made behind the triggers' back unless the editor recomputes the hashes;
signed heads held outside the database (``_checkpoints``) catch that too, up to the last one signed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .storage.audit import GENESIS_HASH, AuditSQL, event_hash


@dataclass(frozen=True)
class SignedHead:
    """A chain head whose signature was already checked: event ``position`` must have ``hash``.

    Attributes:
        position: Event id of the head (0: the empty chain).
        hash: The hash that event had when the head was signed.
        source: Where it came from (a checkpoint file), named in reports.
    """

    position: int
    hash: str
    source: str


@dataclass(frozen=True)
class AuditReport:
    """Result of ``undolog audit verify``.

    Attributes:
        ok: The chain is intact (and matches every signed head given).
        events_checked: Events recomputed.
        first_bad_event_id: The event that broke it (for a rewrite caught by a signed head: the signed event,
            whose hash changed; the rewrite lies after the last signed head that still matched).
        problem: What is wrong, for a person.
        checkpoints_checked: Signed heads compared with the chain.
        head_position: Event id of the chain head that was verified.
        head_hash: Its hash.
    """

    ok: bool
    events_checked: int
    first_bad_event_id: int | None = None
    problem: str | None = None
    checkpoints_checked: int = 0
    head_position: int = 0
    head_hash: str = GENESIS_HASH


def verify(storage: AuditSQL, checkpoints: Sequence[SignedHead] = ()) -> AuditReport:
    """Recompute the chain; any edit, deletion or reordering behind the triggers' back shows up here.

    Args:
        storage: The store.
        checkpoints: Signed heads (signatures already checked): the event at each position must have the
            signed hash, which catches a rewrite whose hashes were recomputed.

    Example:
        >>> verify(undolog.store).ok
        True
    """
    by_position: dict[int, list[SignedHead]] = {}
    for c in checkpoints:
        by_position.setdefault(c.position, []).append(c)
    matched = 0  # highest signed position that matched so far
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
            for c in by_position.get(r.event_id, ()):
                if c.hash != r.hash:
                    return AuditReport(
                        False,
                        count,
                        r.event_id,
                        f"event {r.event_id} does not have the hash signed in {c.source}: the chain was "
                        f"rewritten (hashes recomputed) at an event after {matched} and up to {r.event_id}",
                    )
                matched = r.event_id
            prev = r.hash
            expected_id += 1
        last_event_id, last_hash = chain.head()
    if last_event_id != expected_id - 1 or last_hash != prev:
        return AuditReport(False, count, last_event_id, "events after the last one found were removed")
    for position in sorted(by_position):
        if position > last_event_id:
            c = by_position[position][0]
            return AuditReport(
                False, count, last_event_id + 1,
                f"event {position}, signed in {c.source}, is gone: the chain was cut back to {last_event_id}",
            )
        if position == 0 and any(c.hash != GENESIS_HASH for c in by_position[0]):
            return AuditReport(False, count, None, "a checkpoint of the empty chain carries a hash")
    return AuditReport(True, count, checkpoints_checked=len(checkpoints), head_position=last_event_id, head_hash=prev)


__all__ = ["GENESIS_HASH", "AuditReport", "SignedHead", "event_hash", "verify"]
