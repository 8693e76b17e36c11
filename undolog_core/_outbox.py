"""Reading the outbox: the events the core writes beside each approval event, for a notifier to fan out.

The core writes outbox rows in its own transactions (see ``_audit``); something outside the core (the
approval desk's webhooks) turns them into notifications. This is the one public way to do that, so the
consumer never touches the core's tables.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .storage.contract import OutboxRepository as OutboxStore


@dataclass(frozen=True)
class OutboxEvent:
    """One undelivered outbox row.

    Attributes:
        outbox_id: Increasing id (the order the events were written in).
        event_type: ``approval.requested``, ``approval.decided``, ``approval.timed_out``, ``session.halted``,
            ``session.rolled_back``.
        payload: The event's data.
        created_at: When the event was written.
        risk_tags: The risk tags of the approval request the event is about (from the payload, else the
            request), for routing; empty for session events.
    """

    outbox_id: int
    event_type: str
    payload: dict[str, Any]
    created_at: dt.datetime | None
    risk_tags: list[str] = field(default_factory=list)


class OutboxService:
    """Hand undelivered outbox events to a consumer, once, whichever process gets there first.

    Example:
        >>> def fan_out(conn, events):          # runs inside the claiming transaction
        ...     for e in events:
        ...         my_store.enqueue(conn, e)   # the consumer's own rows, committed with the claim
        >>> undolog.outbox.drain(fan_out, limit=200)
    """

    def __init__(self, store: OutboxStore) -> None:
        self._store = store

    def drain(self, handle: Callable[[Any, Sequence[OutboxEvent]], None], *, limit: int = 200) -> int:
        """Claim up to ``limit`` undelivered events, pass them to ``handle`` and mark them delivered.

        ``handle`` runs inside the claiming transaction and receives its connection, so the consumer's own
        writes (delivery rows) commit atomically with the claim: an event is handed over exactly once, or
        not at all if ``handle`` raises. On PostgreSQL, rows another process is draining are skipped, not
        waited for.

        Args:
            handle: ``handle(conn, events)``; it may write on ``conn`` but must not commit it.
            limit: Most events claimed at once.

        Returns:
            How many events were handed over.
        """
        return self._store.drain(handle, OutboxEvent, limit=limit)
