"""The engine: routes every call by tier; the effect log, the undo stack and approval requests it keeps are
written through the storage (``undolog_core/storage``), never by SQL of its own."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import datetime as dt
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from . import _clock, _faults
from ._faults import FaultPoint, fault
from ._json import canonical_json, canonical_text, json_safe, sha256_hex
from ._leases import LazyLoop, Leases, owner_alive
from ._observe import engine_log, ids
from ._tools import ToolSpec, ToolTier
from .errors import (
    ApprovalCancelled,
    ApprovalRejected,
    ApprovalTimedOut,
    ArgumentsInvalid,
    CallIdConflict,
    CallRunning,
    ConfigurationError,
    ContractChanged,
    DatabaseUnavailable,
    EffectNotFound,
    InvalidEffectState,
    InvalidId,
    OutcomeConflict,
    OutcomeUnknown,
    SessionClosed,
    SessionHalted,
    SessionNotFound,
    ToolNotRegistered,
)
from .limits import (
    MAX_ID_LENGTH,
    MAX_JSON_DEPTH,
    args_problem,
    check_identity,
    clean_text,
    encodes,
    result_text,
    safe_result,
)
from .storage.base import FAST_POOL_SIZE, from_epoch, new_id, utcnow
from .storage.calls import LATE_FINISH_STATES, FailureRollback, LateFinish
from .storage.hotpath import SessionRow
from .storage.pool import IntegrityConflict, WouldBlock
from .storage.schema import IN_FLIGHT, EffectState, OnFailure, RequestState, SessionState

_T = TypeVar("_T")

if TYPE_CHECKING:
    from ._registry import Registry
    from .storage import Storage


class PolicyReader(Protocol):
    def read(self, conn: Any) -> Any: ...


class ApprovalExpirer(Protocol):
    def expire(self, ids: list[str]) -> Any: ...

    def lapse(self, ids: list[str]) -> Any: ...

    def lapsed(self, decided_at: Any) -> bool: ...


class _ClaimLost(InvalidEffectState):
    """This caller read an approved call and lost the claim to run it: another caller ran it (here or in another
    process), or the approval lapsed meanwhile. ``intercept_irreversible`` answers as the call now stands."""


@dataclass(frozen=True)
class FailureRecord:
    """A failure recorded: the session it happened in and what its policy says to do (rollback / continue)."""

    session_id: str
    on_failure: str
    #: Whether the session's rollback was requested with the failure (``record_failure(rollback=...)``).
    rollback_requested: bool = False


MARK_FLUSH_SECONDS = 0.05
# JSON text this short cannot nest deeper than the limit (see limits.args_problem).
_SHORT_JSON = 2 * MAX_JSON_DEPTH
SAFE = ToolTier.SAFE
# States a session never leaves: its record leaves the session cache (``Engine._forget``).
_ENDED = frozenset({SessionState.COMPLETED.value, SessionState.ROLLED_BACK.value})
# (The enum's value read once: ``.value`` is a Python-level property, two frames on each read.)
_ACTIVE = SessionState.ACTIVE.value
COMPENSABLE = ToolTier.COMPENSABLE
IRREVERSIBLE = ToolTier.IRREVERSIBLE
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


@dataclass(frozen=True)
class Execute:
    """Run the tool now with ``args``. SAFE calls carry no effect id and no idempotency key."""

    effect_id: str | None
    args: dict[str, Any]
    idempotency_key: str | None
    tier: ToolTier
    tool_name: str
    call_id: str | None = None
    session_id: str = ""
    # IRREVERSIBLE only: the request a person decided and how ("approve", "modify", "auto_approved"), for traces.
    approval_request_id: str | None = None
    decision: str | None = None
    #: The ownership epoch of this run: the fencing token ``current_call().epoch`` (see ``CallContext``).
    epoch: int = 1


@dataclass(frozen=True)
class AwaitingApproval:
    """The call was not run: a person must decide ``approval_request_id`` first."""

    effect_id: str
    approval_request_id: str
    retry_after: float
    tool_name: str
    args: dict[str, Any]
    reason: str | None
    risk_tags: tuple[str, ...]
    timeout_at: dt.datetime
    call_id: str | None = None


@dataclass(frozen=True)
class Completed:
    """The same call already ran: here is its stored result; do not run it again."""

    effect_id: str
    result: Any
    tool_name: str


Decision = Execute | AwaitingApproval | Completed


@dataclass(frozen=True)
class CallContext:
    """What a running COMPENSABLE or IRREVERSIBLE tool can see through ``current_call()``."""

    session_id: str
    effect_id: str | None
    call_id: str | None
    tool_name: str
    idempotency_key: str | None
    attempt: int = 1  # the tool's retry policy's attempt number; the key is the same on every attempt
    #: The ownership epoch: 1 for a call's first run, one more each time the call is claimed again (an approved
    #: call claimed to run, a released call re-claimed, recovery taking it over). A fencing token for the
    #: upstream, sent beside the idempotency key (never in it: the key stays ``do-{effect_id}``): an upstream
    #: that remembers the highest epoch it has seen for a key refuses a write with a lower one, so a process
    #: stalled past its lease cannot write after recovery took its call over (recovery's probe carries the new
    #: epoch). MCP: ``_meta["dev.undolog/epoch"]``; the proxy: the ``UndoLog-Epoch`` header.
    epoch: int = 1


# The call being run: its CallContext, or (a first attempt run by the driver) the Execute decision it runs under,
# which current_call() turns into one when a tool asks. Every COMPENSABLE call sets it; few tools read it, so the
# CallContext is built on the read instead of on every call.
_current: contextvars.ContextVar[CallContext | Execute | None] = contextvars.ContextVar(
    "undolog_current_call", default=None)

# The framework run (a CrewAI kickoff, a Semantic Kernel turn) the calls in this context belong to, set by an adapter
# around the run (``kickoff_scope``): recorded on each effect they log (``effect_log.kickoff_id``), so that a
# continuation of the run can replay what it already did instead of doing it again. Such calls take the general
# pre-write (a transaction) rather than the hot path's one statement, which has no column for it.
KICKOFF: contextvars.ContextVar[str | None] = contextvars.ContextVar("undolog_kickoff", default=None)


@contextlib.contextmanager
def kickoff_scope(kickoff_id: str | None) -> Iterator[None]:
    """Record ``kickoff_id`` on every effect logged inside the block (this context and those copied from it).

    Example:
        >>> with kickoff_scope("kickoff-7"):                      # doctest: +SKIP
        ...     crew.kickoff()
    """
    token = KICKOFF.set(kickoff_id)
    try:
        yield
    finally:
        KICKOFF.reset(token)


# A frozen dataclass's generated __init__ sets each field through object.__setattr__: about a microsecond for
# Execute's nine fields, on every COMPENSABLE call. The hot path builds the same objects by setting their __dict__
# at once (equal, hashable and frozen like any other: tests/core/test_hot_path.py holds the field lists to the
# classes').
_set_attr = object.__setattr__
_new = object.__new__


def execute_now(effect_id: str | None, args: dict[str, Any], idempotency_key: str | None, tier: ToolTier,
                tool_name: str, call_id: str | None, session_id: str) -> Execute:
    """``Execute(effect_id, args, idempotency_key, tier, tool_name, call_id, session_id)``, built fast."""
    d = _new(Execute)
    _set_attr(d, "__dict__", {"effect_id": effect_id, "args": args, "idempotency_key": idempotency_key, "tier": tier,
                              "tool_name": tool_name, "call_id": call_id, "session_id": session_id,
                              "approval_request_id": None, "decision": None, "epoch": 1})
    return d


def call_context(session_id: str, effect_id: str | None, call_id: str | None, tool_name: str,
                  idempotency_key: str | None, attempt: int, epoch: int = 1) -> CallContext:
    """``CallContext(...)``, built fast (see :func:`execute_now`)."""
    ctx = _new(CallContext)
    _set_attr(ctx, "__dict__", {"session_id": session_id, "effect_id": effect_id, "call_id": call_id,
                                "tool_name": tool_name, "idempotency_key": idempotency_key, "attempt": attempt,
                                "epoch": epoch})
    return ctx


def current_call() -> CallContext | None:
    """The call being run, for tools that pass ``idempotency_key`` on to an external API.

    Example:
        >>> @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="refund_undo")
        ... def refund(amount: int) -> dict:
        ...     return payments.refund(amount, idempotency_key=current_call().idempotency_key)
    """
    running = _current.get()
    if running is None or running.__class__ is CallContext:
        return running
    return call_context(running.session_id, running.effect_id, running.call_id, running.tool_name,
                        running.idempotency_key, 1, running.epoch)


@dataclass
class SessionCache:
    """What this process knows of a session; the database stays the authority for its state."""

    session_id: str
    state: str
    pins: dict[str, int]
    on_failure: str
    persisted: bool = True
    # (tool_name, tier, args, state) of recent calls, newest last; SAFE calls are known only here.
    # (A partial, not a lambda: no Python frame and no keyword parsing when a record is made, once a conversation.)
    recent: collections.deque[tuple[str, str, Any, str]] = field(default_factory=partial(collections.deque, (), 50))
    # next() on itertools.count is atomic under the GIL: lock-free counters for the hot paths. A count is taken by
    # swapping in a fresh counter and reading the old one's next value (it is not used again).
    # `counter` holds SAFE calls, which must reach the store with the session's next write (`dirty` says there are
    # some, so a pre-write with none to carry does not swap); `carried` holds logged calls, which ride along with
    # whatever write flushes next (so a run of COMPENSABLE calls does not rewrite the session row every time).
    counter: Iterator[int] = field(default_factory=itertools.count)
    carried: Iterator[int] = field(default_factory=itertools.count)
    dirty: bool = False
    # The agent a session not yet in the store is recorded under, whichever write creates it first (its first
    # logged call, or the flush of its SAFE calls' count).
    agent_id: str | None = None
    # A session this process minted and has not written yet (``Engine.defer_start``): the row's values, written by
    # its first logged call's own pre-write statement, or first by whatever else needs the row (``Engine.persist``).
    start: dict[str, Any] | None = None
    # Set while the engine evicts the record (``Engine._evict``): a caller that counted into it right then sees it
    # after counting and brings the record back (``Engine._come_back``), so that no count is lost to the eviction.
    gone: bool = False

    def unwritten(self) -> bool:
        """Whether the record holds something the store does not have yet: SAFE calls counted (``dirty``), logged
        calls carried (``carried``: read without taking it, from the counter's repr), or a deferred start."""
        return self.dirty or self.start is not None or repr(self.carried) != "count(0)"

    def count_safe(self) -> None:
        next(self.counter)
        self.dirty = True

    def take_safe(self) -> int:
        if not self.dirty:
            return 0  # nothing counted: the counter stays (a call counted meanwhile is still in it)
        self.dirty = False
        old, self.counter = self.counter, itertools.count()
        return next(old)

    def take_carried(self) -> int:
        old, self.carried = self.carried, itertools.count()
        return next(old)

    def take_count(self) -> int:
        return self.take_safe() + self.take_carried()

    def give_back(self, n: int, carried: int = 0) -> None:
        if n:
            self.counter = itertools.count(self.take_safe() + n)
            self.dirty = True
        if carried:
            self.carried = itertools.count(self.take_carried() + carried)


def check_id(what: str, value: Any) -> None:
    """Ids are non-empty strings that fit their columns, checked before any I/O on both databases alike."""
    if (not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or value != value.strip()
            or "\x00" in value or not (value.isascii() or encodes(value))):
        raise InvalidId(what, value, MAX_ID_LENGTH)



class _Running:
    """The context of a running tool; a plain class, because this is on every COMPENSABLE call's path."""

    __slots__ = ("ctx", "token")

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        self.token: contextvars.Token[CallContext | Execute | None] | None = None

    def __enter__(self) -> CallContext:
        self.token = _current.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _current.reset(self.token)





#: Pauses between the commit mark's attempts after the database dropped the connection (None: the last attempt,
#: after which the mark is deferred). About a second in all: a caller told "done" by a deferred mark that later finds
#: its call taken over can only learn of it at its next call, so the mark is worth a short wait.
MARK_RETRY_PAUSES: tuple[float | None, ...] = (0.05, 0.2, 0.75, None)


class Engine:
    """Routes calls by tier. Callers walk a call through it with the call driver (``undolog.driver``).

    Its collaborators are explicit: the storage (every statement), the registry (contracts), the policy (approval
    timeouts), the approvals (timeouts applied on read) and the leases (who this process is, what it runs).
    """

    def __init__(
        self,
        store: Storage,
        registry: Registry,
        policy: PolicyReader,
        approvals: ApprovalExpirer,
        leases: Leases,
        *,
        fast_commit_mark: bool = False,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ConfigurationError(f"max_sessions must be a positive whole number, got {max_sessions!r}")
        self.store = store
        self._registry = registry
        self._policy = policy
        self._approvals = approvals
        self.leases = leases
        self.lease_seconds = leases.lease_seconds
        self.fast_commit_mark = fast_commit_mark
        # This process's session records, oldest first (a dict keeps insertion order): at most ``max_sessions`` of
        # them once a trim has run (see ``trim``), however many sessions the process has served.
        self.max_sessions = max_sessions
        self._sessions: dict[str, SessionCache] = {}
        self._sessions_lock = threading.Lock()
        # Evicted records something else still holds (a ``Session``, an adapter's own map): the same object is put
        # back when the session is needed again, so its holder and the engine never count into two records. Weak:
        # a record nobody holds leaves at once.
        self._evicted: weakref.WeakValueDictionary[str, SessionCache] = weakref.WeakValueDictionary()
        self._evicted_ids = bytearray(_EVICTED_SLOTS)
        self._trim_lock = threading.Lock()
        self._trim_owner: int | None = None  # the thread trimming now
        # Writes what the oldest records hold (counts, deferred starts) when a path that may not write (a SAFE call,
        # an event loop) found the cache full of them; started only then.
        self._trimmer = LazyLoop("undolog-sessions", MARK_FLUSH_SECONDS, self._trim_step)
        self._inflight = leases.inflight
        self.hot = store.hot_path(pool_size=store.pool_size, fast_pool_size=FAST_POOL_SIZE)
        # The hot path's remembered session reads (SQLite's turn check, one per thread) bounded like the records.
        self.hot.memo_size = min(self.hot.memo_size, max_sessions)
        self.hot.owner = leases.owner  # the commit mark's fence: never over a call taken over meanwhile
        # Deferred commit marks (fast mode, or a mark a dropped connection held back) wait here for the flusher (a
        # batch, not fsynced, once the oldest queued mark is MARK_FLUSH_SECONDS old, unless a reader or the
        # session's end wrote them first). Their effects stay in flight (leased) until written.
        self._marks: collections.deque[tuple[str, str, float]] = collections.deque()  # (effect, result, epoch s)
        self._marks_lock = threading.Lock()
        self._flusher = LazyLoop("undolog-marks", MARK_FLUSH_SECONDS, self._flush_due_marks)
        # The sessions started here that wait for their first write (defer_start); a set's add and discard are
        # atomic under the GIL, and readers skip persist() while it is empty.
        self._pending: set[str] = set()
        #: Asked after a late finish is recorded, ``(effect_id, late)``: the tool's probe, its answer recorded as an
        #: audit event on the effect, settling nothing (the facade binds recovery's ``probe_late_finish``); the
        #: answer (``happened``, ``not_happened``, ``cant_tell``, ``error``) or None without a probe.
        self.on_late_finish: Callable[[str, LateFinish], str | None] | None = None

    @property
    def owner(self) -> str:
        return self.leases.owner

    # -- session cache ---------------------------------------------------------------------------

    def cached(self, session_id: str) -> SessionCache | None:
        sc = self._sessions.get(session_id)
        if sc is None and session_id in self._evicted:
            with self._sessions_lock:
                sc = self._sessions.get(session_id) or self._revive(session_id)
        return sc

    def note_state(self, session_id: str, state: str) -> None:
        """A session's state changed in the store (a rollback, a halt, a resume): the cache follows; a session that
        ended (completed, rolled back) leaves it (see ``_forget``)."""
        sc = self._sessions.get(session_id)
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
            self._give_back(sc, 0, carried)
            return
        with self._sessions_lock:
            if self._sessions.get(sc.session_id) is sc:
                del self._sessions[sc.session_id]
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
    # ``_evict`` and ``_come_back``).

    def _revive(self, session_id: str) -> SessionCache | None:
        """(Under ``_sessions_lock``) The evicted record of ``session_id`` that something still holds, put back."""
        sc = self._evicted.pop(session_id, None)
        if sc is not None:
            sc.gone = False
            self._sessions[session_id] = sc
        return sc

    def _evict(self, sc: SessionCache) -> bool:
        """Evict ``sc`` when it holds nothing the store does not have (else keep it; see above)."""
        sid = sc.session_id
        with self._sessions_lock:
            if self._sessions.get(sid) is not sc:
                return False
            sc.gone = True  # before the check: a caller counting from now on sees it (note_safe_in)
            if sc.unwritten():
                sc.gone = False
                return False
            del self._sessions[sid]
            self._evicted[sid] = sc  # (weak: gone at once unless something holds it)
            self._evicted_ids[hash(sid) & _SLOT_MASK] = 1
        return True

    def _give_back(self, sc: SessionCache, n: int, carried: int = 0) -> None:
        """``sc.give_back(n, carried)``: counts taken for a write that did not happen go back, to the record in the
        cache (``sc`` looked clean meanwhile and may have been evicted: then it comes back)."""
        sc.give_back(n, carried)
        if sc.gone:
            self._come_back(sc)

    def _come_back(self, sc: SessionCache) -> None:
        """A caller counted into ``sc`` while it was being evicted: the record goes back, with its count (or, when a
        new record of the session was made meanwhile, its counts go to that one)."""
        with self._sessions_lock:
            cur = self._sessions.get(sc.session_id)
            if cur is None:
                self._evicted.pop(sc.session_id, None)
                self._sessions[sc.session_id] = sc
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
            excess = len(self._sessions) - self.max_sessions
            if excess <= 0:
                return 0
            # Not writing, it looks past the oldest for clean records, but only in the older half: the newest are in use
            # (the one just added is about to be counted into).
            scan = excess if write else min(excess + _TRIM_SCAN, len(self._sessions) // 2)
            with self._sessions_lock:
                oldest = list(islice(self._sessions.values(), scan))
            waiting = False
            for sc in oldest:
                if evicted >= excess:
                    break
                if sc.unwritten():
                    if not write:
                        waiting = True
                        continue
                    self._write_record(sc)
                if self._evict(sc):
                    evicted += 1
            if waiting and evicted < excess:
                self._trimmer.ensure()
        finally:
            self._trim_owner = None
            self._trim_lock.release()
        return evicted

    def needs_trim(self) -> bool:
        """Whether more records are kept than ``max_sessions`` (what a trim that may not write left: see ``trim``)."""
        return len(self._sessions) > self.max_sessions

    def _write_record(self, sc: SessionCache) -> None:
        """Write what only ``sc`` holds: its deferred start, then its counts (given back if the write fails)."""
        if sc.start is not None:
            self.persist(sc.session_id)
        n, carried = sc.take_safe(), sc.take_carried()
        if n + carried:
            try:
                self.store.add_call_count(sc.session_id, n + carried, missing=self._missing(sc))
            except BaseException:
                self._give_back(sc, n, carried)
                raise

    def _missing(self, sc: SessionCache) -> dict[str, Any]:
        """A session row's values for counts of a session the store does not have yet (known from SAFE calls)."""
        return {"on_failure": sc.on_failure, "pinned_revisions": sc.pins or self.current_pins(),
                "agent_id": sc.agent_id}

    def _trim_step(self) -> float | None:
        if len(self._sessions) > self.max_sessions:
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
            old = self._sessions.get(row.session_id) or self._revive(row.session_id)
            if old is not None:
                # Keep the counter and recent calls gathered before the session reached the store.
                old.state, old.pins, old.on_failure, old.persisted = sc.state, sc.pins, sc.on_failure, True
                if old.start is not None:
                    old.start = None
                    self._pending.discard(row.session_id)
                sc = old
            else:
                self._sessions[row.session_id] = sc
        if len(self._sessions) > self.max_sessions:
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
            old = self._sessions.setdefault(session_id, sc)
        if old is not sc:  # an id minted here is new: only a caller's own reuse of it gets here
            return self.ensure_session(session_id, agent_id=agent_id, created_by=created_by, on_failure=on_failure,
                                       fresh=True)
        self._pending.add(session_id)
        if len(self._sessions) > self.max_sessions:
            # Not written here (the deferral saves that write; this may be an event loop): the background trimmer
            # writes what the oldest records hold, a new record like this one is kept (see trim).
            self.trim(write=False)
        return sc

    def persist(self, session_id: str | None = None) -> None:
        """Write the session ``session_id`` (every one, when None) this process started and has not written yet
        (:meth:`defer_start`): what a reader of the store calls first, so that it finds the session."""
        if not self._pending:
            return
        for sid in [session_id] if session_id is not None else list(self._pending):
            sc = self._sessions.get(sid)
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
        sc = self._sessions.get(session_id)
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
            row = self.store.get_or_create_session(session_id, create=create, values=values)
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
        if session_id in self._sessions:
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
        sc = self._sessions.get(session_id)
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
        if self._pending:
            if not wait and any((sc := self._sessions.get(i)) is not None and sc.start is not None
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
        return self.store.sessions_with_call(session_ids, call_id)

    def flush_counts(self, session_id: str | None = None, cache: SessionCache | None = None) -> None:
        """Write the in-memory SAFE call counters (on session exit and close), and any deferred marks; ``cache``:
        the caller's own record of ``session_id`` as well (it may have left this cache: an ended session)."""
        self.flush_marks()
        self.persist(session_id)  # a session started here and not written yet is written now, with its values
        mapped = self._sessions.get(session_id) if session_id is not None else None
        targets = [mapped] if mapped is not None else []
        if cache is not None and cache is not mapped:
            targets.append(cache)
        if session_id is None:
            # Evicted records something still holds count too (a holder may have counted into one since).
            targets = list(self._sessions.values()) + list(self._evicted.values())
        for sc in targets:
            self._write_record(sc)

    def end_session(self, session_id: str, state: SessionState, allowed: tuple[str, ...]) -> bool | None:
        """The session moved to ``state`` from one of ``allowed`` with its in-memory call counts, in one durable
        statement that also writes this process's deferred marks where the hot path can (PostgreSQL; elsewhere
        they are written first): True when done, False when it was in no state of ``allowed``, None when the hot
        path has no such statement here (the caller flushes the counts and changes the state itself). On False or
        None nothing of the session was written and the counts stay in memory (the marks were written)."""
        sc = self._sessions.get(session_id)
        if sc is None or not sc.persisted:
            return None  # known only from SAFE calls (or not at all here): the general path records it
        if not self.hot.ends_with_marks:
            self.flush_marks()
            return self._end_session(sc, state, allowed, [])[0]
        # The deferred marks (fast mode's, this session's and any other's queued here) ride in the end's own
        # statement and commit: a marks batch of its own before it was a statement and a commit more per session.
        return self._with_queued_marks(lambda batch: self._end_session(sc, state, allowed, batch))

    def _end_session(self, sc: SessionCache, state: SessionState, allowed: tuple[str, ...],
                     marks: list[tuple[str, str, float]]) -> tuple[bool | None, int]:
        safe, carried = sc.take_safe(), sc.take_carried()
        try:
            done = self.hot.end_session(sc.session_id, safe + carried, state.value, allowed, time.time(), marks)
        except BaseException:
            self._give_back(sc, safe, carried)
            raise
        if not done:
            self._give_back(sc, safe, carried)
        return (None if done is None else bool(done)), (done.marked if done is not None else 0)

    # -- routing ---------------------------------------------------------------------------------

    def session_cache(self, session_id: str, *, wait: bool = True) -> SessionCache:
        """This process's record of a session, made (not persisted) on first sight, without I/O; a session whose
        record may have been evicted (see ``trim``) is read from the store again instead, so that its pins still
        hold. ``wait=False`` raises ``WouldBlock`` when that read would wait for a connection (an event loop)."""
        sc = self._sessions.get(session_id)
        if sc is None:
            with self._sessions_lock:
                sc = self._sessions.get(session_id) or self._revive(session_id)
            if sc is None:
                if self._evicted_ids[hash(session_id) & _SLOT_MASK]:
                    return self.look_up_session(session_id, wait=wait)
                sc = self._new_record(session_id, write=False)
        return sc

    def _new_record(self, session_id: str, *, write: bool) -> SessionCache:
        """A record of a session the store does not have (known from SAFE calls until its first write)."""
        sc = SessionCache(session_id, _ACTIVE, {}, "rollback", persisted=False)
        with self._sessions_lock:
            sc = self._sessions.setdefault(session_id, sc)
        if len(self._sessions) > self.max_sessions:
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
        if sc.gone:  # evicted meanwhile (after counting: see _evict): the record goes back, with this count
            self._come_back(sc)

    def decide_safe(self, session_id: str, spec: ToolSpec, args: Mapping[str, Any],
                    call_id: str | None = None, wait: bool = True) -> Execute:
        """:meth:`intercept_spec` for a SAFE ``spec``: the call id checked, the arguments validated against the
        contract, the session's pin checked (``ContractChanged``) and the call counted in memory; nothing is written.

        In one frame (:meth:`note_safe` inline): a framework adapter decides every SAFE call here, inside an agent
        step where each frame's code and data are cold.

        Example:
            >>> d = undolog.engine.decide_safe("thread-1", spec, {"order_id": "A-17"}, "call-1")   # doctest: +SKIP
            >>> d.effect_id is None
            True
        """
        if call_id is not None:
            check_id("call_id", call_id)
        values = spec.values(spec.validate(args))
        sc = self._sessions.get(session_id)
        self.note_safe_in(sc if sc is not None else self.session_cache(session_id, wait=wait), spec, values)
        d = _new(Execute)  # execute_now, inline (a frame less on every SAFE call)
        _set_attr(d, "__dict__", {"effect_id": None, "args": values, "idempotency_key": None, "tier": SAFE,
                                  "tool_name": spec.name, "call_id": call_id, "session_id": session_id,
                                  "approval_request_id": None, "decision": None})
        return d

    def intercept(
        self,
        session_id: str,
        tool_name: str,
        args: Mapping[str, Any],
        *,
        call_id: str | None = None,
        match_digest: bool = False,
    ) -> Decision:
        """Decide what happens to one tool call (the call driver's first step).

        ``match_digest=True`` lets an IRREVERSIBLE call whose ``call_id`` is new pick up a waiting or approved
        request of the same session for the same (tool, arguments): frameworks that mint new call ids on every
        run (a new CrewAI kickoff) use it.

        Example:
            >>> d = undolog.engine.intercept("thread-1", "delete_user_account", {"user_id": "u1"}, call_id="c-7")
            >>> isinstance(d, AwaitingApproval)
            True
        """
        spec = self._registry.tools.get(tool_name)
        if spec is None:
            raise ToolNotRegistered(tool_name)
        check_id("session_id", session_id)
        return self.intercept_spec(session_id, spec, args, call_id, match_digest)

    def intercept_spec(
        self, session_id: str, spec: ToolSpec, args: Mapping[str, Any], call_id: str | None = None,
        match_digest: bool = False, wait: bool = True,
    ) -> Decision:
        """``intercept`` for a registered tool's spec and a session id already checked.

        ``wait=False`` (an event loop) raises ``WouldBlock`` before anything is written when the decision would
        have to wait for a connection or a lock, or needs more than the hot path's one statement: the caller
        then runs the same call in a thread.
        """
        if spec.tier is SAFE:
            return self.decide_safe(session_id, spec, args, call_id, wait)
        if call_id is not None:
            check_id("call_id", call_id)
        copy = spec._as_is_json
        values = copy(args) if copy is not None else None
        if values is not None:
            # A schema-declared contract whose model would give these arguments back unchanged, each a str, int,
            # float, bool or None (ToolSpec._as_is_json): the values are a copy of them and so is their JSON snapshot
            # (what validate, values and snapshot would give, without the model's two dumps; a NaN or an infinity
            # is made a string below, as the snapshot makes it).
            args_json: Any = {**values}
        else:
            model = spec.validate(args)
            values = spec.values(model)
            args_json = spec.snapshot(model)
        try:
            args_text = canonical_text(args_json)
        except ValueError:  # a NaN or an infinity: stored as a string, the same on both databases
            args_json = json_safe(args_json)
            args_text = canonical_text(args_json)
        # Too deep, or not valid Unicode: refused before any write. Short ASCII text can be neither (the common
        # case: args_problem's own first checks, without its calls).
        if len(args_text) > _SHORT_JSON or not args_text.isascii():
            problem = args_problem(args_json, args_text)
            if problem is not None:
                raise ArgumentsInvalid(spec.name, [problem])
        if spec.tier is COMPENSABLE:
            return self.intercept_compensable(session_id, spec, values, args_json, call_id, args_text, wait)
        if not wait:
            raise WouldBlock()  # a gated call reads and writes several rows: not on an event loop
        return self.intercept_irreversible(session_id, spec, args_json, call_id, match_digest=match_digest)

    def _session(self, session_id: str) -> SessionCache:
        sc = self._sessions.get(session_id)
        if sc is None or not sc.persisted:
            sc = self.ensure_session(session_id)
        return sc

    def _check_pin(self, sc: SessionCache, spec: ToolSpec) -> bool:
        pinned = sc.pins.get(spec.name)
        if pinned is None:
            return True  # first use of a tool registered after the session began: pin it now
        if pinned != spec.revision:
            raise ContractChanged(sc.session_id, spec.name, pinned, spec.revision)
        return False

    def _guard(self, conn: Any, sc: SessionCache, count: int, *, pin: ToolSpec | None) -> None:
        """Inside a write: flush the counted calls and prove the session still accepts writes."""
        pins = None
        if pin is not None:
            sc.pins[pin.name] = pin.revision
            pins = dict(sc.pins)
        refused = self.store.guard_in(conn, sc.session_id, count, pins)
        if refused is None:
            return
        sc.state = refused.state
        if refused.state == SessionState.HALTED:
            raise SessionHalted(sc.session_id, refused.halted_reason)
        raise SessionClosed(sc.session_id, refused.state)

    # -- COMPENSABLE -------------------------------------------------------------------------------

    def intercept_compensable(
        self,
        session_id: str,
        spec: ToolSpec,
        values: dict[str, Any],
        args_json: Any,
        call_id: str | None,
        args_text: str | None = None,
        wait: bool = True,
    ) -> Decision:
        sc = self._sessions.get(session_id)
        start = None
        if sc is None or not sc.persisted:
            start = sc.start if sc is not None else None
            if start is None:
                if not wait:
                    raise WouldBlock()
                sc = self.ensure_session(session_id)
        assert sc is not None
        # The tool's pinned revision is this one (the common case), or _check_pin pins it or refuses the call.
        pin = None if sc.pins.get(spec.name) == spec.revision else spec if self._check_pin(sc, spec) else None
        if pin is not None:
            if not wait:
                raise WouldBlock()
            if start is not None:  # a tool registered since the session started: the general path, row first
                sc, start = self.ensure_session(session_id), None
        # Before anything is taken or counted as running here: a hook that stops the call at this point (what
        # check_undo does) leaves nothing to give back.
        if _faults._armed is not None:  # a call per point costs more than the test, on every COMPENSABLE call
            fault(FaultPoint.BEFORE_PREWRITE, session_id, spec.name)
        effect_id = new_id()
        if args_text is None:
            args_text = canonical_text(args_json)
        digest = sha256_hex(args_text)
        now = _clock.now()  # the pre-write's lease starts here: on UndoLog's clock, as every lease
        safe = sc.take_safe() if sc.dirty else 0
        carried = sc.take_carried() if safe else 0
        comp = spec.compensation
        assert comp is not None
        self._inflight.add(effect_id)
        try:
            # With ``start``, the session's row is written by this same statement.
            kickoff = KICKOFF.get()
            written = pin is None and kickoff is None and self.hot.prewrite(
                session_id, safe + carried, effect_id, call_id or effect_id, spec.name, spec.revision, args_text,
                digest, self.leases.owner, now, now + self.lease_seconds, comp.name, comp.version, wait, start,
            )
            if written:
                if start is not None:  # the session's row went in with this call
                    self.remember(SessionRow(session_id, SessionState.ACTIVE.value, start["pinned_revisions"],
                                             start["on_failure"]), write=wait)
                next(sc.carried)  # this call rides along with the session's next flushing write
                if sc.gone:  # evicted meanwhile (see _evict): the record goes back, with this count
                    self._come_back(sc)
            elif not wait:
                raise WouldBlock()  # refused: the precise error needs more reads, in a thread
            else:
                if start is not None:  # its id was in the store already (nothing written): read it, as before
                    sc = self.ensure_session(session_id)
                # Pinning a newly registered tool, or the session refused the write: the general path
                # does the same transaction and raises the precise error.
                self._prewrite_core(sc, spec, safe + carried + 1, pin, effect_id, call_id, args_json, digest,
                                    from_epoch(now), kickoff)
        except IntegrityConflict:
            self._inflight.discard(effect_id)
            self._give_back(sc, safe, carried)
            if call_id is None:
                raise
            if not wait:
                raise WouldBlock() from None  # nothing was written; the re-issue is read in a thread
            return self._existing(session_id, spec, call_id, digest)
        except (SessionHalted, SessionClosed) as refused:
            self._inflight.discard(effect_id)
            self._give_back(sc, safe, carried)
            # A framework re-running a call that already ran gets its result, even on a halted session:
            # telling the model "refused" would be a lie about what happened.
            if call_id is not None and self.store.call_exists(session_id, call_id):
                try:
                    return self._existing(session_id, spec, call_id, digest)
                except InvalidEffectState:
                    # No result to give (the call was undone by the rollback, or failed, or never finished): it
                    # does not run again, and the session's own refusal says why (a LangGraph resume re-issuing
                    # a call its interrupt released before a rollback made elsewhere).
                    raise refused from None
            raise
        except BaseException:
            self._inflight.discard(effect_id)
            self._give_back(sc, safe, carried)
            raise
        if not self.leases.loop._started:  # (its renewing loop is running already: the common case, without a call)
            self.leases.start()
        sc.recent.append((spec.name, "compensable", args_json, "pending"))
        if _faults._armed is not None:
            fault(FaultPoint.AFTER_PREWRITE, session_id, spec.name, effect_id)
        d = _new(Execute)  # (execute_now, inline: a frame fewer on every COMPENSABLE call)
        _set_attr(d, "__dict__", {"effect_id": effect_id, "args": values, "idempotency_key": "do-" + effect_id,
                                  "tier": COMPENSABLE, "tool_name": spec.name, "call_id": call_id,
                                  "session_id": session_id, "approval_request_id": None, "decision": None})
        return d

    def _prewrite_core(
        self, sc: SessionCache, spec: ToolSpec, count: int, pin: ToolSpec | None, effect_id: str,
        call_id: str | None, args_json: Any, digest: str, now: dt.datetime, kickoff_id: str | None = None,
    ) -> None:
        assert spec.compensation is not None
        with self.store.tx() as conn:
            self._guard(conn, sc, count, pin=pin)
            seq = self.store.insert_effect_in(conn, {
                "effect_id": effect_id, "session_id": sc.session_id, "call_id": call_id or effect_id,
                "tool_name": spec.name, "tool_revision": spec.revision, "tier": COMPENSABLE.value,
                "state": EffectState.PENDING.value, "args_snapshot": args_json, "args_digest": digest,
                "owner": self.leases.owner, "lease_until": now + dt.timedelta(seconds=self.lease_seconds),
                "recovery_attempts": 0, "created_at": now, "updated_at": now, "kickoff_id": kickoff_id,
            })
            self.store.insert_undo_in(conn, {
                "undo_id": seq, "effect_id": effect_id, "session_id": sc.session_id,
                "compensation_name": spec.compensation.name, "compensation_version": spec.compensation.version,
                "args_snapshot": args_json, "state": "armed", "attempts": 0, "created_at": now, "updated_at": now,
            })

    def _existing(self, session_id: str, spec: ToolSpec, call_id: str, digest: str) -> Decision:
        """The same call_id again: the same decision or the stored result, never a second execution."""
        self.flush_marks()
        row = self.store.effect_by_call(session_id, call_id)
        if row is None:
            raise InvalidEffectState(f"call {call_id!r} conflicted but cannot be found")
        if row.tool_name != spec.name:
            raise CallIdConflict(session_id, call_id, f"for tool {row.tool_name!r}, not {spec.name!r}")
        if row.args_digest != digest:
            raise CallIdConflict(session_id, call_id, "with different arguments")
        if row.state == EffectState.RELEASED:
            return self._reclaim(self._session(session_id), row, spec)
        return self._replay(row)

    def _reclaim(self, sc: SessionCache, row: Any, spec: ToolSpec) -> Decision:
        """A call released by a framework's control flow (a LangGraph interrupt) is run again by its re-issue.

        Only while the session still accepts calls and, for an IRREVERSIBLE call, while its approval still stands:
        a session rolled back or halted since the release (a rejection of another request halts it), or a request
        cancelled meanwhile, refuses the re-issue like any other call.
        """
        now = utcnow()
        args_json = row.args_snapshot
        request_id, decision = None, None  # (for an IRREVERSIBLE call: its request, and how it was decided)
        added, lost = row.effect_id not in self._inflight, False  # (as in _claim_run: a loser leaves it alone)
        self._inflight.add(row.effect_id)
        try:
            with self.store.tx() as conn:
                self._guard(conn, sc, 0, pin=None)
                if row.tier == IRREVERSIBLE:
                    req = self.store.request_of_effect_in(conn, row.effect_id)
                    self._check_still_approved(req, row)
                    if req is not None:
                        request_id, decision = req.approval_request_id, "approve"
                    if req is not None and req.approved_args is not None:
                        args_json = req.approved_args  # a modify: what the person approved runs, nothing else
                        if canonical_json(req.approved_args) != canonical_json(row.args_snapshot):
                            decision = "modify"  # (the adapter tells the model its call was changed)
                epoch = self.store.claim_effect_in(
                    conn, row.effect_id, from_state=EffectState.RELEASED.value,
                    to_state=row.released_from or EffectState.PENDING.value, owner=self.leases.owner,
                    lease_until=now + dt.timedelta(seconds=self.lease_seconds), now=now,
                )
                if not epoch:
                    lost = True
                    raise InvalidEffectState(f"call {row.call_id!r} was re-claimed by another caller")
                self.store.back_in_flight_in(conn, row.seq)
        except BaseException:
            if added and not lost:
                self._inflight.discard(row.effect_id)
            raise
        self.leases.start()
        args = spec.checked(args_json)
        return Execute(row.effect_id, args, f"do-{row.effect_id}", spec.tier, spec.name, row.call_id, row.session_id,
                       request_id, decision, epoch=epoch)

    @staticmethod
    def _check_still_approved(req: Any, row: Any) -> None:
        if req is None or req.state in (RequestState.APPROVED, RequestState.AUTO_APPROVED):
            return
        if req.state == RequestState.CANCELLED:
            raise ApprovalCancelled(req.approval_request_id, req.decision_reason)
        if req.state == RequestState.REJECTED:
            raise ApprovalRejected(req.approval_request_id, req.decision_reason, req.decided_by)
        if req.state == RequestState.TIMED_OUT:
            raise ApprovalTimedOut(req.approval_request_id)
        raise InvalidEffectState(f"call {row.call_id!r}: its approval request is {req.state}")

    def release(self, effect_id: str) -> None:
        """Give an in-flight call back without an outcome, for a framework's control-flow exception.

        The tool raised something like LangGraph's ``GraphInterrupt``: it did not fail, it will be re-run.
        The effect stays on the undo stack (it may have half-happened) and recovery leaves it alone; the re-issued
        call (same call_id) runs it again under the same effect id and idempotency key, if the session and its
        approval still allow it then.
        """
        try:
            state = self.store.release_effect(effect_id)
        finally:
            self._inflight.discard(effect_id)
        if state is None:
            raise EffectNotFound(effect_id)
        if state not in IN_FLIGHT:
            raise InvalidEffectState(f"effect {effect_id} is {state}; only an in-flight call can be released")

    def _replay(self, row: Any) -> Decision:
        if row.state == EffectState.COMMITTED:
            return Completed(row.effect_id, row.result_snapshot, row.tool_name)
        if row.state in IN_FLIGHT:
            if row.owner == self.leases.owner and row.effect_id in self._inflight:
                raise CallRunning(f"call {row.call_id!r} ({row.tool_name}) is running right now",
                                  effect_id=row.effect_id)
            if not owner_alive(row.owner, row.lease_until, effect_id=row.effect_id):
                raise InvalidEffectState(
                    f"call {row.call_id!r} ({row.tool_name}) was interrupted by a crash; run `undolog recover` "
                    "before re-issuing it"
                )
            raise CallRunning(f"call {row.call_id!r} ({row.tool_name}) is running in another process",
                              effect_id=row.effect_id)
        if row.state == EffectState.UNKNOWN:
            raise OutcomeUnknown(row.effect_id)
        raise InvalidEffectState(
            f"call {row.call_id!r} ({row.tool_name}) already ended as {row.state}"
            + (f": {row.error}" if row.error else "")
        )

    # -- IRREVERSIBLE ------------------------------------------------------------------------------

    def intercept_irreversible(
        self, session_id: str, spec: ToolSpec, args_json: Any, call_id: str | None, *, match_digest: bool = False
    ) -> Decision:
        fault(FaultPoint.BEFORE_GATE, session_id, spec.name)
        sc = self._session(session_id)
        pin = spec if self._check_pin(sc, spec) else None
        args_canon = canonical_json(args_json)
        digest = sha256_hex(args_canon)
        action_digest = spec.action_digest(args_canon)
        existing = self.store.find_irreversible(session_id, spec.name, call_id, digest)
        if existing is None and call_id is not None and match_digest:
            existing = self.store.find_irreversible(session_id, spec.name, None, digest)
        if existing is not None and existing.state == EffectState.APPROVED and self._approvals.lapsed(
            existing.decided_at
        ):
            # Approved too long ago (approved_ttl_seconds) and never re-issued: the approval lapses (its effect gives
            # the call_id up) and the agent must ask again, so this call raises a new request.
            self._approvals.lapse([existing.approval_request_id])
            existing = self.store.find_irreversible(session_id, spec.name, call_id, digest)
            if existing is None and call_id is not None and match_digest:
                existing = self.store.find_irreversible(session_id, spec.name, None, digest)
        if existing is not None:
            try:
                return self._resume_irreversible(sc, spec, existing, digest)
            except _ClaimLost as lost:
                # Between this caller's read of the approved call and its claim, another caller claimed it or the
                # sweeper let the approval lapse (approved_ttl_seconds): answer as a re-issue made now would (running
                # elsewhere, its result, or a new request), not with a conflict nobody can act on. Read once: a call
                # approved again meanwhile keeps the conflict rather than looping.
                existing = self.store.find_irreversible(session_id, spec.name, call_id, digest)
                if existing is None and call_id is not None and match_digest:
                    existing = self.store.find_irreversible(session_id, spec.name, None, digest)
                if existing is not None and existing.state == EffectState.APPROVED:
                    raise InvalidEffectState(lost.message) from None
                if existing is not None:
                    return self._resume_irreversible(sc, spec, existing, digest)
        return self._request_approval(sc, spec, args_json, digest, action_digest, call_id, pin)

    def _resume_irreversible(self, sc: SessionCache, spec: ToolSpec, row: Any, digest: str) -> Decision:
        session_id = sc.session_id
        if row.tool_name != spec.name:
            raise CallIdConflict(session_id, row.call_id, f"for tool {row.tool_name!r}, not {spec.name!r}")
        approved_digest = None
        if row.approved_args is not None:
            approved_digest = sha256_hex(canonical_json(row.approved_args))
        if digest not in (row.args_digest, approved_digest):
            raise CallIdConflict(session_id, row.call_id, "with different arguments")
        state = row.state
        if state == EffectState.AWAITING_APPROVAL:
            if row.timeout_at is not None and row.timeout_at <= utcnow():
                self._approvals.expire([row.approval_request_id])
                fresh = self.store.find_irreversible(sc.session_id, spec.name, row.call_id, digest)
                return self._resume_irreversible(sc, spec, fresh, digest)
            return self._awaiting(spec, row, row.args_snapshot)
        if state == EffectState.APPROVED:
            return self._claim_run(sc, spec, row)
        if state == EffectState.RELEASED:
            return self._reclaim(sc, row, spec)
        if state == EffectState.REJECTED:
            raise ApprovalRejected(row.approval_request_id, row.decision_reason, row.decided_by)
        if state == EffectState.TIMED_OUT:
            raise ApprovalTimedOut(row.approval_request_id)
        if state == EffectState.CANCELLED:
            if row.req_state == RequestState.RESPONDED:
                # A person answered in the tool's place: their answer is the result, the tool never runs.
                return Completed(row.effect_id, row.result_snapshot, row.tool_name)
            raise ApprovalCancelled(row.approval_request_id, row.decision_reason)
        return self._replay(row)

    def _awaiting(self, spec: ToolSpec, row: Any, args: Any) -> AwaitingApproval:
        left = max(0.0, (row.timeout_at - utcnow()).total_seconds()) if row.timeout_at else 0.0
        return AwaitingApproval(
            effect_id=row.effect_id,
            approval_request_id=row.approval_request_id,
            retry_after=min(left, 30.0) if left else 1.0,
            tool_name=spec.name,
            args=dict(args),
            reason=spec.reason,
            risk_tags=spec.risk_tags,
            timeout_at=row.timeout_at,
            call_id=row.call_id,
        )

    def _claimed_here(self, effect_id: str) -> bool:
        """Whether the call is running under this instance's owner (a concurrent caller here won its claim)."""
        try:
            now = self.store.effect(effect_id)
        except Exception:  # noqa: BLE001 - unreadable: keep vouching rather than drop a call that may be ours
            return True
        return bool(now.owner == self.leases.owner and now.state == EffectState.RUNNING.value)

    def _claim_run(self, sc: SessionCache, spec: ToolSpec, row: Any) -> Decision:
        """Durably mark an approved call as running before it runs, so a crash is never followed by a blind re-run."""
        now = utcnow()
        count = sc.take_count() + 1
        # In the in-flight set before the claim commits (this process vouches for the call from then on); only
        # the caller that put it there, and did not lose the claim, takes it out on failure: a concurrent caller of
        # the same call in this process that lost the claim must not unregister the winner's running call.
        added, lost = row.effect_id not in self._inflight, False
        self._inflight.add(row.effect_id)
        try:
            with self.store.tx() as conn:
                self._guard(conn, sc, count, pin=None)
                epoch = self.store.claim_effect_in(
                    conn, row.effect_id, from_state=EffectState.APPROVED.value, to_state=EffectState.RUNNING.value,
                    owner=self.leases.owner, lease_until=now + dt.timedelta(seconds=self.lease_seconds), now=now,
                )
                if not epoch:
                    lost = True
                    raise _ClaimLost(f"call {row.call_id!r} was claimed by another caller")
                self.store.back_in_flight_in(conn, row.seq)
        except BaseException:
            if added and (not lost or not self._claimed_here(row.effect_id)):
                # Put there by this caller, and no caller of this process runs it: this process must not vouch
                # for (renew the lease of) a call another process runs, or one that never ran.
                self._inflight.discard(row.effect_id)
            self._give_back(sc, count - 1)
            raise
        self.leases.start()
        args = row.approved_args if row.approved_args is not None else row.args_snapshot
        validated = spec.checked(args)
        fault(FaultPoint.AFTER_APPROVED_CLAIM)
        decision = ("auto_approved" if row.req_state == RequestState.AUTO_APPROVED
                    else "modify" if row.approved_digest not in (None, row.args_digest) else "approve")
        return Execute(row.effect_id, validated, f"do-{row.effect_id}", IRREVERSIBLE, spec.name, row.call_id,
                       sc.session_id, row.approval_request_id, decision, epoch)

    def _request_approval(
        self,
        sc: SessionCache,
        spec: ToolSpec,
        args_json: Any,
        digest: str,
        action_digest: str,
        call_id: str | None,
        pin: ToolSpec | None,
    ) -> Decision:
        effect_id = new_id()
        request_id = new_id()
        now = utcnow()
        count = sc.take_count() + 1
        try:
            with self.store.tx() as conn:
                self._guard(conn, sc, count, pin=pin)
                policy = self._policy.read(conn)
                timeout_at = now + dt.timedelta(seconds=policy.approval_timeout_seconds)
                context = self._agent_context(conn, sc, policy.context_calls)
                self.store.insert_effect_in(conn, {
                    "effect_id": effect_id, "session_id": sc.session_id, "call_id": call_id or effect_id,
                    "tool_name": spec.name, "tool_revision": spec.revision, "tier": IRREVERSIBLE.value,
                    "state": EffectState.AWAITING_APPROVAL.value, "args_snapshot": args_json, "args_digest": digest,
                    "recovery_attempts": 0, "created_at": now, "updated_at": now, "kickoff_id": KICKOFF.get(),
                })
                payload = {
                    "approval_request_id": request_id, "session_id": sc.session_id, "effect_id": effect_id,
                    "tool_name": spec.name, "proposed_args": args_json, "reason": spec.reason,
                    "risk_tags": list(spec.risk_tags), "timeout_at": timeout_at.isoformat(),
                }
                self.store.insert_request_in(conn, {
                    "approval_request_id": request_id, "effect_id": effect_id, "session_id": sc.session_id,
                    "call_id": call_id or effect_id, "tool_name": spec.name, "tool_revision": spec.revision,
                    "tool_fingerprint": spec.fingerprint, "proposed_args": args_json, "action_digest": action_digest,
                    "reason": spec.reason, "risk_tags": list(spec.risk_tags), "agent_context": context,
                    "state": RequestState.PENDING.value, "timeout_at": timeout_at, "created_at": now,
                }, now, actor=f"agent:{sc.session_id}", payload=payload)
        except IntegrityConflict:
            self._give_back(sc, count - 1)
            if call_id is None:
                raise
            # A concurrent re-run raised the same request first: return that one, never a second request.
            row = self.store.find_irreversible(sc.session_id, spec.name, call_id, digest)
            if row is None:
                # The id is taken in another session (a client key unique beyond one session, see schema.py's
                # ux_undolog_effect_client_key): nothing was written here; the caller asks that session.
                raise InvalidEffectState(f"call {call_id!r} is another session's") from None
            return self._resume_irreversible(sc, spec, row, digest)
        except BaseException:
            self._give_back(sc, count - 1)
            raise
        sc.state = SessionState.AWAITING_APPROVAL.value
        sc.recent.append((spec.name, IRREVERSIBLE.value, args_json, EffectState.AWAITING_APPROVAL.value))
        engine_log.info("pause: %s waits for approval request %s (session %s, effect %s, timeout at %s)",
                        spec.name, request_id, sc.session_id, effect_id, timeout_at.isoformat(),
                        extra=ids(sc.session_id, effect_id, request_id))
        left = float(policy.approval_timeout_seconds)
        return AwaitingApproval(
            effect_id=effect_id,
            approval_request_id=request_id,
            retry_after=min(left, 30.0),
            tool_name=spec.name,
            args=dict(args_json),
            reason=spec.reason,
            risk_tags=spec.risk_tags,
            timeout_at=timeout_at,
            call_id=call_id or effect_id,
        )

    def _agent_context(self, conn: Any, sc: SessionCache, n: int) -> list[dict[str, Any]]:
        """The session's last N calls: logged effects, plus SAFE calls this process remembers."""
        if n <= 0:
            return []
        logged = [
            {"tool_name": r.tool_name, "tier": r.tier, "state": r.state, "args": r.args_snapshot,
             "at": r.created_at.isoformat()}
            for r in self.store.recent_effects_in(conn, sc.session_id, n)
        ]
        safe = [
            # SAFE arguments are never logged, so never checked: stored here made safe (escaped, capped).
            {"tool_name": name, "tier": tier, "state": state, "args": safe_result(args)}
            for name, tier, args, state in list(sc.recent) if tier == "safe"
        ]
        # SAFE calls have no timestamps in the log; they are shown before the logged calls.
        return (safe + logged)[-n:]

    # -- completion ------------------------------------------------------------------------------

    def complete(self, effect_id: str, result: Any, *, wait: bool = True) -> None:
        """Record success: the effect becomes ``committed`` with its result snapshot.

        ``wait=False`` raises ``WouldBlock`` (nothing written) instead of waiting for a connection or a lock.
        """
        if _faults._armed is not None:
            fault(FaultPoint.AFTER_TOOL)
        text = result_text(result)
        now = time.time()
        if self.fast_commit_mark:
            self._marks.append((effect_id, text, now))
            if _faults._armed is not None:
                fault(FaultPoint.AFTER_MARK_QUEUED)
            self._flusher.ensure()
            return
        try:
            if self.hot.mark(effect_id, text, now, fast=False, wait=wait):
                self._inflight.discard(effect_id)
                return
        except DatabaseUnavailable:
            if not wait:
                raise WouldBlock() from None  # nothing written: asked again with wait=True (in a thread), below
            # A dropped connection (a server restart, pg_terminate_backend) is asked again below on a fresh one:
            # deferred at once, a mark that then finds the call taken over could only tell a caller already
            # answered "done" (the history checker's seed 3 on PostgreSQL).
        if not wait:
            raise WouldBlock()  # not in flight any more: the precise error needs a transaction, in a thread
        for pause in MARK_RETRY_PAUSES:
            try:
                state = self.store.mark_committed(effect_id, text, from_epoch(now), fast=self.fast_commit_mark,
                                                  owner=self.leases.owner)
                break
            except DatabaseUnavailable:
                if pause is None:
                    self._defer_mark(effect_id, text, now)  # still in flight: not discarded from _inflight
                    return
                # The pool's other connections died with the first (a restart terminates them all): a moment,
                # then a fresh one.
                time.sleep(pause)
            except BaseException:
                self._inflight.discard(effect_id)
                raise
        try:
            if state in LATE_FINISH_STATES:
                self._finished_late(effect_id, text, now)
                return
            if state == EffectState.COMMITTED.value:
                return  # taken over, and its probe proved the call happened: the caller's "done" agrees
        finally:
            self._inflight.discard(effect_id)
        if state is not None:
            self._missing_or_moved(effect_id, state, EffectState.COMMITTED)

    def _defer_mark(self, effect_id: str, text: str, now: float) -> None:
        """The database did not answer the commit mark: the tool ran, and its result must not be lost. The mark
        waits in the deferred queue (as in fast mode), retried until the database answers, fenced by owner like the
        durable mark; the effect stays in flight and leased meanwhile (it must not leave ``_inflight``), and if
        this process dies first, recovery reconciles it through the probe."""
        self._marks.append((effect_id, text, now))
        self._flusher.ensure()

    def _finished_late(self, effect_id: str, text: str, now: float) -> None:
        """The tool returned, but another process had taken the call over (recovery claimed it and compensated it,
        or settled it ``unknown``, or is doing so now): recorded, never lost, never re-compensated. The effect
        becomes ``unknown`` with the finish (and its result) in the audit trail, the session halts, and the caller
        gets ``OutcomeConflict``. A probe that proved the call ``committed`` already agrees: nothing to record.

        A database that still does not answer after the retries: the finish waits in the deferred queue (its
        fenced mark lands nowhere, so the flush records the late finish) and the caller gets
        ``DatabaseUnavailable``, never a "done" for a call the log says was compensated."""
        try:
            late = self._record_late_finish(effect_id, text)
        except DatabaseUnavailable:
            self._defer_mark(effect_id, text, now)
            raise
        if late is None:
            return
        answer = self._late_recorded(effect_id, late)
        raise OutcomeConflict(effect_id, late.tool_name, late.session_id, late.state_before, probe=answer)

    def _record_late_finish(self, effect_id: str, text: str) -> LateFinish | None:
        """``store.record_late_finish``, asked again on a fresh connection while the database does not answer (as
        the commit mark is): a late finish lost to one cut connection left an effect ``compensated`` whose side
        effect happened after its undo (the history checker's seed 3 on PostgreSQL, a foreign-looking worker whose
        connections were cut while recovery took its call over)."""
        for pause in MARK_RETRY_PAUSES:
            try:
                return self.store.record_late_finish(effect_id, text, utcnow())
            except DatabaseUnavailable:
                if pause is None:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable: the last pause is None")

    def _late_recorded(self, effect_id: str, late: LateFinish, *, deferred: bool = False) -> str | None:
        """After a late finish is recorded: the session cache halted, the error logged, and the tool's probe asked
        (``on_late_finish``, bound by the facade to recovery's) for the person who decides; its answer."""
        self.note_state(late.session_id, SessionState.HALTED)
        engine_log.error(
            "late finish: %s (session %s, effect %s) finished after another process took it over (it was %s): "
            "recorded, effect unknown, session halted%s", late.tool_name, late.session_id, effect_id,
            late.state_before, " (a deferred commit mark: its caller had been answered)" if deferred else "",
            extra=ids(late.session_id, effect_id))
        if self.on_late_finish is None:
            return None
        try:
            return self.on_late_finish(effect_id, late)
        except Exception:  # noqa: BLE001 - the finish is recorded; a probe that fails informs nobody, and says so
            engine_log.exception("late finish: the probe of %s (effect %s) failed", late.tool_name, effect_id,
                                 extra=ids(late.session_id, effect_id))
            return None

    def record_failure(self, effect_id: str, error: BaseException | str, *, nothing_happened: bool = False,
                       rollback: tuple[str, str] | None = None) -> FailureRecord:
        """Record failure only; returns the session and its on_failure policy for the caller (the driver).

        ``nothing_happened``: the tool reported, by its contract, that it changed nothing; its undo entry goes.

        ``rollback=(session_id, reason)``: the caller rolls the session back next if its policy says so; the
        rollback is then requested in the failure's own transaction, owned by this process (``rollback_requested``
        says whether it was), so a crash between the two leaves it to ``recover()``. The caller's walk takes the
        intent over; whatever becomes of it, the caller ends with ``leases.rolling.discard(session_id)``.
        """
        # The error is stored as text: a lone surrogate or a NUL in it must not lose the failure.
        text = clean_text(error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        self.flush_marks()
        request = None
        if rollback is not None:
            # Counted as walked here before the intent exists: recovery elsewhere must not take it over meanwhile.
            self.leases.rolling.add(rollback[0])
            self.leases.start()
            request = FailureRollback("undolog", rollback[1], self.leases.owner, self.leases.until())
        try:
            state, row = self.store.mark_failed(effect_id, text, utcnow(), nothing_happened, request)
        except BaseException:
            if rollback is not None:
                self.leases.rolling.discard(rollback[0])
            raise
        finally:
            self._inflight.discard(effect_id)
        if state is not None:
            if rollback is not None:
                self.leases.rolling.discard(rollback[0])
            self._missing_or_moved(effect_id, state, EffectState.FAILED)
        if rollback is not None and not row.intent:
            self.leases.rolling.discard(rollback[0])
        if _faults._armed is not None:
            fault(FaultPoint.AFTER_FAILURE_RECORDED)
        return FailureRecord(row.session_id, row.on_failure, row.intent)

    @staticmethod
    def _missing_or_moved(effect_id: str, state: str, target: str) -> None:
        if not state:
            raise EffectNotFound(effect_id)
        raise InvalidEffectState(f"effect {effect_id} is {state}; it cannot become {target}")

    def running(self, d: Execute, session_id: str | None = None, attempt: int = 1) -> _Running:
        """Expose ``current_call()`` to the tool while it runs (a context manager)."""
        return _Running(call_context(session_id or d.session_id, d.effect_id, d.call_id, d.tool_name,
                                      d.idempotency_key, attempt, d.epoch))

    # -- deferred marks ------------------------------------------------------------------------------

    def flush_marks(self) -> None:
        """Write the deferred commit marks now (fast mode); readers in this process call it first."""
        if not self._marks:
            return
        self._with_queued_marks(lambda batch: (None, self.hot.mark_many(batch) if batch else 0))

    def _with_queued_marks(self, write: Callable[[list[tuple[str, str, float]]], tuple[_T, int]]) -> _T:
        """``write(batch)`` of every deferred mark queued now, taken under the marks lock (one writer at a time, in
        queue order); written, their effects leave the in-flight set; if ``write`` raises, they go back to the
        front of the queue, still in flight, and the error goes on.

        ``write`` answers (its result, how many marks landed). The marks are fenced by this process's owner, so
        fewer landed when a call was taken over meanwhile: each such mark is recorded as a late finish
        (:meth:`_deferred_finished_late`), after the lock is let go."""
        with self._marks_lock:
            batch: list[tuple[str, str, float]] = []
            while self._marks:
                batch.append(self._marks.popleft())
            try:
                result, landed = write(batch)
            except BaseException:
                self._marks.extendleft(reversed(batch))
                raise
            for effect_id, _, _ in batch:
                self._inflight.discard(effect_id)
        if landed < len(batch):
            self._deferred_finished_late(batch)
        return result

    def _deferred_finished_late(self, batch: list[tuple[str, str, float]]) -> None:
        """Some deferred marks of ``batch`` did not land: their calls were taken over after they ran here (a stall
        past the lease, ``recover --take-over``). Each is recorded as ``_finished_late`` records a late finish
        (``unknown``, the session halted, ``effect.finished_late`` audited, the probe asked); the call's caller
        had its answer when the mark was queued (fast mode), so the halt is what tells it, at its next call. Marks
        that landed, or whose call a probe already proved ``committed``, are left alone."""
        for effect_id, text, queued in batch:
            try:
                late = self._record_late_finish(effect_id, text)
            except DatabaseUnavailable:
                # Back in the queue, never dropped: its fenced mark lands nowhere again, and the next flush (the
                # flusher's, a reader's, stop()'s) records the late finish once the database answers.
                engine_log.warning("late finish: the database did not answer recording the deferred mark of effect "
                                   "%s; queued again", effect_id, extra=ids(None, effect_id))
                self._marks.append((effect_id, text, queued))
                self._flusher.ensure()
                continue
            except Exception:  # noqa: BLE001 - the next mark's record must still be tried; this one is logged
                engine_log.exception("late finish: could not record the deferred mark of effect %s", effect_id,
                                     extra=ids(None, effect_id))
                continue
            if late is not None:
                self._late_recorded(effect_id, late, deferred=True)

    def _flush_before_stop(self) -> None:
        """The last flush, asked again on a fresh connection while the database does not answer: what is still
        queued when the process ends is lost (a commit mark, or a late finish whose record met a cut connection).
        Still unwritten after the retries: raised, and each effect is named in the log for recovery to settle."""
        for pause in MARK_RETRY_PAUSES:
            try:
                self.flush_marks()
                if not self._marks:
                    return
                error: DatabaseUnavailable | None = None
            except DatabaseUnavailable as exc:
                error = exc
            if pause is None:
                for effect_id, _, _ in list(self._marks):
                    engine_log.error("closing: the commit mark of effect %s could not be written (the database did "
                                     "not answer); recover() settles it", effect_id, extra=ids(None, effect_id))
                raise error or DatabaseUnavailable("the last commit marks", "the database did not answer")
            time.sleep(pause)

    def _flush_due_marks(self) -> float:
        """The flusher's step: the queued marks written once the oldest is ``MARK_FLUSH_SECONDS`` old (each mark is
        written within that period of being queued, as with a batch every period); how long until the next check.

        Not on a fixed beat: a beat that fell inside a session split its marks into two batches, where the
        session's end writes them all in one a moment later (1.6-1.8 batches per session of ten calls on a loaded
        machine, each batch a statement and its commit)."""
        try:
            queued = self._marks[0][2]
        except IndexError:
            return MARK_FLUSH_SECONDS  # a mark queued from now on is due one period after it is queued, or later
        wait = queued + MARK_FLUSH_SECONDS - time.time()
        if wait > 0.001:
            return wait
        self.flush_marks()
        return MARK_FLUSH_SECONDS

    def stop(self) -> None:
        try:
            self._flush_before_stop()
        finally:
            self._flusher.stop()
            self._trimmer.stop()
            self.leases.stop()
            self.hot.close()
