"""The engine: routes every call by tier; the effect log, the undo stack and approval requests it keeps are
written through the storage (``undolog_core/storage``), never by SQL of its own."""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from . import _clock, _faults
from ._faults import FaultPoint, fault
from ._json import canonical_json, canonical_text, json_safe, sha256_hex
from ._leases import Leases, owner_alive
from ._mark_queue import MarkQueue, missing_or_moved
from ._observe import engine_log, ids
from ._sessions_table import DEFAULT_MAX_SESSIONS, SessionCache, SessionTable, check_id
from ._tools import ToolSpec, ToolTier
from .errors import (
    ApprovalCancelled,
    ApprovalRejected,
    ApprovalTimedOut,
    ArgumentsInvalid,
    CallIdConflict,
    CallRunning,
    ContractChanged,
    DatabaseUnavailable,
    EffectNotFound,
    InvalidEffectState,
    OutcomeUnknown,
    SessionClosed,
    SessionHalted,
    ToolNotRegistered,
)
from .limits import (
    MAX_JSON_DEPTH,
    args_problem,
    clean_text,
    result_text,
    safe_result,
)
from .storage.base import FAST_POOL_SIZE, from_epoch, new_id, utcnow
from .storage.effects import FailureRollback, LateFinish
from .storage.hotpath import SessionRow
from .storage.pool import IntegrityConflict, WouldBlock
from .storage.schema import IN_FLIGHT, EffectState, RequestState, SessionState

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


# JSON text this short cannot nest deeper than the limit (see limits.args_problem).
_SHORT_JSON = 2 * MAX_JSON_DEPTH
# What a pre-write carries to the session's row when no SAFE call was counted since its last write.
_NO_COUNT = (0, 0)
SAFE = ToolTier.SAFE
COMPENSABLE = ToolTier.COMPENSABLE
IRREVERSIBLE = ToolTier.IRREVERSIBLE



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



class Engine:
    """The gate: routes calls by tier. Callers walk a call through it with the call driver (``undolog.driver``).

    Its collaborators are explicit: the storage (every statement), the registry (contracts), the policy (approval
    timeouts), the approvals (timeouts applied on read) and the leases (who this process is, what it runs). It holds
    the session table (``table``: this process's session records) and the mark queue (``mark_queue``: deferred
    commit marks, late finishes) and calls their public methods; the names its callers use of them
    (``ensure_session``, ``flush_marks``...) are those methods, bound here once (no frame of the gate's own).
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
        self.store = store
        self._registry = registry
        self._policy = policy
        self._approvals = approvals
        self.leases = leases
        self.lease_seconds = leases.lease_seconds
        self.fast_commit_mark = fast_commit_mark
        self._inflight = leases.inflight
        self.hot = store.hot_path(pool_size=store.pool_size, fast_pool_size=FAST_POOL_SIZE)
        # The table checks max_sessions (a ConfigurationError for a bad one) before anything below uses it.
        table = self.table = SessionTable(store, registry, self.hot, max_sessions=max_sessions)
        # The hot path's remembered session reads (SQLite's turn check, one per thread) bounded like the records.
        self.hot.memo_size = min(self.hot.memo_size, max_sessions)
        self.hot.owner = leases.owner  # the commit mark's fence: never over a call taken over meanwhile
        # (A plain attribute, not a property reading the table's: an adapter reads it on a session's first call.)
        self.max_sessions = max_sessions
        queue = self.mark_queue = MarkQueue(store, self.hot, leases, table, fast_commit_mark=fast_commit_mark)
        # The session table's and the mark queue's methods under the engine's names, bound once: an attribute
        # read, then the method's own frame, as when they were the engine's (the hot path's frame counts hold).
        # The records and the queue are the collaborators' own objects (never rebound there), read directly on
        # the hot path.
        self._sessions = table.records
        self._pending = table.pending
        self.cached = table.cached
        self.note_state = table.note_state
        self.trim = table.trim
        self.needs_trim = table.needs_trim
        self.remember = table.remember
        self.defer_start = table.defer_start
        self.persist = table.persist
        self.current_pins = table.current_pins
        self.ensure_session = table.ensure_session
        self.try_start = table.try_start
        self.look_up_session = table.look_up_session
        self.session_states = table.session_states
        self.sessions_with_call = table.sessions_with_call
        self.session_cache = table.session_cache
        self.note_safe = table.note_safe
        self.note_safe_in = table.note_safe_in
        self._evict = table.evict
        self._give_back = table.give_back
        self._come_back = table.come_back
        self._marks = queue.queue
        self._flusher = queue.flusher
        self.flush_marks = queue.flush

    @property
    def owner(self) -> str:
        return self.leases.owner

    @property
    def on_late_finish(self) -> Callable[[str, LateFinish], str | None] | None:
        """Asked after a late finish is recorded (see ``MarkQueue.on_late_finish``; the facade binds recovery's)."""
        return self.mark_queue.on_late_finish

    @on_late_finish.setter
    def on_late_finish(self, probe: Callable[[str, LateFinish], str | None] | None) -> None:
        self.mark_queue.on_late_finish = probe

    # -- the session's writes that carry the deferred marks ----------------------------------------

    def flush_counts(self, session_id: str | None = None, cache: SessionCache | None = None) -> None:
        """Write the deferred marks, then the in-memory SAFE call counters (on session exit and close); ``cache``:
        the caller's own record of ``session_id`` as well (see ``SessionTable.flush_counts``)."""
        self.flush_marks()
        self.table.flush_counts(session_id, cache)

    def end_session(self, session_id: str, state: SessionState, allowed: tuple[str, ...]) -> bool | None:
        """The session moved to ``state`` from one of ``allowed`` with its in-memory call counts, in one durable
        statement that also writes this process's deferred marks where the hot path can (PostgreSQL; elsewhere
        they are written first): True when done, False when it was in no state of ``allowed``, None when the hot
        path has no such statement here (the caller flushes the counts and changes the state itself). On False or
        None nothing of the session was written and the counts stay in memory (the marks were written)."""
        sc = self._sessions.get(session_id)
        if sc is None or not sc.persisted:
            return None  # known only from SAFE calls (or not at all here): the general path records it
        end = self.table.end_with
        if not self.hot.ends_with_marks:
            self.flush_marks()
            return end(sc, state, allowed, [])[0]
        # The deferred marks (fast mode's, this session's and any other's queued here) ride in the end's own
        # statement and commit: a marks batch of its own before it was a statement and a commit more per session.
        return self.mark_queue.with_queued(lambda batch: end(sc, state, allowed, batch))

    # -- routing ---------------------------------------------------------------------------------

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
        refused = self.store.sessions.guard_in(conn, sc.session_id, count, pins)
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
        # SAFE calls counted since the session's last write ride with this one, and the logged calls carried with
        # them; with none, the carried ones wait for a write that flushes (a run of COMPENSABLE calls).
        safe, carried = sc.take_flush() if sc.dirty else _NO_COUNT
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
            if call_id is not None and self.store.effects.call_exists(session_id, call_id):
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
            seq = self.store.effects.insert_effect_in(conn, {
                "effect_id": effect_id, "session_id": sc.session_id, "call_id": call_id or effect_id,
                "tool_name": spec.name, "tool_revision": spec.revision, "tier": COMPENSABLE.value,
                "state": EffectState.PENDING.value, "args_snapshot": args_json, "args_digest": digest,
                "owner": self.leases.owner, "lease_until": now + dt.timedelta(seconds=self.lease_seconds),
                "recovery_attempts": 0, "created_at": now, "updated_at": now, "kickoff_id": kickoff_id,
            })
            self.store.undo.arm_in(
                conn, undo_id=seq, effect_id=effect_id, session_id=sc.session_id,
                compensation_name=spec.compensation.name, compensation_version=spec.compensation.version,
                args_snapshot=args_json, now=now)

    def _existing(self, session_id: str, spec: ToolSpec, call_id: str, digest: str) -> Decision:
        """The same call_id again: the same decision or the stored result, never a second execution."""
        self.flush_marks()
        row = self.store.effects.effect_by_call(session_id, call_id)
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
                    req = self.store.effects.request_of_effect_in(conn, row.effect_id)
                    self._check_still_approved(req, row)
                    if req is not None:
                        request_id, decision = req.approval_request_id, "approve"
                    if req is not None and req.approved_args is not None:
                        args_json = req.approved_args  # a modify: what the person approved runs, nothing else
                        if canonical_json(req.approved_args) != canonical_json(row.args_snapshot):
                            decision = "modify"  # (the adapter tells the model its call was changed)
                epoch = self.store.effects.claim_effect_in(
                    conn, row.effect_id, from_state=EffectState.RELEASED.value,
                    to_state=row.released_from or EffectState.PENDING.value, owner=self.leases.owner,
                    lease_until=now + dt.timedelta(seconds=self.lease_seconds), now=now,
                )
                if not epoch:
                    lost = True
                    raise InvalidEffectState(f"call {row.call_id!r} was re-claimed by another caller")
                self.store.effects.back_in_flight_in(conn, row.seq)
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
            state = self.store.effects.release_effect(effect_id)
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
        existing = self.store.effects.find_irreversible(session_id, spec.name, call_id, digest)
        if existing is None and call_id is not None and match_digest:
            existing = self.store.effects.find_irreversible(session_id, spec.name, None, digest)
        if existing is not None and existing.state == EffectState.APPROVED and self._approvals.lapsed(
            existing.decided_at
        ):
            # Approved too long ago (approved_ttl_seconds) and never re-issued: the approval lapses (its effect gives
            # the call_id up) and the agent must ask again, so this call raises a new request.
            self._approvals.lapse([existing.approval_request_id])
            existing = self.store.effects.find_irreversible(session_id, spec.name, call_id, digest)
            if existing is None and call_id is not None and match_digest:
                existing = self.store.effects.find_irreversible(session_id, spec.name, None, digest)
        if existing is not None:
            try:
                return self._resume_irreversible(sc, spec, existing, digest)
            except _ClaimLost as lost:
                # Between this caller's read of the approved call and its claim, another caller claimed it or the
                # sweeper let the approval lapse (approved_ttl_seconds): answer as a re-issue made now would (running
                # elsewhere, its result, or a new request), not with a conflict nobody can act on. Read once: a call
                # approved again meanwhile keeps the conflict rather than looping.
                existing = self.store.effects.find_irreversible(session_id, spec.name, call_id, digest)
                if existing is None and call_id is not None and match_digest:
                    existing = self.store.effects.find_irreversible(session_id, spec.name, None, digest)
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
                fresh = self.store.effects.find_irreversible(sc.session_id, spec.name, row.call_id, digest)
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
            now = self.store.effects.effect(effect_id)
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
                epoch = self.store.effects.claim_effect_in(
                    conn, row.effect_id, from_state=EffectState.APPROVED.value, to_state=EffectState.RUNNING.value,
                    owner=self.leases.owner, lease_until=now + dt.timedelta(seconds=self.lease_seconds), now=now,
                )
                if not epoch:
                    lost = True
                    raise _ClaimLost(f"call {row.call_id!r} was claimed by another caller")
                self.store.effects.back_in_flight_in(conn, row.seq)
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
                self.store.effects.insert_effect_in(conn, {
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
                self.store.approvals.insert_request_in(conn, {
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
            row = self.store.effects.find_irreversible(sc.session_id, spec.name, call_id, digest)
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
            for r in self.store.effects.recent_effects_in(conn, sc.session_id, n)
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
        if not wait:
            raise WouldBlock()  # not in flight any more: the precise error needs a transaction, in a thread
        self.mark_queue.mark_durably(effect_id, text, now)

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
            state, row = self.store.effects.mark_failed(effect_id, text, utcnow(), nothing_happened, request)
        except BaseException:
            if rollback is not None:
                self.leases.rolling.discard(rollback[0])
            raise
        finally:
            self._inflight.discard(effect_id)
        if state is not None:
            if rollback is not None:
                self.leases.rolling.discard(rollback[0])
            missing_or_moved(effect_id, state, EffectState.FAILED)
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

    def stop(self) -> None:
        try:
            self.mark_queue.stop()
        finally:
            self.table.stop()
            self.leases.stop()
            self.hot.close()

