"""Sessions held by the live process that serves them, and rollbacks run there.

A compensation must reach the process that did the work: an MCP upstream started over stdio may keep its state in
that very process, which only the gateway serving the session holds a connection to. A process that serves
sessions (the MCP gateway) ``hold``s them under a lease it renews; a rollback asked elsewhere (the CLI, the desk)
is filed for that owner, which runs it and answers with its report while the requester waits. Only when the
owner's lease is gone (``owner_alive``) does the requester run it itself, and its report says so
(``ran_without_live_upstream``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._leases import Leases, owner_alive
from ._saga import RollbackReport, RollbackStep
from .errors import UndoLogError
from .storage.base import Owner, utcnow

if TYPE_CHECKING:
    from .storage import Storage


class RollbackStillRunning(UndoLogError):
    """The owner of the session took the rollback but had not answered within the wait.

    Fix:
        Wait and look again (``undolog sessions show ID``): the rollback goes on in the process that owns the
        session; it is not run a second time.
    """

    code = "rollback_still_running"


class SessionOwners:
    """Which live process serves a session, and the rollbacks filed for it.

    Example:
        >>> undolog.owners.hold(["s1"])           # in the gateway, for each session it serves
        >>> undolog.rollback("s1", wait=30)      # elsewhere: filed for the gateway, which runs it
    """

    poll_seconds = 0.2
    # A session owner's lease is long: it is renewed while the owner is idle too (a call's lease only while the call
    # runs), and a renewal is a statement no call asked for. On its own host an owner's death is seen at once
    # (``owner_alive`` asks whether its pid lives); from another host, within this many call leases.
    lease_factor = 10.0

    def __init__(self, store: Storage, leases: Leases) -> None:
        self._store = store
        self._leases = leases
        self.held: set[str] = set()
        # Set by a holder that handles ``WAKE_SIGNAL`` (the gateway's owner loop): a requester on this host then
        # signals it; a process without the handler is never signalled (the signal's default action ends it).
        self.wakes_on_signal = False
        self._wakes: dict[str, bool] = {}  # owner -> whether it said it handles the signal (last read)

    @property
    def lease_seconds(self) -> float:
        return self._leases.lease_seconds * self.lease_factor

    def _until(self) -> dt.datetime:
        return utcnow() + dt.timedelta(seconds=self.lease_seconds)

    def hold(self, session_ids: Iterable[str]) -> None:
        """This process serves these sessions: a rollback of one is filed for it (renewed by :meth:`renew`)."""
        new = [sid for sid in session_ids if sid not in self.held]
        if new:
            self._store.owners.hold_sessions(self._leases.owner, new, until=self._until(),
                                      wakes_on_signal=self.wakes_on_signal)
            self.held.update(new)

    def renew(self) -> None:
        if self.held:
            self._store.owners.renew_sessions(self._leases.owner, until=self._until())

    def let_go(self) -> None:
        """Stop serving every session (at shutdown): a rollback asked later is run by its requester at once."""
        self._store.owners.let_go_sessions(self._leases.owner, now=utcnow())
        self.held.clear()

    def filed(self) -> list[Any]:
        """The rollbacks filed for this process: rows of (session_id, rollback_actor, rollback_reason)."""
        return self._store.owners.filed_rollbacks(self._leases.owner) if self.held else []

    def answer(self, session_id: str, report: RollbackReport | None, error: UndoLogError | None = None) -> None:
        body: dict[str, Any] = report.to_dict() if report is not None else {}
        if error is not None:
            body = {"error": error.to_dict()}
        self._store.owners.answer_rollback(session_id, body)

    def live_owner(self, session_id: str) -> tuple[str | None, bool]:
        """(the live process other than this one serving the session, or None; whether another process served
        it and is gone: then its upstreams' live connections are gone with it)."""
        row = self._store.owners.session_owner(session_id)
        if row is None or row.owner == self._leases.owner:
            return None, False
        if owner_alive(row.owner, row.lease_until):
            self._wakes[str(row.owner)] = bool(row.wakes_on_signal)
            return str(row.owner), False
        return None, True

    def delegate(self, session_id: str, owner: str, *, actor: str, reason: str | None, wait: float,
                 gone: Callable[[], bool]) -> RollbackReport | None:
        """File the rollback for ``owner`` and wait up to ``wait`` seconds for its report. Returns None when the
        owner went away before answering (the caller runs it itself).

        Raises:
            RollbackStillRunning: the owner had not answered within ``wait``.
            UndoLogError: the owner refused it (its error, as raised there).
        """
        self._store.owners.file_rollback(session_id, actor=actor, reason=reason, now=utcnow())
        if self._wakes.get(owner):
            _wake(owner)
        deadline = time.monotonic() + wait
        while True:
            row = self._store.owners.rollback_answer(session_id)
            if row is not None and row.rollback_report is not None:
                self._store.owners.close_rollback(session_id)
                return _report(session_id, row.rollback_report, owner)
            if gone():
                self._store.owners.close_rollback(session_id)
                return None
            if time.monotonic() >= deadline:
                raise RollbackStillRunning(
                    f"the rollback of session {session_id!r} is filed with the process serving it ({owner}), which "
                    f"had not finished it after {wait:g} s; it goes on there: see `undolog sessions show "
                    f"{session_id}`, or wait longer with --wait", session_id=session_id, owner=owner)
            time.sleep(self.poll_seconds)


# The signal that tells an owner on this host a rollback was filed for it: it looks at once, rather than the owner
# polling the database (a statement every fraction of a second that no call asked for). An owner on another host
# finds it when it renews its lease.
WAKE_SIGNAL = signal.SIGUSR1 if hasattr(signal, "SIGUSR1") else None


def _wake(owner: str) -> None:
    if WAKE_SIGNAL is None:
        return
    try:
        host, pid, _ = owner.split("|")[:3]
    except ValueError:
        return
    if host != Owner.me().split("|")[0] or int(pid) == os.getpid() or Owner.is_dead_locally(owner):
        return
    with contextlib.suppress(OSError):  # another user's process, or gone meanwhile: it finds it when it renews
        os.kill(int(pid), WAKE_SIGNAL)


def _report(session_id: str, body: dict[str, Any], owner: str) -> RollbackReport:
    error = body.get("error")
    if isinstance(error, dict):
        raise UndoLogError(str(error.get("message") or error), **{k: v for k, v in error.items() if k != "message"})
    steps = [RollbackStep(**s) for s in body.get("steps", [])]
    return RollbackReport(session_id, steps, already_rolled_back=bool(body.get("already_rolled_back")),
                          complete=bool(body.get("complete")), halted_reason=body.get("halted_reason"),
                          kept_irreversible=list(body.get("kept_irreversible", [])), ran_by=owner)
