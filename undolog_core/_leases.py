"""Who this UndoLog is, what it is working on right now, and the leases that tell other processes so.

An owner string names the process (host, pid, process start time) and the UndoLog instance inside it. Every effect
in flight, undo entry being compensated and rollback being walked carries its owner and a lease, renewed in the
background every third of ``lease_seconds``. ``owner_alive`` is how recovery and the saga tell a live worker from
an abandoned one: for an owner in this very process, by asking the instance itself (no waiting for a lease); for
another process on this host, by its pid and start time (a stall past the lease is not a death); for another host,
by the lease.
"""

from __future__ import annotations

import datetime as dt
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from .storage.base import Owner, new_id, utcnow

# Every live Leases of this process, by instance id: a second UndoLog in the same process can tell a live call of
# the first from an abandoned one.
_LIVE: weakref.WeakValueDictionary[str, Leases] = weakref.WeakValueDictionary()


class LeaseWriter(Protocol):
    def renew_leases(self, owner: str, effects: list[str], undos: list[int], rolling: list[str],
                     until: dt.datetime) -> None: ...


class LeaseStore(Protocol):
    """What the leases use of the store: its effect log's lease renewal (``store.effects``)."""

    @property
    def effects(self) -> LeaseWriter: ...


def owner_alive(
    owner: str | None, lease: dt.datetime | None, *, effect_id: str | None = None, undo_id: int | None = None,
    rolling: str | None = None,
) -> bool:
    """Whether the owner of an in-flight effect (or undo entry, or rollback of the session ``rolling``) may still
    be working on it: the one rule every taker-over asks (recovery, the saga, the gateway's "is the owner gone").

    * An owner in this process: asked directly (is the work still counted by that UndoLog instance).
    * Another process on this host: alive while its pid runs with the start time the owner recorded, whatever
      its lease says. A process stopped past its lease (SIGSTOP, a debugger, a laptop asleep) is not dead: its
      call will finish, and taking it over would compensate a call that then completes. Only a person overrides
      that (``undolog recover --take-over EFFECT``).
    * Another host: a stall cannot be told from a death from here, so the lease decides. A call that finishes
      after it was taken over is recorded as such (``OutcomeConflict``), never silently lost.

    Example:
        >>> owner_alive(row.owner, row.lease_until, effect_id=row.effect_id)
        False
    """
    if not owner:
        return False
    parts = owner.split("|")
    process, instance = "|".join(parts[:3]), parts[3] if len(parts) > 3 else ""
    if process == Owner.me():
        mine = _LIVE.get(instance)
        if mine is None:
            return False  # that UndoLog of ours was closed: nobody will finish it
        if effect_id is not None:
            return effect_id in mine.inflight
        if undo_id is not None:
            return undo_id in mine.compensating
        if rolling is not None:
            return rolling in mine.rolling
        return lease is not None and lease > utcnow()
    if Owner.is_alive_locally(process):
        return True
    if Owner.is_dead_locally(process):
        return False
    return lease is not None and lease > utcnow()


class LazyLoop:
    """A background loop started on first use (an UndoLog that never writes starts no thread).

    The loop only ends when ``stop()`` is called, so once started it is trusted without asking the thread
    (``is_alive`` is a lock round trip, and this is asked on every COMPENSABLE call).
    """

    def __init__(self, name: str, period: float, step: Callable[[], float | None]) -> None:
        self.name = name
        self.period = period
        self._step = step
        self._started = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure(self) -> None:
        if self._started:
            return
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._started = True
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
            self._started = True

    def _run(self) -> None:
        """``step`` may return how long to wait before it is due again (None: a whole period)."""
        delay: float | None = self.period
        while not self._stop.wait(self.period if delay is None else delay):
            try:
                delay = self._step()
            except Exception:  # noqa: BLE001 - retried next period (a lease is long, a queued mark is kept)
                delay = None

    def stop(self) -> None:
        self._stop.set()
        self._started = False


class Leases:
    """This UndoLog's identity and its work in progress, with the loop that renews their leases.

    Example:
        >>> leases = Leases(store, lease_seconds=30)
        >>> leases.inflight.add(effect_id); leases.start()   # renewed until discarded
    """

    def __init__(self, store: LeaseStore, lease_seconds: float) -> None:
        self._store = store
        self.lease_seconds = lease_seconds
        self.instance = new_id()[:12]
        self.owner = f"{Owner.me()}|{self.instance}"
        self.inflight: set[str] = set()  # effects whose tool runs (or whose mark waits) here
        self.compensating: set[int] = set()  # undo entries whose compensation runs here
        self.rolling: set[str] = set()  # sessions whose rollback this instance walks
        self._loop = LazyLoop("undolog-lease", max(0.05, lease_seconds / 3.0), self._renew)
        #: The renewing loop (``loop._started``: whether :meth:`start` has anything to do). Read by the engine's
        #: COMPENSABLE hot path, which calls :meth:`start` only while it is False: two frames fewer per call.
        self.loop = self._loop
        _LIVE[self.instance] = self

    def until(self) -> dt.datetime:
        """The end of a lease taken now."""
        return utcnow() + dt.timedelta(seconds=self.lease_seconds)

    def start(self) -> None:
        self._loop.ensure()

    def abandon(self, effect_id: str) -> None:
        """Stop counting ``effect_id`` as running here, as if this process had crashed while it ran: its lease
        is no longer renewed and ``owner_alive`` says its owner is gone, so ``recover()`` takes it up.

        Example (what ``check_undo`` does to "crash" a call after its pre-write):
            >>> undolog.leases.abandon(effect_id); undolog.recover()
        """
        self.inflight.discard(effect_id)

    def _renew(self) -> None:
        effects, undos, rolling = list(self.inflight), list(self.compensating), list(self.rolling)
        if effects or undos or rolling:
            self._store.effects.renew_leases(self.owner, effects, undos, rolling, self.until())

    def stop(self) -> None:
        self._loop.stop()
