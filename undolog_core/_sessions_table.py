"""The session table: this process's records of sessions (``SessionCache``), bounded by ``max_sessions``, and
the writes that keep them in step with the store (deferred starts, SAFE call counts). The engine
(``_engine.Engine``) holds one and reads its records directly on the hot path; nothing here decides a call."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from ._leases import LazyLoop
from ._session_record import SessionCache, check_id
from ._tools import ToolSpec
from .errors import ConfigurationError, ContractChanged, SessionClosed, SessionHalted, SessionNotFound
from .limits import check_identity
from .storage.base import from_epoch, utcnow
from .storage.hotpath import HotPath
from .storage.pool import WouldBlock
from .storage.schema import OnFailure, SessionState

if TYPE_CHECKING:
    from ._registry import Registry
    from .storage import Storage

# States a session never leaves: its record leaves the session table (``SessionTable._forget``).
_ENDED = frozenset({SessionState.COMPLETED.value, SessionState.ROLLED_BACK.value})
# (The enum's value read once: ``.value`` is a Python-level property, two frames on each read.)
_ACTIVE = SessionState.ACTIVE.value

# How many session records the engine keeps in memory by default (``UndoLog(max_sessions=...)``). A record is a few
# hundred bytes plus its last calls' arguments (``SessionCache.recent``); 10,000 idle records of ordinary calls are
# some tens of megabytes at most, whatever the number of sessions (LangGraph threads never end) the process serves.
DEFAULT_MAX_SESSIONS = 10_000
# The ids of evicted sessions, hashed into this many one-byte slots (64 KiB, fixed). A session whose record is missing
# and whose slot is marked is read from the store again before a SAFE call is decided in it (its pins); a slot marked
# by another id (a collision) costs that one read, never a wrong decision. Slots are never cleared: a cleared slot
# could let an evicted session's SAFE call skip its pin check.
_EVICTED_SLOTS = 1 << 16
_SLOT_MASK = _EVICTED_SLOTS - 1
# How far past the oldest records a trim that may not write looks for clean ones to evict (see trim).
_TRIM_SCAN = 64
# How often the background trimmer looks again while the oldest records still hold unwritten counts.
TRIM_SECONDS = 0.05


class SessionTable:
    """This process's session records, oldest first, at most ``max_sessions`` of them once a trim has run.

    The store stays the authority for a session's state; a record holds what only this process knows (SAFE call
    counts, logged calls' counts riding along, a deferred start, recent calls) until a write carries it there.
    ``UndoLog.engine`` holds one (``engine.table``) and keeps the names its callers use bound to it
    (``engine.ensure_session`` is ``engine.table.ensure_session``).

    Example:
        >>> table = undolog.engine.table
        >>> table.look_up_session("chat-42").persisted     # doctest: +SKIP
        False
    """

    def __init__(self, store: Storage, registry: Registry, hot: HotPath, *,
                 max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ConfigurationError(f"max_sessions must be a positive whole number, got {max_sessions!r}")
        self.store = store
        self.hot = hot
        self._registry = registry
        # This process's session records, oldest first (a dict keeps insertion order): at most ``max_sessions`` of
        # them once a trim has run (see ``trim``), however many sessions the process has served. Never rebound: the
        # engine's gate holds the same dict (``Engine._sessions``) and reads it on every call.
        self.max_sessions = max_sessions
        self.records: dict[str, SessionCache] = {}
        self._sessions_lock = threading.Lock()
        # Evicted records something else still holds (a ``Session``, an adapter's own map): the same object is put
        # back when the session is needed again, so its holder and the table never count into two records. Weak:
        # a record nobody holds leaves at once.
        self._evicted: weakref.WeakValueDictionary[str, SessionCache] = weakref.WeakValueDictionary()
        self._evicted_ids = bytearray(_EVICTED_SLOTS)
        self._trim_lock = threading.Lock()
        self._trim_owner: int | None = None  # the thread trimming now
        # Writes what the oldest records hold (counts, deferred starts) when a path that may not write (a SAFE call,
        # an event loop) found the table full of them; started only then.
        self._trimmer = LazyLoop("undolog-sessions", TRIM_SECONDS, self._trim_step)
        # The sessions started here that wait for their first write (defer_start); a set's add and discard are
        # atomic under the GIL, and readers skip persist() while it is empty.
        self.pending: set[str] = set()

    # -- session cache ---------------------------------------------------------------------------

    def cached(self, session_id: str) -> SessionCache | None:
        sc = self.records.get(session_id)
        if sc is None and session_id in self._evicted:
            with self._sessions_lock:
                sc = self.records.get(session_id) or self._revive(session_id)
        return sc

    def note_state(self, session_id: str, state: str) -> None:
        """A session's state changed in the store (a rollback, a halt, a resume): the cache follows; a session that
        ended (completed, rolled back) leaves it (see ``_forget``)."""
        sc = self.records.get(session_id)
        if sc is not None:
            sc.state = state
            if state in _ENDED:
                self._forget(sc)
            return
        held = self._evicted.get(session_id)
        if held is not None:  # evicted, still held: its holder sees the state as a kept record's would
            held.state = state
            if state in _ENDED:
                # As _forget: an ended session's record is not put back; its holder (a Session) flushes itself.
                self._evicted.pop(session_id, None)
                held.gone = False

    def _forget(self, sc: SessionCache) -> None:
        """Drop an ended session's record: it takes no more logged calls, and a process that runs for months sees
        millions of sessions (each record keeps its last calls' arguments). Kept while it still holds counts to
        write; a holder of the record (a ``Session``) still counts SAFE calls into it and flushes them itself
        (``flush_counts(.., cache)``), and a later look-up reads the session from the store again."""
        carried = sc.take_carried()
        if carried or sc.dirty:
            self.give_back(sc, 0, carried)
            return
        with self._sessions_lock:
            if self.records.get(sc.session_id) is sc:
                del self.records[sc.session_id]
        sc.recent.clear()

    # -- the bound on session records ------------------------------------------------------------
    #
    # A long-lived process serves sessions without end (a LangGraph thread's session is never completed), so the
    # records are bounded: past ``max_sessions`` the oldest are evicted. Eviction loses nothing, because a record is
    # evicted only when everything it holds is also in the store, and the store is what a re-read rebuilds it from:
    # - SAFE counts (``dirty``/``counter``) and logged calls' counts (``carried``) exist only here: written first
    #   (``add_call_count``, what ``flush_counts`` does at close), or the record is kept.
    # - a deferred start (``start``): the row is written first (``persist``: the values it was started with), or the
    #   record is kept; its id leaves ``_pending`` with it.
    # - state, pins, on_failure: copies of the row (the store is the authority: a halt or a rollback made elsewhere
    #   is read by the adapters' turn check and refused by every write's guard; ``_guard`` writes a new pin in the
    #   same transaction as the call that pins it). A record re-read has the same ones, so a halted session is still
    #   refused and a changed contract still raises ``ContractChanged``, for SAFE calls too: a missing record whose
    #   id may have been evicted is read again before a SAFE call is decided in it (``session_cache``).
    # - calls in flight: nothing of them is in the record but their count (``carried``, above); their lease, their
    #   result mark and ``_inflight`` are kept per effect, outside it.
    # - ``recent``: the SAFE calls shown in an approval request's agent context. Lost with the record, as when the
    #   session is resumed by another process or after a restart: the request then shows the logged calls and the
    #   SAFE calls made since. No decision reads it. The oldest records go first, so only a session idle while
    #   ``max_sessions`` newer ones were served loses them.
    # A caller may be counting into a record at the moment it is evicted: ``gone`` is set before the record is
    # checked and read by that caller after it counted (the GIL orders both), so one of them sees the other (see
    # ``evict`` and ``come_back``).

    def _revive(self, session_id: str) -> SessionCache | None:
        """(Under ``_sessions_lock``) The evicted record of ``session_id`` that something still holds, put back."""
        sc = self._evicted.pop(session_id, None)
        if sc is not None:
            sc.gone = False
            self.records[session_id] = sc
        return sc

    def evict(self, sc: SessionCache) -> bool:
        """Evict ``sc`` when it holds nothing the store does not have (else keep it; see above)."""
        sid = sc.session_id
        with self._sessions_lock:
            if self.records.get(sid) is not sc:
                return False
            sc.gone = True  # before the check: a caller counting from now on sees it (note_safe_in)
            if sc.unwritten():
                sc.gone = False
                return False
            del self.records[sid]
            self._evicted[sid] = sc  # (weak: gone at once unless something holds it)
            self._evicted_ids[hash(sid) & _SLOT_MASK] = 1
        return True

    def give_back(self, sc: SessionCache, n: int, carried: int = 0) -> None:
        """``sc.give_back(n, carried)``: counts taken for a write that did not happen go back, to the record in the
        cache (``sc`` looked clean meanwhile and may have been evicted: then it comes back)."""
        sc.give_back(n, carried)
        if sc.gone:
            self.come_back(sc)

    def come_back(self, sc: SessionCache) -> None:
        """A caller counted into ``sc`` while it was being evicted: the record goes back, with its count (or, when a
        new record of the session was made meanwhile, its counts go to that one)."""
        with self._sessions_lock:
            cur = self.records.get(sc.session_id)
            if cur is None:
                self._evicted.pop(sc.session_id, None)
                self.records[sc.session_id] = sc
            if cur is None or cur is sc:
                sc.gone = False
                return
        cur.give_back(sc.take_safe(), sc.take_carried())

    def trim(self, *, write: bool = True) -> int:
        """Bring the session records down to ``max_sessions``, oldest first; returns how many were evicted.

        A record whose counts or deferred start are not in the store yet is written first (``write=True``) or left
        to the background trimmer (``write=False``: a path that must not write, such as a SAFE call's). Called by the
        engine itself whenever a record is added past the bound; callable to trim now.

        Example:
            >>> undolog.engine.trim()
            0
        """
        me = threading.get_ident()
        if self._trim_owner == me:
            return 0  # a write of this trim itself (a deferred start written) added a record: the trim goes on
        if write:
            self._trim_lock.acquire()  # may wait: after the other trim, this one sees what is left
        elif not self._trim_lock.acquire(blocking=False):
            return 0  # another thread trims right now
        self._trim_owner = me
        evicted = 0
        try:
            excess = len(self.records) - self.max_sessions
            if excess <= 0:
                return 0
            # Not writing, it looks past the oldest for clean records, but only in the older half: the newest are in use
            # (the one just added is about to be counted into).
            scan = excess if write else min(excess + _TRIM_SCAN, len(self.records) // 2)
            with self._sessions_lock:
                oldest = list(islice(self.records.values(), scan))
            waiting = False
            for sc in oldest:
                if evicted >= excess:
                    break
                if sc.unwritten():
                    if not write:
                        waiting = True
                        continue
                    self._write_record(sc)
                if self.evict(sc):
                    evicted += 1
            if waiting and evicted < excess:
                self._trimmer.ensure()
        finally:
            self._trim_owner = None
            self._trim_lock.release()
        return evicted

    def needs_trim(self) -> bool:
        """Whether more records are kept than ``max_sessions`` (what a trim that may not write left: see ``trim``)."""
        return len(self.records) > self.max_sessions

    def _write_record(self, sc: SessionCache) -> None:
        """Write what only ``sc`` holds: its deferred start, then its counts (given back if the write fails)."""
        if sc.start is not None:
            self.persist(sc.session_id)
        n, carried = sc.take_safe(), sc.take_carried()
        if n + carried:
            try:
                self.store.sessions.add_call_count(sc.session_id, n + carried, missing=self._missing(sc))
            except BaseException:
                self.give_back(sc, n, carried)
                raise

    def _missing(self, sc: SessionCache) -> dict[str, Any]:
        """A session row's values for counts of a session the store does not have yet (known from SAFE calls)."""
        return {"on_failure": sc.on_failure, "pinned_revisions": sc.pins or self.current_pins(),
                "agent_id": sc.agent_id}

    def _trim_step(self) -> float | None:
        if len(self.records) > self.max_sessions:
            self.trim(write=True)
        return None

    def remember(self, row: Any, *, write: bool = True) -> SessionCache:
        """This process's record of the session ``row`` read or written (``write``: the caller may wait for the
        store, see ``trim``)."""
        sc = SessionCache(
            session_id=row.session_id,
            state=row.state,
            pins={k: int(v) for k, v in (row.pinned_revisions or {}).items()},
            on_failure=row.on_failure,
        )
        with self._sessions_lock:
            old = self.records.get(row.session_id) or self._revive(row.session_id)
            if old is not None:
                # Keep the counter and recent calls gathered before the session reached the store.
                old.state, old.pins, old.on_failure, old.persisted = sc.state, sc.pins, sc.on_failure, True
                if old.start is not None:
                    old.start = None
                    self.pending.discard(row.session_id)
                sc = old
            else:
                self.records[row.session_id] = sc
        if len(self.records) > self.max_sessions:
            self.trim(write=write)
        return sc

    def defer_start(self, session_id: str, *, agent_id: str | None = None, created_by: str | None = None,
                    on_failure: str = "rollback") -> SessionCache:
        """A session with an id this process just minted, recorded here and written to the store by its first
        logged call's own pre-write statement (one statement and one commit fewer per session), where the hot
        path can (``hot.starts_with_prewrite``); elsewhere written now, as :meth:`ensure_session` does.

        Until then the store has no row for it. Every reader in this process finds it all the same: the session
        service, the saga and :meth:`session_states` write it first (:meth:`persist`), as do a SAFE calls' count
        flush, ``complete()``, a gated call and ``close()``. Another process sees it from its first logged call on,
        as it sees a framework adapter's session (:meth:`look_up_session`).

        Example:
            >>> sc = undolog.engine.defer_start(new_id(), agent_id="support-bot")
            >>> sc.persisted     # False on PostgreSQL: written with the first COMPENSABLE call
            False
        """
        if not self.hot.starts_with_prewrite:
            return self.ensure_session(session_id, agent_id=agent_id, created_by=created_by, on_failure=on_failure,
                                       fresh=True)
        check_id("session_id", session_id)
        if agent_id is not None:
            check_identity("agent_id", agent_id)
        if created_by is not None:
            check_identity("created_by", created_by)
        on_failure = OnFailure(on_failure).value  # what the table's CHECK takes, refused before anything is kept
        pins = self.current_pins()
        sc = SessionCache(session_id, SessionState.ACTIVE.value, dict(pins), on_failure, persisted=False,
                          agent_id=agent_id)
        sc.start = {"agent_id": agent_id, "created_by": created_by, "on_failure": on_failure,
                    "pinned_revisions": pins, "created_at": time.time()}
        with self._sessions_lock:
            old = self.records.setdefault(session_id, sc)
        if old is not sc:  # an id minted here is new: only a caller's own reuse of it gets here
            return self.ensure_session(session_id, agent_id=agent_id, created_by=created_by, on_failure=on_failure,
                                       fresh=True)
        self.pending.add(session_id)
        if len(self.records) > self.max_sessions:
            # Not written here (the deferral saves that write; this may be an event loop): the background trimmer
            # writes what the oldest records hold, a new record like this one is kept (see trim).
            self.trim(write=False)
        return sc

    def persist(self, session_id: str | None = None) -> None:
        """Write the session ``session_id`` (every one, when None) this process started and has not written yet
        (:meth:`defer_start`): what a reader of the store calls first, so that it finds the session."""
        if not self.pending:
            return
        for sid in [session_id] if session_id is not None else list(self.pending):
            sc = self.records.get(sid)
            if sc is not None and sc.start is not None:
                self.ensure_session(sid)

    def current_pins(self) -> dict[str, int]:
        return {name: spec.revision for name, spec in self._registry.tools.items()}

    def ensure_session(
        self,
        session_id: str,
        *,
        agent_id: str | None = None,
        created_by: str | None = None,
        on_failure: str = "rollback",
        create: bool = True,
        fresh: bool = False,
        durable: bool = True,
        wait: bool = True,
    ) -> SessionCache:
        """This process's record of the session, read from the store, or the session started there (``create``).

        ``fresh``: the id was just minted, so the session is almost surely new: it is inserted first (one statement
        where the hot path has it) and read only when that id turns out to exist. ``durable=False`` (with ``fresh``):
        that insert may commit without waiting for the disk where the row is then made durable by the next durable
        commit of anything (SQLite's WAL, see ``SQLiteHotPath.start_session``): for a session whose row nothing
        refers to yet, started on an agent's turn.

        ``wait=False`` (with ``fresh``; an event loop): only the hot path's one insert is tried, and ``WouldBlock``
        is raised (nothing written) when it would wait for a connection or a lock, when the hot path has no such
        statement, or when the id exists (reading it is the general path's work, for a worker thread)."""
        sc = self.records.get(session_id)
        if sc is not None and sc.persisted:
            return sc
        check_id("session_id", session_id)
        start = sc.start if sc is not None else None
        if start is not None:  # minted here (defer_start): written with the values it was started with
            agent_id, created_by, on_failure = start["agent_id"], start["created_by"], start["on_failure"]
            create = fresh = True
        if agent_id is None and sc is not None:
            agent_id = sc.agent_id  # the agent it was looked up for (see look_up_session)
        if agent_id is not None:
            check_identity("agent_id", agent_id)
        if created_by is not None:
            check_identity("created_by", created_by)
        values = self._new_session_row(agent_id, created_by, on_failure)
        if start is not None:
            values["pinned_revisions"], values["created_at"] = start["pinned_revisions"], from_epoch(start["created_at"])
        row = None
        if create and fresh:  # a new id: one durable insert on the hot path's pool where the database has it
            row = self.hot.start_session({"session_id": session_id, **values}, durable=durable, wait=wait)
        if row is None:
            if not wait:
                raise WouldBlock()
            row = self.store.sessions.get_or_create_session(session_id, create=create, values=values)
        if row is None:
            raise SessionNotFound(session_id)
        return self.remember(row, write=wait)

    def try_start(self, session_id: str, *, agent_id: str | None = None, on_failure: str = "rollback",
                  unless: str | None = None, durable: bool = True) -> SessionCache | None:
        """The session started in one statement when neither it nor the session ``unless`` exists, else None with
        nothing written (also where the hot path has no such statement, or this process already has a record of
        it): the caller then reads the store. ``durable``: as for :meth:`ensure_session`.

        An adapter's first look at a conversation it has not seen (most often a new one): started without reading
        the store first, and never next to a later session of the same conversation (``unless``).

        Example:
            >>> sc = undolog.engine.try_start("ticket-1", agent_id="bot", unless="ticket-1#2")
            >>> sc is None or sc.state == "active"
            True
        """
        if session_id in self.records:
            return None
        check_id("session_id", session_id)
        if agent_id is not None:
            check_identity("agent_id", agent_id)
        row = self.hot.start_session({"session_id": session_id, **self._new_session_row(agent_id, None, on_failure)},
                                     durable=durable, unless=unless)
        return None if row is None else self.remember(row)

    def _new_session_row(self, agent_id: str | None, created_by: str | None, on_failure: str) -> dict[str, Any]:
        """A new session's row (without its id): active, no calls, pinned to the tools registered now."""
        now = utcnow()
        return {
            "agent_id": agent_id, "state": SessionState.ACTIVE.value, "tool_calls_total": 0,
            "created_by": created_by, "halted_reason": None, "on_failure": on_failure,
            "pinned_revisions": self.current_pins(), "created_at": now, "updated_at": now,
        }

    def look_up_session(self, session_id: str, *, agent_id: str | None = None, wait: bool = True,
                        minted: bool = False) -> SessionCache:
        """This process's record of the session, without writing: read once from the store (its state and pins)
        when this process does not know it yet; a session the store does not have is recorded in memory only, and
        written (with ``agent_id``) by its first logged call, or by the flush of its SAFE calls' count.

        What a framework adapter calls when it first sees a session: a session it resumes keeps its pins (a SAFE
        call of a changed contract is refused) and state, and a run of SAFE calls only writes nothing.
        ``wait=False`` raises ``WouldBlock`` when the read would wait for a connection (an event loop).
        ``minted=True``: the caller has just minted the id (a random UUID), so the store cannot have it: nothing is
        read (the read was a statement, most of what a short SAFE run in a new session cost).

        Example:
            >>> sc = undolog.engine.look_up_session("chat-42", agent_id="semantic-kernel")
            >>> sc.persisted     # False: no row yet, none written
            False
        """
        sc = self.records.get(session_id)
        if sc is not None and sc.persisted:
            return sc
        check_id("session_id", session_id)
        if agent_id is not None:
            check_identity("agent_id", agent_id)
        if not minted:
            row = self.hot.read_session(session_id, wait=wait)
            if row is not None:
                return self.remember(row, write=wait)
        sc = self._new_record(session_id, write=wait)
        if sc.agent_id is None:
            sc.agent_id = agent_id
        return sc

    def session_states(self, session_ids: list[str], *, wait: bool = True) -> dict[str, tuple[str, str | None]]:
        """``{session_id: (state, halted_reason)}`` of those that exist, read in one statement on the hot path's
        pool (an adapter's check at the start of an agent turn); on SQLite, answered without one while nothing was
        committed to the database since the same ids were read (``storage.sqlite.WalStamp``). A read only: the
        session cache is left alone (a state changed in this process meanwhile must not be overwritten by this older
        read).

        ``wait=False`` raises ``WouldBlock`` instead of waiting for a connection (an event loop).

        Example:
            >>> undolog.engine.session_states(["ticket-1", "ticket-1#2"])
            {'ticket-1': ('active', None)}
        """
        if self.pending:
            if not wait and any((sc := self.records.get(i)) is not None and sc.start is not None
                                for i in session_ids):
                raise WouldBlock()
            for i in session_ids:
                self.persist(i)
        return self.hot.session_states(session_ids, wait=wait)

    def sessions_with_call(self, session_ids: list[str], call_id: str) -> set[str]:
        """Those of ``session_ids`` that logged a call with this ``call_id``: one read (an adapter asking whether a
        re-issued call belongs to an earlier session of its thread, e.g. one LangGraph's time travel replays).

        Example:
            >>> undolog.engine.sessions_with_call(["ticket-1"], "call_0f1d")
            {'ticket-1'}
        """
        for i in session_ids:
            self.persist(i)
        return self.store.effects.sessions_with_call(session_ids, call_id)

    # -- SAFE calls ------------------------------------------------------------------------------

    def session_cache(self, session_id: str, *, wait: bool = True) -> SessionCache:
        """This process's record of a session, made (not persisted) on first sight, without I/O; a session whose
        record may have been evicted (see ``trim``) is read from the store again instead, so that its pins still
        hold. ``wait=False`` raises ``WouldBlock`` when that read would wait for a connection (an event loop)."""
        sc = self.records.get(session_id)
        if sc is None:
            with self._sessions_lock:
                sc = self.records.get(session_id) or self._revive(session_id)
            if sc is None:
                if self._evicted_ids[hash(session_id) & _SLOT_MASK]:
                    return self.look_up_session(session_id, wait=wait)
                sc = self._new_record(session_id, write=False)
        return sc

    def _new_record(self, session_id: str, *, write: bool) -> SessionCache:
        """A record of a session the store does not have (known from SAFE calls until its first write)."""
        sc = SessionCache(session_id, _ACTIVE, {}, "rollback", persisted=False)
        with self._sessions_lock:
            sc = self.records.setdefault(session_id, sc)
        if len(self.records) > self.max_sessions:
            self.trim(write=write)
        return sc

    def note_safe(self, session_id: str, spec: ToolSpec, args: Mapping[str, Any]) -> None:
        """The whole bookkeeping of a SAFE call: a counter and the recent-calls ring, both in memory."""
        self.note_safe_in(self.session_cache(session_id), spec, args)

    def note_safe_in(self, sc: SessionCache, spec: ToolSpec, args: Mapping[str, Any]) -> None:
        if sc.pins and sc.pins.get(spec.name, spec.revision) != spec.revision:
            raise ContractChanged(sc.session_id, spec.name, sc.pins[spec.name], spec.revision)
        next(sc.counter)  # (sc.count_safe(), inline: this is every SAFE call's path)
        sc.dirty = True
        sc.recent.append((spec.name, "safe", args, "done"))
        if sc.gone:  # evicted meanwhile (after counting: see evict): the record goes back, with this count
            self.come_back(sc)

    # -- the session's record and guard, for the gate's writes (its pin: ``SessionCache.check_pin``) --

    def written_record(self, session_id: str) -> SessionCache:
        """The session's record with its row in the store (``ensure_session`` when this process has none, or has
        one not written yet): what a write of the general path guards."""
        sc = self.records.get(session_id)
        if sc is None or not sc.persisted:
            sc = self.ensure_session(session_id)
        return sc

    def guard(self, conn: Any, sc: SessionCache, count: int, *, pin: ToolSpec | None) -> None:
        """Inside a write: flush the counted calls (and pin ``pin``) and prove the session still accepts writes
        (``SessionHalted``, ``SessionClosed`` and the record's state made the store's when not)."""
        pins = None
        if pin is not None:
            sc.pins[pin.name] = pin.revision
            pins = dict(sc.pins)
        refused = self.store.sessions.guard_in(conn, sc.session_id, count, pins)
        if refused is None:
            return
        sc.state = refused.state
        if refused.state == SessionState.HALTED:
            raise SessionHalted(sc.session_id, refused.halted_reason)
        raise SessionClosed(sc.session_id, refused.state)

    # -- writes at a session's end and at close ----------------------------------------------------

    def flush_counts(self, session_id: str | None = None, cache: SessionCache | None = None) -> None:
        """Write the in-memory SAFE call counters (on session exit and close); ``cache``: the caller's own record
        of ``session_id`` as well (it may have left this table: an ended session). (The engine writes its deferred
        marks first: ``Engine.flush_counts``.)"""
        self.persist(session_id)  # a session started here and not written yet is written now, with its values
        mapped = self.records.get(session_id) if session_id is not None else None
        targets = [mapped] if mapped is not None else []
        if cache is not None and cache is not mapped:
            targets.append(cache)
        if session_id is None:
            # Evicted records something still holds count too (a holder may have counted into one since).
            targets = list(self.records.values()) + list(self._evicted.values())
        for sc in targets:
            self._write_record(sc)

    def end_with(self, sc: SessionCache, state: SessionState, allowed: tuple[str, ...],
                 marks: list[tuple[str, str, float]]) -> tuple[bool | None, int]:
        """The hot path's end of the session ``sc`` with its counts and ``marks`` (see ``Engine.end_session``):
        (done, how many marks landed); the counts go back to the record when nothing was written."""
        safe, carried = sc.take_safe(), sc.take_carried()
        try:
            done = self.hot.end_session(sc.session_id, safe + carried, state.value, allowed, time.time(), marks)
        except BaseException:
            self.give_back(sc, safe, carried)
            raise
        if not done:
            self.give_back(sc, safe, carried)
        return (None if done is None else bool(done)), (done.marked if done is not None else 0)

    def stop(self) -> None:
        """Stop the background trimmer (at close)."""
        self._trimmer.stop()

