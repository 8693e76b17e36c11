"""The engine: routes every call by tier and keeps the effect log, the undo stack and approval requests."""

from __future__ import annotations

import collections
import contextvars
import datetime as dt
import itertools
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from pydantic_core import to_json, to_jsonable_python
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from . import _schema as t
from ._audit import append_event, write_outbox
from ._faults import FaultPoint, fault
from ._hotpath import HotPath
from ._pool import WouldBlock
from ._store import FAST_POOL_SIZE, Owner, Store, from_epoch, new_id, utcnow
from ._tools import ToolSpec, ToolTier, canonical_json, sha256_hex
from .errors import (
    ApprovalCancelled,
    ApprovalRejected,
    ApprovalTimedOut,
    CallIdConflict,
    ContractChanged,
    DatabaseUnavailable,
    EffectNotFound,
    InvalidEffectState,
    InvalidId,
    OutcomeUnknown,
    SessionClosed,
    SessionHalted,
    ToolNotRegistered,
)

if TYPE_CHECKING:
    from ._saga import RollbackReport
    from ._undolog import UndoLog



# Every live Engine of this process, by instance id: an owner string names the instance that runs an effect,
# so a second UndoLog in the same process can tell a live call of the first from an abandoned one.
_ENGINES: weakref.WeakValueDictionary[str, Engine] = weakref.WeakValueDictionary()


def owner_alive(
    owner: str | None, lease: dt.datetime | None, *, effect_id: str | None = None, undo_id: int | None = None,
    rolling: str | None = None,
) -> bool:
    """Whether the owner of an in-flight effect (or undo step, or rollback of the session ``rolling``) may still be
    working on it."""
    if not owner:
        return False
    parts = owner.split("|")
    process, instance = "|".join(parts[:3]), parts[3] if len(parts) > 3 else ""
    if process == Owner.me():
        eng = _ENGINES.get(instance)
        if eng is None:
            return False  # that UndoLog of ours was closed: nobody will finish it
        if effect_id is not None:
            return effect_id in eng._inflight
        if undo_id is not None:
            return undo_id in eng._compensating
        if rolling is not None:
            return rolling in eng._rolling
        return lease is not None and lease > utcnow()
    if Owner.is_dead_locally(process):
        return False
    return lease is not None and lease > utcnow()


WRITABLE = ("active", "awaiting_approval")
MARK_FLUSH_SECONDS = 0.05
SAFE = ToolTier.SAFE
COMPENSABLE = ToolTier.COMPENSABLE


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


_current: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("undolog_current_call", default=None)


def current_call() -> CallContext | None:
    """The call being run, for tools that pass ``idempotency_key`` on to an external API.

    Example:
        >>> @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="refund_undo")
        ... def refund(amount: int) -> dict:
        ...     return payments.refund(amount, idempotency_key=current_call().idempotency_key)
    """
    return _current.get()


@dataclass
class SessionCache:
    """What this process knows of a session; the database stays the authority for its state."""

    session_id: str
    state: str
    pins: dict[str, int]
    on_failure: str
    persisted: bool = True
    # (tool_name, tier, args, state) of recent calls, newest last; SAFE calls are known only here.
    recent: collections.deque[tuple[str, str, Any, str]] = field(default_factory=lambda: collections.deque(maxlen=50))
    # next() on itertools.count is atomic under the GIL: lock-free counters for the hot paths.
    # `counter` holds SAFE calls, which must reach the store with the session's next write; `carried` holds
    # logged calls, which ride along with whatever write flushes next (so a run of COMPENSABLE calls does
    # not rewrite the session row every time).
    counter: Iterator[int] = field(default_factory=itertools.count)
    carried: Iterator[int] = field(default_factory=itertools.count)

    def take_safe(self) -> int:
        if not _peek(self.counter):
            return 0  # nothing counted: the counter stays (a call counted meanwhile is still in it)
        old, self.counter = self.counter, itertools.count()
        return _peek(old)

    def take_carried(self) -> int:
        old, self.carried = self.carried, itertools.count()
        return _peek(old)

    def take_count(self) -> int:
        return self.take_safe() + self.take_carried()

    def give_back(self, n: int, carried: int = 0) -> None:
        if n:
            self.counter = itertools.count(self.take_safe() + n)
        if carried:
            self.carried = itertools.count(self.take_carried() + carried)


def _peek(counter: Iterator[int]) -> int:
    return int(repr(counter)[6:-1])  # "count(N)": read without advancing it


MAX_ID_LENGTH = 200


def check_id(what: str, value: Any) -> None:
    """Ids are non-empty strings that fit their columns, checked before any I/O on both databases alike."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or value != value.strip():
        raise InvalidId(what, value, MAX_ID_LENGTH)


def jsonable(value: Any) -> Any:
    # NaN and infinities become "NaN"/"Infinity" strings: PostgreSQL's json refuses them, and both databases
    # must store the same thing. Only the Python-mode converter is needed when no float is special.
    out = to_jsonable_python(value, fallback=repr)
    if _has_special_float(out):
        return json.loads(to_json(value, fallback=repr, inf_nan_mode="strings"))
    return out


def result_text(result: Any) -> str:
    """A result's JSON text, as ``jsonable`` would make it (NaN and infinities as strings), in one Rust pass.

    Only the text is needed on the hot path; whoever needs the value parses it back (``json.loads``).
    """
    return to_json(result, fallback=repr, inf_nan_mode="strings").decode()


def json_safe(value: Any) -> Any:
    """A JSON-mode value (from model_dump(mode="json")) with NaN and infinities made strings, as ``jsonable``."""
    return json.loads(to_json(value, inf_nan_mode="strings")) if _has_special_float(value) else value


# json.dumps builds a new encoder on every call; this one is built once (encoders keep no state between calls).
_canonical_encode = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def canonical_text(value: Any) -> str:
    """``canonical_json`` for a value that is already JSON-safe: the digest and the stored snapshot in one go."""
    return _canonical_encode(value)


class _Running:
    """The context of a running tool; a plain class, because this is on every COMPENSABLE call's path."""

    __slots__ = ("ctx", "token")

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        self.token: contextvars.Token[CallContext | None] | None = None

    def __enter__(self) -> CallContext:
        self.token = _current.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _current.reset(self.token)


def _has_special_float(value: Any) -> bool:
    if isinstance(value, float):
        return value != value or value in (_INF, -_INF)
    if isinstance(value, dict):
        return any(_has_special_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_special_float(v) for v in value)
    return False


_INF = float("inf")


class Engine:
    """Routes calls by tier. Adapters that run tools themselves use ``intercept``/``complete``/``fail``."""

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog
        self.store: Store = undolog.store
        self.lease_seconds = undolog.lease_seconds
        self.fast_commit_mark = undolog.fast_commit_mark
        self._sessions: dict[str, SessionCache] = {}
        self._sessions_lock = threading.Lock()
        self._inflight: set[str] = set()
        self._compensating: set[int] = set()
        self._rolling: set[str] = set()  # sessions whose rollback this engine is walking
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._renew_lock = threading.Lock()
        self.hot = HotPath(self.store, pool_size=self.store.pool_size, fast_pool_size=FAST_POOL_SIZE)
        self.instance = new_id()[:12]
        self.owner = f"{Owner.me()}|{self.instance}"
        _ENGINES[self.instance] = self
        # Fast mode: commit marks wait here for the flusher (a batch every MARK_FLUSH_SECONDS, not fsynced).
        # Their effects stay in flight (leased, renewed) until the mark is written.
        self._marks: collections.deque[tuple[str, str, float]] = collections.deque()  # (effect, result, epoch s)
        self._marks_lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._started: set[str] = set()

    # -- session cache ---------------------------------------------------------------------------

    def cached(self, session_id: str) -> SessionCache | None:
        return self._sessions.get(session_id)

    def remember(self, row: Any) -> SessionCache:
        sc = SessionCache(
            session_id=row.session_id,
            state=row.state,
            pins={k: int(v) for k, v in (row.pinned_revisions or {}).items()},
            on_failure=row.on_failure,
        )
        with self._sessions_lock:
            old = self._sessions.get(row.session_id)
            if old is not None:
                # Keep the counter and recent calls gathered before the session reached the store.
                old.state, old.pins, old.on_failure, old.persisted = sc.state, sc.pins, sc.on_failure, True
                return old
            self._sessions[row.session_id] = sc
        return sc

    def current_pins(self) -> dict[str, int]:
        return {name: spec.revision for name, spec in self._u.registry.tools.items()}

    def ensure_session(
        self,
        session_id: str,
        *,
        agent_id: str | None = None,
        created_by: str | None = None,
        on_failure: str = "rollback",
        create: bool = True,
    ) -> SessionCache:
        sc = self._sessions.get(session_id)
        if sc is not None and sc.persisted:
            return sc
        check_id("session_id", session_id)
        with self.store.tx() as conn:
            row = conn.execute(sa.select(t.sessions).where(t.sessions.c.session_id == session_id)).first()
            if row is None:
                if not create:
                    from .errors import SessionNotFound

                    raise SessionNotFound(session_id)
                now = utcnow()
                values = {
                    "session_id": session_id,
                    "agent_id": agent_id,
                    "state": "active",
                    "tool_calls_total": 0,
                    "created_by": created_by,
                    "halted_reason": None,
                    "on_failure": on_failure,
                    "pinned_revisions": self.current_pins(),
                    "created_at": now,
                    "updated_at": now,
                }
                try:
                    with conn.begin_nested():
                        conn.execute(t.sessions.insert().values(**values))
                except IntegrityError:
                    pass  # another process created it between our read and our insert: use theirs
                row = conn.execute(sa.select(t.sessions).where(t.sessions.c.session_id == session_id)).one()
        return self.remember(row)

    def flush_counts(self, session_id: str | None = None) -> None:
        """Write the in-memory SAFE call counters (on session exit and close), and any deferred marks."""
        self.flush_marks()
        targets = [self._sessions[session_id]] if session_id in self._sessions else []
        if session_id is None:
            targets = list(self._sessions.values())
        for sc in targets:
            n = sc.take_count()
            if not n:
                continue
            with self.store.tx(fast=True) as conn:
                res = conn.execute(
                    t.sessions.update()
                    .where(t.sessions.c.session_id == sc.session_id)
                    .values(tool_calls_total=t.sessions.c.tool_calls_total + n)
                )
                if res.rowcount == 0:
                    # A session known only from SAFE calls: record it so its count is not lost.
                    now = utcnow()
                    conn.execute(
                        t.sessions.insert().values(
                            session_id=sc.session_id, state="active", tool_calls_total=n, on_failure=sc.on_failure,
                            pinned_revisions=sc.pins or self.current_pins(), created_at=now, updated_at=now,
                        )
                    )

    # -- routing ---------------------------------------------------------------------------------

    def spec(self, tool: Any) -> ToolSpec:
        return self._u.registry.spec_for(tool)

    def note_safe(self, session_id: str, spec: ToolSpec, args: Mapping[str, Any]) -> None:
        """The whole bookkeeping of a SAFE call: a counter and the recent-calls ring, both in memory."""
        sc = self._sessions.get(session_id)
        if sc is None:
            sc = SessionCache(session_id, "active", {}, "rollback", persisted=False)
            with self._sessions_lock:
                sc = self._sessions.setdefault(session_id, sc)
        self.note_safe_in(sc, spec, args)

    def note_safe_in(self, sc: SessionCache, spec: ToolSpec, args: Mapping[str, Any]) -> None:
        if sc.pins and sc.pins.get(spec.name, spec.revision) != spec.revision:
            raise ContractChanged(sc.session_id, spec.name, sc.pins[spec.name], spec.revision)
        next(sc.counter)
        sc.recent.append((spec.name, "safe", args, "done"))

    def intercept(
        self,
        session_id: str,
        tool_name: str,
        args: Mapping[str, Any],
        *,
        call_id: str | None = None,
        match_digest: bool = False,
    ) -> Decision:
        """Decide what happens to one tool call.

        ``match_digest=True`` lets an IRREVERSIBLE call whose ``call_id`` is new pick up a waiting or approved
        request of the same session for the same (tool, arguments): frameworks that mint new call ids on every
        run (a new CrewAI kickoff) use it.

        Example:
            >>> d = undolog.engine.intercept("thread-1", "delete_user_account", {"user_id": "u1"}, call_id="c-7")
            >>> isinstance(d, AwaitingApproval)
            True
        """
        spec = self._u.registry.tools.get(tool_name)
        if spec is None:
            raise ToolNotRegistered(tool_name)
        check_id("session_id", session_id)
        return self.intercept_spec(session_id, spec, args, call_id, match_digest)

    def intercept_spec(
        self, session_id: str, spec: ToolSpec, args: Mapping[str, Any], call_id: str | None = None,
        match_digest: bool = False, wait: bool = True,
    ) -> Decision:
        """``intercept`` for a registered tool's spec and a session id already checked (``Session.call``).

        ``wait=False`` (an event loop) raises ``WouldBlock`` before anything is written when the decision would
        have to wait for a connection or a lock, or needs more than the hot path's one statement: the caller
        then runs the same call in a thread.
        """
        if call_id is not None:
            check_id("call_id", call_id)
        model = spec.validate(args)
        values = spec.values(model)
        if spec.tier is SAFE:
            self.note_safe(session_id, spec, values)
            return Execute(None, values, None, SAFE, spec.name, call_id, session_id)
        args_json = spec.snapshot(model)
        try:
            args_text = canonical_text(args_json)
        except ValueError:  # a NaN or an infinity: stored as a string, the same on both databases
            args_json = json_safe(args_json)
            args_text = canonical_text(args_json)
        if spec.tier is COMPENSABLE:
            return self.intercept_compensable(session_id, spec, values, args_json, call_id, args_text, wait)
        if not wait:
            raise WouldBlock()  # a gated call reads and writes several rows: not on an event loop
        return self.intercept_irreversible(session_id, spec, args_json, call_id, match_digest=match_digest)

    def _check_pin(self, sc: SessionCache, spec: ToolSpec) -> bool:
        pinned = sc.pins.get(spec.name)
        if pinned is None:
            return True  # first use of a tool registered after the session began: pin it now
        if pinned != spec.revision:
            raise ContractChanged(sc.session_id, spec.name, pinned, spec.revision)
        return False

    def _guard(self, conn: Connection, sc: SessionCache, count: int, *, pin: ToolSpec | None) -> None:
        """Inside the pre-write: flush the SAFE counter and prove the session still accepts writes."""
        values: dict[str, Any] = {"tool_calls_total": t.sessions.c.tool_calls_total + count}
        if pin is not None:
            sc.pins[pin.name] = pin.revision
            values["pinned_revisions"] = dict(sc.pins)
        res = conn.execute(
            t.sessions.update()
            .where(t.sessions.c.session_id == sc.session_id, t.sessions.c.state.in_(WRITABLE))
            .values(**values)
        )
        if res.rowcount == 1:
            return
        row = conn.execute(
            sa.select(t.sessions.c.state, t.sessions.c.halted_reason).where(t.sessions.c.session_id == sc.session_id)
        ).first()
        if row is None:
            raise InvalidEffectState(f"session {sc.session_id!r} vanished from the store")
        sc.state = row.state
        if row.state == "halted":
            raise SessionHalted(sc.session_id, row.halted_reason)
        raise SessionClosed(sc.session_id, row.state)

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
        if sc is None or not sc.persisted:
            if not wait:
                raise WouldBlock()
            sc = self.ensure_session(session_id)
        pin = spec if self._check_pin(sc, spec) else None
        if pin is not None and not wait:
            raise WouldBlock()
        effect_id = new_id()
        if args_text is None:
            args_text = canonical_text(args_json)
        digest = sha256_hex(args_text)
        now = time.time()
        safe = sc.take_safe()
        carried = sc.take_carried() if safe else 0
        comp = spec.compensation
        assert comp is not None
        self._inflight.add(effect_id)
        fault(FaultPoint.BEFORE_PREWRITE)
        try:
            if pin is None and self.hot.prewrite(
                session_id, safe + carried, effect_id, call_id or effect_id, spec.name, spec.revision, args_text,
                digest, self.owner, now, now + self.lease_seconds, comp.name, comp.version, wait,
            ):
                next(sc.carried)  # this call rides along with the session's next flushing write
            elif not wait:
                raise WouldBlock()  # refused: the precise error needs more reads, in a thread
            else:
                # Pinning a newly registered tool, or the session refused the write: the general path
                # does the same transaction and raises the precise error.
                self._prewrite_core(sc, spec, safe + carried + 1, pin, effect_id, call_id, args_json, digest,
                                    from_epoch(now))
        except IntegrityError:
            self._inflight.discard(effect_id)
            sc.give_back(safe, carried)
            if call_id is None:
                raise
            if not wait:
                raise WouldBlock() from None  # nothing was written; the re-issue is read in a thread
            return self._existing(session_id, spec, call_id, digest)
        except (SessionHalted, SessionClosed):
            self._inflight.discard(effect_id)
            sc.give_back(safe, carried)
            # A framework re-running a call that already ran gets its result, even on a halted session:
            # telling the model "refused" would be a lie about what happened.
            if call_id is not None and self._call_exists(session_id, call_id):
                return self._existing(session_id, spec, call_id, digest)
            raise
        except BaseException:
            self._inflight.discard(effect_id)
            sc.give_back(safe, carried)
            raise
        self._ensure_renewer()
        sc.recent.append((spec.name, "compensable", args_json, "pending"))
        fault(FaultPoint.AFTER_PREWRITE)
        return Execute(effect_id, values, f"do-{effect_id}", COMPENSABLE, spec.name, call_id, session_id)

    def _prewrite_core(
        self, sc: SessionCache, spec: ToolSpec, count: int, pin: ToolSpec | None, effect_id: str,
        call_id: str | None, args_json: Any, digest: str, now: dt.datetime,
    ) -> None:
        assert spec.compensation is not None
        with self.store.tx() as conn:
            self._guard(conn, sc, count, pin=pin)
            inserted = conn.execute(
                t.effect_log.insert(),
                {
                    "effect_id": effect_id,
                    "session_id": sc.session_id,
                    "call_id": call_id or effect_id,
                    "tool_name": spec.name,
                    "tool_revision": spec.revision,
                    "tier": "compensable",
                    "state": "pending",
                    "args_snapshot": args_json,
                    "args_digest": digest,
                    "owner": self.owner,
                    "lease_until": now + dt.timedelta(seconds=self.lease_seconds),
                    "recovery_attempts": 0,
                    "created_at": now,
                    "updated_at": now,
                },
            )
            if self.store.is_postgres:  # on SQLite the schema's trigger wrote the undo entry with the effect
                key = inserted.inserted_primary_key
                assert key is not None
                conn.execute(
                    t.undo_stack.insert(),
                    {
                        "undo_id": key[0],
                        "effect_id": effect_id,
                        "session_id": sc.session_id,
                        "compensation_name": spec.compensation.name,
                        "compensation_version": spec.compensation.version,
                        "args_snapshot": args_json,
                        "state": "armed",
                        "attempts": 0,
                        "created_at": now,
                        "updated_at": now,
                    },
                )

    def _call_exists(self, session_id: str, call_id: str) -> bool:
        with self.store.read() as conn:
            return conn.execute(
                sa.select(t.effect_log.c.effect_id).where(
                    t.effect_log.c.session_id == session_id, t.effect_log.c.call_id == call_id
                )
            ).first() is not None

    def _existing(self, session_id: str, spec: ToolSpec, call_id: str, digest: str) -> Decision:
        """The same call_id again: the same decision or the stored result, never a second execution."""
        self.flush_marks()
        with self.store.read() as conn:
            row = conn.execute(
                sa.select(t.effect_log).where(t.effect_log.c.session_id == session_id, t.effect_log.c.call_id == call_id)
            ).first()
        if row is None:
            raise InvalidEffectState(f"call {call_id!r} conflicted but cannot be found")
        if row.tool_name != spec.name:
            raise CallIdConflict(session_id, call_id, f"for tool {row.tool_name!r}, not {spec.name!r}")
        if row.args_digest != digest:
            raise CallIdConflict(session_id, call_id, "with different arguments")
        if row.state == "released":
            sc = self._sessions.get(session_id)
            if sc is None or not sc.persisted:
                sc = self.ensure_session(session_id)
            return self._reclaim(sc, row, spec)
        return self._replay(row)

    def _reclaim(self, sc: SessionCache, row: Any, spec: ToolSpec) -> Decision:
        """A call released by a framework's control flow (a LangGraph interrupt) is run again by its re-issue.

        Only while the session still accepts calls and, for an IRREVERSIBLE call, while its approval still stands:
        a session rolled back or halted since the release (a rejection of another request halts it), or a request
        cancelled meanwhile, refuses the re-issue like any other call.
        """
        now = utcnow()
        self._inflight.add(row.effect_id)
        try:
            with self.store.tx() as conn:
                self._guard(conn, sc, 0, pin=None)
                if row.tier == "irreversible":
                    self._check_still_approved(conn, row)
                res = conn.execute(
                    t.effect_log.update()
                    .where(t.effect_log.c.effect_id == row.effect_id, t.effect_log.c.state == "released")
                    .values(state=row.released_from or "pending", owner=self.owner,
                            lease_until=now + dt.timedelta(seconds=self.lease_seconds), updated_at=now)
                )
                if res.rowcount != 1:
                    raise InvalidEffectState(f"call {row.call_id!r} was re-claimed by another caller")
                self.back_in_flight(conn, row.seq)
        except BaseException:
            self._inflight.discard(row.effect_id)
            raise
        self._ensure_renewer()
        args = spec.values(spec.validate(row.args_snapshot))
        return Execute(row.effect_id, args, f"do-{row.effect_id}", spec.tier, spec.name, row.call_id, row.session_id)

    def _check_still_approved(self, conn: Connection, row: Any) -> None:
        r = t.approval_requests
        req = conn.execute(
            sa.select(r.c.approval_request_id, r.c.state, r.c.decision_reason, r.c.decided_by)
            .where(r.c.effect_id == row.effect_id)
        ).first()
        if req is None or req.state in ("approved", "auto_approved"):
            return
        if req.state == "cancelled":
            raise ApprovalCancelled(req.approval_request_id, req.decision_reason)
        if req.state == "rejected":
            raise ApprovalRejected(req.approval_request_id, req.decision_reason, req.decided_by)
        if req.state == "timed_out":
            raise ApprovalTimedOut(req.approval_request_id)
        raise InvalidEffectState(f"call {row.call_id!r}: its approval request is {req.state}")

    def release(self, effect_id: str) -> None:
        """Give an in-flight call back without an outcome, for a framework's control-flow exception.

        The tool raised something like LangGraph's ``GraphInterrupt``: it did not fail, it will be re-run.
        The effect stays on the undo stack (it may have half-happened) and recovery leaves it alone; the re-issued
        call (same call_id) runs it again under the same effect id and idempotency key.
        """
        now = utcnow()
        try:
            with self.store.tx() as conn:
                state = conn.execute(
                    sa.select(t.effect_log.c.state).where(t.effect_log.c.effect_id == effect_id)
                ).scalar()
                if state is None:
                    raise EffectNotFound(effect_id)
                if state not in ("pending", "running"):
                    raise InvalidEffectState(f"effect {effect_id} is {state}; only an in-flight call can be released")
                conn.execute(
                    t.effect_log.update().where(t.effect_log.c.effect_id == effect_id)
                    .values(state="released", released_from=state, owner=None, lease_until=None, updated_at=now)
                )
        finally:
            self._inflight.discard(effect_id)

    def _replay(self, row: Any) -> Decision:
        if row.state == "committed":
            return Completed(row.effect_id, row.result_snapshot, row.tool_name)
        if row.state in ("pending", "running"):
            if row.owner == self.owner and row.effect_id in self._inflight:
                raise InvalidEffectState(f"call {row.call_id!r} ({row.tool_name}) is running right now")
            if not owner_alive(row.owner, row.lease_until, effect_id=row.effect_id):
                raise InvalidEffectState(
                    f"call {row.call_id!r} ({row.tool_name}) was interrupted by a crash; run `undolog recover` "
                    "before re-issuing it"
                )
            raise InvalidEffectState(f"call {row.call_id!r} ({row.tool_name}) is running in another process")
        if row.state == "unknown":
            raise OutcomeUnknown(row.effect_id)
        raise InvalidEffectState(
            f"call {row.call_id!r} ({row.tool_name}) already ended as {row.state}"
            + (f": {row.error}" if row.error else "")
        )

    # -- IRREVERSIBLE ------------------------------------------------------------------------------

    def intercept_irreversible(
        self, session_id: str, spec: ToolSpec, args_json: Any, call_id: str | None, *, match_digest: bool = False
    ) -> Decision:
        sc = self._sessions.get(session_id)
        if sc is None or not sc.persisted:
            sc = self.ensure_session(session_id)
        pin = spec if self._check_pin(sc, spec) else None
        args_canon = canonical_json(args_json)
        digest = sha256_hex(args_canon)
        action_digest = spec.action_digest(args_canon)
        existing = self._find_irreversible(session_id, spec, call_id, digest, action_digest)
        if existing is None and call_id is not None and match_digest:
            existing = self._find_irreversible(session_id, spec, None, digest, action_digest)
        if existing is not None:
            return self._resume_irreversible(sc, spec, existing, digest)
        return self._request_approval(sc, spec, args_json, digest, action_digest, call_id, pin)

    def _find_irreversible(
        self, session_id: str, spec: ToolSpec, call_id: str | None, digest: str, action_digest: str
    ) -> Any:
        e, r = t.effect_log, t.approval_requests
        q = sa.select(e, r.c.approval_request_id, r.c.state.label("req_state"), r.c.approved_args,
                      r.c.approved_digest, r.c.timeout_at, r.c.decision_reason, r.c.decided_by,
                      r.c.action_digest).select_from(e.outerjoin(r, r.c.effect_id == e.c.effect_id))
        with self.store.read() as conn:
            if call_id is not None:
                return conn.execute(q.where(e.c.session_id == session_id, e.c.call_id == call_id)).first()
            # No call id (a text ReAct agent, a new kickoff): the same action still waiting or approved.
            return conn.execute(
                q.where(
                    e.c.session_id == session_id,
                    e.c.tool_name == spec.name,
                    e.c.state.in_(("awaiting_approval", "approved")),
                    sa.or_(e.c.args_digest == digest, r.c.approved_digest == digest),
                ).order_by(e.c.created_at)
            ).first()

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
        if state == "awaiting_approval":
            if row.timeout_at is not None and row.timeout_at <= utcnow():
                self._u.approvals.expire([row.approval_request_id])
                return self.intercept_irreversible_again(sc, spec, row, digest)
            return self._awaiting(spec, row, row.args_snapshot)
        if state == "approved":
            return self._claim_run(sc, spec, row)
        if state == "released":
            return self._reclaim(sc, row, spec)
        if state == "rejected":
            raise ApprovalRejected(row.approval_request_id, row.decision_reason, row.decided_by)
        if state == "timed_out":
            raise ApprovalTimedOut(row.approval_request_id)
        if state == "cancelled":
            raise ApprovalCancelled(row.approval_request_id, row.decision_reason)
        return self._replay(row)

    def intercept_irreversible_again(self, sc: SessionCache, spec: ToolSpec, row: Any, digest: str) -> Decision:
        fresh = self._find_irreversible(sc.session_id, spec, row.call_id, digest, row.action_digest)
        return self._resume_irreversible(sc, spec, fresh, digest)

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

    def _claim_run(self, sc: SessionCache, spec: ToolSpec, row: Any) -> Decision:
        """Durably mark an approved call as running before it runs, so a crash is never followed by a blind re-run."""
        now = utcnow()
        count = sc.take_count() + 1
        self._inflight.add(row.effect_id)
        try:
            with self.store.tx() as conn:
                self._guard(conn, sc, count, pin=None)
                res = conn.execute(
                    t.effect_log.update()
                    .where(t.effect_log.c.effect_id == row.effect_id, t.effect_log.c.state == "approved")
                    .values(
                        state="running",
                        owner=self.owner,
                        lease_until=now + dt.timedelta(seconds=self.lease_seconds),
                        updated_at=now,
                    )
                )
                if res.rowcount != 1:
                    raise InvalidEffectState(f"call {row.call_id!r} was claimed by another caller")
                self.back_in_flight(conn, row.seq)
        except BaseException:
            self._inflight.discard(row.effect_id)
            sc.give_back(count - 1)
            raise
        self._ensure_renewer()
        args = row.approved_args if row.approved_args is not None else row.args_snapshot
        validated = spec.values(spec.validate(args))
        fault(FaultPoint.AFTER_APPROVED_CLAIM)
        return Execute(row.effect_id, validated, f"do-{row.effect_id}", ToolTier.IRREVERSIBLE, spec.name, row.call_id,
                       sc.session_id)

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
                policy = self._u.policy.read(conn)
                timeout_at = now + dt.timedelta(seconds=policy.approval_timeout_seconds)
                context = self._agent_context(conn, sc, policy.context_calls)
                conn.execute(
                    t.effect_log.insert(),
                    {
                        "effect_id": effect_id,
                        "session_id": sc.session_id,
                        "call_id": call_id or effect_id,
                        "tool_name": spec.name,
                        "tool_revision": spec.revision,
                        "tier": "irreversible",
                        "state": "awaiting_approval",
                        "args_snapshot": args_json,
                        "args_digest": digest,
                        "recovery_attempts": 0,
                        "created_at": now,
                        "updated_at": now,
                    },
                )
                record = {
                    "approval_request_id": request_id,
                    "effect_id": effect_id,
                    "session_id": sc.session_id,
                    "call_id": call_id or effect_id,
                    "tool_name": spec.name,
                    "tool_revision": spec.revision,
                    "tool_fingerprint": spec.fingerprint,
                    "proposed_args": args_json,
                    "action_digest": action_digest,
                    "reason": spec.reason,
                    "risk_tags": list(spec.risk_tags),
                    "agent_context": context,
                    "state": "pending",
                    "timeout_at": timeout_at,
                    "created_at": now,
                }
                conn.execute(t.approval_requests.insert(), record)
                conn.execute(
                    t.sessions.update()
                    .where(t.sessions.c.session_id == sc.session_id, t.sessions.c.state == "active")
                    .values(state="awaiting_approval", updated_at=now)
                )
                payload = {
                    "approval_request_id": request_id,
                    "session_id": sc.session_id,
                    "effect_id": effect_id,
                    "tool_name": spec.name,
                    "proposed_args": args_json,
                    "reason": spec.reason,
                    "risk_tags": list(spec.risk_tags),
                    "timeout_at": timeout_at.isoformat(),
                }
                append_event(
                    conn,
                    self.store,
                    subject=f"approval:{request_id}",
                    approval_request_id=request_id,
                    action="requested",
                    actor=f"agent:{sc.session_id}",
                    payload=payload,
                    outbox=[("approval.requested", payload)],
                    now=now,
                )
        except IntegrityError:
            sc.give_back(count - 1)
            if call_id is None:
                raise
            # A concurrent re-run raised the same request first: return that one, never a second request.
            row = self._find_irreversible(sc.session_id, spec, call_id, digest, action_digest)
            return self._resume_irreversible(sc, spec, row, digest)
        except BaseException:
            sc.give_back(count - 1)
            raise
        sc.state = "awaiting_approval"
        sc.recent.append((spec.name, "irreversible", args_json, "awaiting_approval"))
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

    def _agent_context(self, conn: Connection, sc: SessionCache, n: int) -> list[dict[str, Any]]:
        """The session's last N calls: logged effects, plus SAFE calls this process remembers."""
        if n <= 0:
            return []
        rows = conn.execute(
            sa.select(
                t.effect_log.c.tool_name, t.effect_log.c.tier, t.effect_log.c.state,
                t.effect_log.c.args_snapshot, t.effect_log.c.created_at,
            )
            .where(t.effect_log.c.session_id == sc.session_id)
            .order_by(t.effect_log.c.created_at.desc())
            .limit(n)
        ).all()
        logged = [
            {"tool_name": r.tool_name, "tier": r.tier, "state": r.state, "args": r.args_snapshot,
             "at": r.created_at.isoformat()}
            for r in reversed(rows)
        ]
        safe = [
            {"tool_name": name, "tier": tier, "state": state, "args": jsonable(args)}
            for name, tier, args, state in list(sc.recent) if tier == "safe"
        ]
        # SAFE calls have no timestamps in the log; they are shown before the logged calls.
        return (safe + logged)[-n:]

    # -- completion ------------------------------------------------------------------------------

    def complete(self, effect_id: str, result: Any, *, wait: bool = True) -> None:
        """Record success: the effect becomes ``committed`` with its result snapshot.

        ``wait=False`` raises ``WouldBlock`` (nothing written) instead of waiting for a connection or a lock.
        """
        fault(FaultPoint.AFTER_TOOL)
        text = result_text(result)
        now = time.time()
        if self.fast_commit_mark:
            self._marks.append((effect_id, text, now))
            fault(FaultPoint.AFTER_MARK_QUEUED)
            self._ensure_flusher()
            return
        try:
            if self.hot.mark(effect_id, text, now, fast=False, wait=wait):
                self._inflight.discard(effect_id)
                return
        except DatabaseUnavailable:
            # The tool ran: its result must not be lost to a dropped connection. The mark waits in the deferred
            # queue (as in fast mode), retried until the database answers; the effect stays in flight and leased
            # meanwhile, and if this process dies first, recovery reconciles it through the probe.
            self._marks.append((effect_id, text, now))
            self._ensure_flusher()
            return
        if not wait:
            raise WouldBlock()  # not in flight any more: the precise error needs a transaction, in a thread
        try:
            with self.store.tx(fast=self.fast_commit_mark) as conn:
                res = conn.execute(
                    t.effect_log.update()
                    .where(t.effect_log.c.effect_id == effect_id, t.effect_log.c.state.in_(("pending", "running")))
                    .values(state="committed", result_snapshot=json.loads(text), owner=None, lease_until=None,
                            updated_at=from_epoch(now))
                )
                if res.rowcount != 1:
                    self._missing_or_moved(conn, effect_id, "committed")
        finally:
            self._inflight.discard(effect_id)

    def fail(self, effect_id: str, error: BaseException | str) -> RollbackReport | None:
        """Record failure; by default the session then rolls back, this effect's own compensation included.

        Returns the rollback report, or None when the session's policy is "continue".
        """
        policy, session_id, text = self._record_failure(effect_id, error)
        if policy == "rollback":
            why = f"effect {effect_id} failed: {text}"
            try:
                return self._u.saga.rollback_sync(session_id, reason=why)
            except Exception as exc:
                self._u.saga.halt_unrolled(session_id, why, exc)
                raise
        return None

    def record_failure(self, effect_id: str, error: BaseException | str) -> str:
        """Record failure only; returns the session's on_failure policy for the caller to apply."""
        return self._record_failure(effect_id, error)[0]

    def _record_failure(self, effect_id: str, error: BaseException | str) -> tuple[str, str, str]:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.flush_marks()
        now = utcnow()
        try:
            with self.store.tx() as conn:
                res = conn.execute(
                    t.effect_log.update()
                    .where(t.effect_log.c.effect_id == effect_id, t.effect_log.c.state.in_(("pending", "running")))
                    .values(state="failed", error=text, owner=None, lease_until=None, updated_at=now)
                )
                if res.rowcount != 1:
                    self._missing_or_moved(conn, effect_id, "failed")
                row = conn.execute(
                    sa.select(t.effect_log.c.session_id, t.effect_log.c.tier, t.sessions.c.on_failure)
                    .select_from(t.effect_log.join(t.sessions, t.sessions.c.session_id == t.effect_log.c.session_id))
                    .where(t.effect_log.c.effect_id == effect_id)
                ).one()
        finally:
            self._inflight.discard(effect_id)
        return str(row.on_failure), str(row.session_id), text

    def _missing_or_moved(self, conn: Connection, effect_id: str, target: str) -> None:
        state = conn.execute(sa.select(t.effect_log.c.state).where(t.effect_log.c.effect_id == effect_id)).scalar()
        if state is None:
            raise EffectNotFound(effect_id)
        raise InvalidEffectState(f"effect {effect_id} is {state}; it cannot become {target}")

    def running(self, d: Execute, session_id: str | None = None) -> _Running:
        """Expose ``current_call()`` to the tool while it runs (a context manager)."""
        return _Running(CallContext(session_id or d.session_id, d.effect_id, d.call_id, d.tool_name,
                                    d.idempotency_key))

    # -- session state helpers shared by approvals, saga and recovery -----------------------------

    def halt(self, conn: Connection, session_id: str, reason: str, *, now: dt.datetime | None = None) -> None:
        now = now or utcnow()
        conn.execute(
            t.sessions.update()
            .where(t.sessions.c.session_id == session_id, t.sessions.c.state.notin_(("rolled_back", "completed")))
            .values(state="halted", halted_reason=reason, updated_at=now)
        )
        write_outbox(conn, [("session.halted", {"session_id": session_id, "reason": reason})], now=now)
        sc = self._sessions.get(session_id)
        if sc is not None:
            sc.state = "halted"

    def back_in_flight(self, conn: Connection, seq: int) -> None:
        """The effect ``seq`` is in flight again: on SQLite, move recovery's cursor back to it (see ``_schema``)."""
        if self.store.is_postgres:
            return  # PostgreSQL finds in-flight effects through its partial index
        rc = t.recovery_cursor
        conn.execute(
            rc.update().where(rc.c.cursor_id == 1, rc.c.effect_seq >= seq)
            .values(effect_seq=seq - 1, version=rc.c.version + 1)
        )

    def refresh_awaiting(self, conn: Connection, session_id: str, *, now: dt.datetime | None = None) -> None:
        """A session is ``awaiting_approval`` exactly while one of its requests is pending."""
        pending = conn.execute(
            sa.select(sa.func.count())
            .select_from(t.approval_requests)
            .where(t.approval_requests.c.session_id == session_id, t.approval_requests.c.state == "pending")
        ).scalar_one()
        target, source = ("awaiting_approval", "active") if pending else ("active", "awaiting_approval")
        conn.execute(
            t.sessions.update()
            .where(t.sessions.c.session_id == session_id, t.sessions.c.state == source)
            .values(state=target, updated_at=now or utcnow())
        )
        sc = self._sessions.get(session_id)
        if sc is not None and sc.state == source:
            sc.state = target

    # -- leases ------------------------------------------------------------------------------------

    def rolling(self, session_id: str, *, done: bool = False) -> None:
        """This engine walks (or, ``done``, no longer walks) the rollback of ``session_id``: its lease is renewed."""
        if done:
            self._rolling.discard(session_id)
            return
        self._rolling.add(session_id)
        sc = self._sessions.get(session_id)
        if sc is not None:
            sc.state = "rolling_back"
        self._ensure_renewer()

    def _ensure_renewer(self) -> None:
        self._ensure_thread("_renewer", self._renew_loop, "undolog-lease")

    def _ensure_thread(self, attr: str, target: Callable[[], None], name: str) -> None:
        """Start a background loop once, lazily: an UndoLog that never writes starts no thread.

        The loops only end when ``stop()`` is called, so a started loop is trusted without asking the thread
        (``is_alive`` is a lock round trip on every COMPENSABLE call otherwise).
        """
        if attr in self._started:
            return
        with self._renew_lock:
            th = getattr(self, attr)
            if th is not None and th.is_alive():
                self._started.add(attr)
                return
            self._stop.clear()
            th = threading.Thread(target=target, name=name, daemon=True)
            setattr(self, attr, th)
            th.start()
            self._started.add(attr)

    def _renew_loop(self) -> None:
        period = max(0.05, self.lease_seconds / 3.0)
        while not self._stop.wait(period):
            effects = list(self._inflight)
            undos = list(self._compensating)
            rolling = list(self._rolling)
            if not effects and not undos and not rolling:
                continue
            until = utcnow() + dt.timedelta(seconds=self.lease_seconds)
            me = self.owner
            try:
                with self.store.tx(fast=True) as conn:
                    if effects:
                        conn.execute(
                            t.effect_log.update()
                            .where(t.effect_log.c.effect_id.in_(effects), t.effect_log.c.owner == me)
                            .values(lease_until=until)
                        )
                    if undos:
                        conn.execute(
                            t.undo_stack.update()
                            .where(t.undo_stack.c.undo_id.in_(undos), t.undo_stack.c.owner == me)
                            .values(lease_until=until)
                        )
                    if rolling:
                        conn.execute(
                            t.rollbacks.update()
                            .where(t.rollbacks.c.session_id.in_(rolling), t.rollbacks.c.owner == me)
                            .values(lease_until=until)
                        )
            except Exception:  # noqa: BLE001 - a missed renewal is retried next period; leases are long
                continue

    def flush_marks(self) -> None:
        """Write the deferred commit marks now (fast mode); readers in this process call it first."""
        if not self._marks:
            return
        with self._marks_lock:
            batch: list[tuple[str, str, float]] = []
            while self._marks:
                batch.append(self._marks.popleft())
            if not batch:
                return
            try:
                self.hot.mark_many(batch)
            except BaseException:
                self._marks.extendleft(reversed(batch))
                raise
            for effect_id, _, _ in batch:
                self._inflight.discard(effect_id)

    def _ensure_flusher(self) -> None:
        self._ensure_thread("_flusher", self._flush_loop, "undolog-marks")

    def _flush_loop(self) -> None:
        while not self._stop.wait(MARK_FLUSH_SECONDS):
            try:
                self.flush_marks()
            except Exception:  # noqa: BLE001 - kept queued and retried; the effects stay leased meanwhile
                continue

    def stop(self) -> None:
        try:
            self.flush_marks()
        finally:
            self._stop.set()
            self._started.clear()
            self.hot.close()


def _lease_over(until: dt.datetime | None) -> bool:
    return until is None or until <= utcnow()
