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
        # Held by whoever writes now, alone or for a group: the lead. The caller alone takes it without waiting and
        # gives it back, one lock round trip and nothing else (the common case: one thread, or threads that do
        # not overlap). `_lock` guards the queue only, and is taken only when someone has to queue.
        self._writer = threading.Lock()
        self._lock = threading.Lock()
        self._queue: list[_Slot] = []
        self.enabled = True
        # What the batching did (the benchmark prints it): transactions committed, writes in them.
        self.commits = 0
        self.writes = 0
        self.largest = 0

    @property
    def _leading(self) -> bool:
        """Whether someone holds the lead (writes now)."""
        return self._writer.locked()

    def submit(self, item: Any, wait: bool = True) -> Any:
        """Write ``item`` durably, alone or with the writes of concurrent callers; its result.

        ``wait=False`` (an event loop) raises ``WouldBlock`` instead of waiting for another caller's commit.
        """
        if not self.enabled:
            return self._write_one(item, wait)
        writer = self._writer
        if writer.acquire(False):
            if self._queue and wait:  # callers queued behind the last lead: they go first, with this write
                return self._lead(_Slot(item))
            # The lead with nothing queued: write alone, exactly as without grouping.
            try:
                result = self._write_one(item, wait)
                self.commits += 1  # counted while leading: no other thread counts meanwhile
                self.writes += 1
                if not self.largest:
                    self.largest = 1
            finally:
                # _release, inline (a frame less on each of a COMPENSABLE call's two writes): the queue's own
                # path only when someone queued meanwhile.
                writer.release()
                if self._queue:
                    self._hand_over()
            return result
        if not wait:
            raise WouldBlock()
        slot = _Slot(item)
        with self._lock:
            # Queued first, then the lead tried: a lead that gives up after this sees the queue (see _release),
            # and one that gave up before it is taken here. Either way somebody writes this slot.
            self._queue.append(slot)
            if self._writer.acquire(False):
                self._queue.remove(slot)
                slot.lead = True
        if not slot.lead:
            slot.done.wait()
        if slot.lead:
            return self._lead(slot)
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _lead(self, own: _Slot) -> Any:
        """Holding the lead: commit every queued write with our own, then give the lead up."""
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
            self._release()
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

    def _release(self) -> None:
        """Give the lead up; if callers queued meanwhile, hand it to the first of them.

        The queue is read without the lock first: a caller queues before it tries the lead itself (under the lock),
        so a queue this read misses is one whose caller will find the lead free and take it."""
        self._writer.release()
        if self._queue:
            self._hand_over()

    def _hand_over(self) -> None:
        """The lead was just given up with callers queued: hand it to the first of them, unless someone took it."""
        with self._lock:
            if self._queue and self._writer.acquire(False):
                nxt = self._queue.pop(0)
                nxt.lead = True
                nxt.done.set()
