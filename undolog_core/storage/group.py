"""Group commit: durable writes of concurrent callers committed together, one fsync for the group.

SQLite has one writer: threads of one process that each want a durable pre-write or commit mark queue on its write
lock and pay one fsync each, one after the other. Here the first caller to arrive writes at once, alone, exactly as
without grouping (no added latency, and the same statements); callers that arrive while it commits wait for it to
finish (they would have waited on the lock anyway), and the first of them then writes all of theirs in one
transaction, one savepoint per write so that each keeps its own outcome (a refused session, a call id written
before), and hands the results out. Each caller returns only once its own write is durable: the guarantee of the
pre-write (durable before the tool runs) and of a durable commit mark is unchanged; only the fsync is shared.

PostgreSQL needs none of this: concurrent commits of different connections already share a WAL flush in the
server, so its hot path writes each statement on its own connection.

Imports only ``pool`` (for ``WouldBlock``); the writes themselves are the hot path's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from .pool import WouldBlock


class _Slot:
    """One caller's write: filled in by whoever commits it."""

    __slots__ = ("item", "done", "lead", "result", "error")

    def __init__(self, item: Any) -> None:
        self.item = item
        self.done = threading.Event()
        self.lead = False  # handed the lead: this caller commits the next group
        self.result: Any = None
        self.error: BaseException | None = None


class GroupCommit:
    """Leader/follower group commit over two writers: one write alone, and many in one transaction.

    ``write_one(item, wait)`` is the unbatched write (its exceptions are the caller's); ``write_many(items)``
    returns one outcome per item, each a result or an exception instance (it raises only when the whole group
    failed, and then every caller of the group gets that error).

    Example:
        >>> group = GroupCommit(lambda item, wait: write(item), lambda items: [write(i) for i in items])
        >>> group.submit(("mark", effect_id), wait=True)
    """

    def __init__(self, write_one: Callable[[Any, bool], Any],
                 write_many: Callable[[Sequence[Any]], list[Any]]) -> None:
        self._write_one = write_one
        self._write_many = write_many
        self._lock = threading.Lock()
        self._queue: list[_Slot] = []
        self._leading = False
        self.enabled = True
        # What the batching did (the benchmark prints it): transactions committed, writes in them.
        self.commits = 0
        self.writes = 0
        self.largest = 0

    def submit(self, item: Any, wait: bool = True) -> Any:
        """Write ``item`` durably, alone or with the writes of concurrent callers; its result.

        ``wait=False`` (an event loop) raises ``WouldBlock`` instead of waiting for another caller's commit.
        """
        if not self.enabled:
            return self._write_one(item, wait)
        with self._lock:
            if self._leading:
                if not wait:
                    raise WouldBlock()
                queued = _Slot(item)
                self._queue.append(queued)
                slot: _Slot | None = queued
            else:
                self._leading = True
                slot = None
        if slot is None:
            # The lead with nothing queued: write alone, exactly as without grouping.
            try:
                result = self._write_one(item, wait)
                self.commits += 1
                self.writes += 1
                self.largest = max(self.largest, 1)
                return result
            finally:
                self._pass_lead()
        slot.done.wait()
        if slot.lead:
            return self._lead(slot)
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _lead(self, own: _Slot) -> Any:
        """Commit every queued write with our own, then hand the lead to whoever queued meanwhile."""
        with self._lock:
            group, self._queue = [own, *self._queue], []
        try:
            try:
                outcomes = self._write_many([s.item for s in group])
                self.commits += 1
                self.writes += len(group)
                self.largest = max(self.largest, len(group))
            except BaseException as exc:  # noqa: BLE001 - the whole group failed: every caller gets it
                outcomes = [exc] * len(group)
        finally:
            self._pass_lead()
        for s, out in zip(group[1:], outcomes[1:], strict=True):
            if isinstance(out, BaseException):
                s.error = out
            else:
                s.result = out
            s.done.set()
        mine = outcomes[0]
        if isinstance(mine, BaseException):
            raise mine
        return mine

    def _pass_lead(self) -> None:
        with self._lock:
            if self._queue:
                nxt = self._queue.pop(0)
                nxt.lead = True
                nxt.done.set()
            else:
                self._leading = False
