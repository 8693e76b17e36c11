"""The engine: routes every call by tier to its part (issue #35, step 2): a SAFE call decided here in memory, a
COMPENSABLE call's pre-write (``_compensable``), an IRREVERSIBLE call's gate (``_gate``), a commit mark (the mark
queue, ``_mark_queue``), over this process's session records (``_sessions_table``). The effect log, the undo stack
and the approval requests are written through the storage (``undolog_core/storage``), never by SQL of its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._compensable import CompensablePath
from ._decisions import COMPENSABLE, SAFE, Decision, Execute, _new, _Running, _set_attr, call_context
from ._gate import ApprovalExpirer, Gate, PolicyReader
from ._json import canonical_text, json_safe
from ._leases import Leases
from ._mark_queue import MarkQueue
from ._session_record import SessionCache, check_id
from ._sessions_table import DEFAULT_MAX_SESSIONS, SessionTable
from ._tools import ToolSpec
from .errors import ArgumentsInvalid, ToolNotRegistered
from .limits import MAX_JSON_DEPTH, args_problem
from .storage.base import FAST_POOL_SIZE
from .storage.effects import LateFinish
from .storage.pool import WouldBlock
from .storage.schema import SessionState

if TYPE_CHECKING:
    from ._registry import Registry
    from .storage import Storage

# JSON text this short cannot nest deeper than the limit (see limits.args_problem).
_SHORT_JSON = 2 * MAX_JSON_DEPTH


class Engine:
    """Routes calls by tier. Callers walk a call through it with the call driver (``undolog.driver``).

    Its collaborators are explicit: the storage (every statement), the registry (contracts), the policy (approval
    timeouts), the approvals (timeouts applied on read) and the leases (who this process is, what it runs). It holds
    its four parts: the session table (``table``: this process's session records), the mark queue (``mark_queue``:
    commit marks, deferred marks, late finishes), the COMPENSABLE path (``compensable``: the pre-write, a re-issue's
    answer, release, a failure's record) and the gate (``gate``: the IRREVERSIBLE path); the names its callers use
    of them (``ensure_session``, ``complete``, ``record_failure``...) are their methods, bound here once (no frame
    of the engine's own).

    Example:
        >>> d = undolog.engine.intercept("thread-1", "search_orders", {"q": "A-17"}, call_id="c-1")  # doctest: +SKIP
        >>> undolog.engine.complete.__self__ is undolog.engine.mark_queue                         # doctest: +SKIP
        True
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
        self.leases = leases
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
        self._marks = queue.queue
        self._flusher = queue.flusher
        self.flush_marks = queue.flush
        self.complete = queue.complete
        # The COMPENSABLE path and the gate, their entry points bound likewise (intercept_spec's call of either is
        # one frame, as when they were the engine's own methods).
        calls = self.compensable = CompensablePath(store, table, queue, leases)
        self.gate = Gate(store, table, policy, approvals, leases, calls)
        self.intercept_compensable = calls.intercept_compensable
        self.release = calls.release
        self.record_failure = calls.record_failure
        self.intercept_irreversible = self.gate.intercept_irreversible

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

