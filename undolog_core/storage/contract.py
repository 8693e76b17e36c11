"""The storage contract, written once: what ``Store`` and each repository guarantee, whatever the database.

A repository is a small class named by its table(s), reached as an attribute of the ``Storage``
(``storage.sessions``, ``storage.effects``, ``storage.undo``, ``storage.owners``, ``storage.approvals``,
``storage.audit``, ``storage.registry``, ``storage.policy``, ``storage.outbox``, ``storage.archive``); one
service (``storage.recovery``) composes recovery's verdicts, which span tables in one transaction, from the
repositories' ``*_in`` writes. Each holds the ``Store`` and, explicitly, the other repositories whose rows it writes in its own transaction; it keeps no
state of its own between calls. The shape follows LangGraph's ``BaseCheckpointSaver``: a few methods, each with
its guarantee written here, and one conformance suite (``tests/conformance``) every database's implementation
runs against.

Rules every method below keeps:

* **Its transaction.** A method named ``*_in(conn, ...)`` joins the caller's transaction and never commits: what
  it writes commits, or rolls back, with the caller's other writes. Any other method is one unit of work in a
  transaction of its own (``Store.tx()`` to write, ``Store.read()`` to read), committed before it returns.
* **One place per write.** A table is written by its own repository only; another repository that must write a
  row of it in the same transaction calls that repository's ``*_in`` method (a policy change appends its audit
  event with ``audit.append_event_in``; an audit event writes its outbox rows with ``outbox.write_in``).
* **Errors.** A database that does not answer raises ``DatabaseUnavailable`` (``Store.tx``/``Store.read``); other
  driver errors are SQLAlchemy's and are not caught here. Nothing is retried blindly: a method that retries says
  why it is safe to.
* **Fences.** Where two processes may race for the same rows, the method says what serialises them: a row lock
  (``Store.for_update``, ``FOR UPDATE [SKIP LOCKED]`` on PostgreSQL) or SQLite's single writer (``BEGIN
  IMMEDIATE`` and the in-process write lock).
* **State transitions** are not decided here: a write that changes a state guards it with the machine in
  ``undolog_core/states.py`` (``SESSION.guard("complete", col)``), so an update that meets a state the machine
  does not allow changes nothing.

Outside the repositories: the hot path's raw statements (``hotpath.py``, ``sqlite.py``, ``postgres.py``: the
COMPENSABLE pre-write and commit mark, one statement each, written per database for speed). They write the same
rows as ``store.effects.insert_effect_in``, ``store.undo.arm_in`` and ``store.effects.mark_committed``; the
conformance suite holds them to it.

Example:
    >>> from undolog_core.storage.contract import PolicyRepository
    >>> storage = open_storage("sqlite:///undolog.db")
    >>> isinstance(storage.policy, PolicyRepository)
    True
"""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .approvals import EXPIRE_BATCH
from .archive import GcBatch
from .audit import AuditChainReader, ChainHead, PendingEvent
from .effects import FailureRollback, InFlight, LateFinish, Resolution
from .outbox import OutboxItem
from .records import (
    ApprovalEvent,
    ApprovalRecord,
    ContractRevision,
    ExpiredRequest,
    OrgPolicy,
    RegisteredRevision,
    SessionRecord,
    StateChange,
)
from .schema import EffectState, RequestState, SessionState


@runtime_checkable
class StoreProtocol(Protocol):
    """What every repository is built on: one database's transactions and the statement helpers both databases
    share (``base.Store`` implements it).

    Example:
        >>> with store.tx() as conn:
        ...     conn.execute(store.for_update(sa.select(t.sessions)))
    """

    @property
    def is_postgres(self) -> bool:
        """True on PostgreSQL (row locks, sequences, ``ANY(:array)``), False on SQLite."""
        ...

    def tx(self, *, fast: bool = False, urgent: bool = False) -> AbstractContextManager[Connection]:
        """One write transaction, committed when the block ends without an exception, rolled back otherwise.

        ``fast``: on the engine whose commits need not fsync (commit marks only). ``urgent``: a person's
        decision, ahead of the writers queued for SQLite's write lock. Raises ``DatabaseUnavailable`` when the
        database does not answer.
        """
        ...

    def read(self) -> AbstractContextManager[Connection]:
        """One read transaction (always rolled back; on SQLite it never takes the write lock). Raises
        ``DatabaseUnavailable`` when the database does not answer."""
        ...

    def for_update(self, stmt: Any, *, skip_locked: bool = False) -> Any:
        """``stmt`` locking the rows it reads until the transaction ends (``FOR UPDATE [SKIP LOCKED]`` on
        PostgreSQL); unchanged on SQLite, whose writers are serialised already."""
        ...

    def insert_many_in(self, conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert ``rows`` (dicts with the same keys) in one statement inside the caller's transaction."""
        ...

    def one_of(self, col: Any, values: Sequence[Any]) -> Any:
        """``col IN (values)``, one parameter whatever the size on PostgreSQL."""
        ...


@runtime_checkable
class SessionsRepository(Protocol):
    """``store.sessions`` (``SessionsSQL``): the sessions (``undolog_sessions``) and each session's rollback intent
    (``undolog_rollbacks``: at most one row per session, written with the session's ``rolling_back`` state, so a
    crash between a failure and its rollback leaves an intent ``recover()`` finishes). Every state change is a
    move of ``states.SESSION``: an update that meets a state the table does not allow changes nothing.

    Fences: a session's row lock (``lock_session_in``: ``FOR UPDATE`` on PostgreSQL, SQLite's single writer) is
    what resume, re-pinning and the saga's rollback plan start from; a call's pre-write proves the session
    writable in its own statement (``guard_in``), so a call and a halt or rollback request never both win. An
    intent changes owner only by compare-and-swap (``claim_intent``).

    Example:
        >>> storage.sessions.get_session("ticket-1042").state
        <SessionState.ACTIVE: 'active'>
    """

    def lock_session_in(self, conn: Connection, session_id: str) -> Any:
        """The session row (None if there is none), locked until the caller's transaction ends."""
        ...

    def get_session(self, session_id: str) -> SessionRecord | None:
        """One session, or None when there is no such session."""
        ...

    def list_sessions(self, *, state: SessionState | None = None, agent_id: str | None = None,
                      created_by: str | None = None, limit: int = 200,
                      offset: int = 0) -> builtins.list[SessionRecord]:
        """Sessions newest first (ties by id: pages never overlap), optionally of one state, agent or creator."""
        ...

    def session_effects(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """Every logged effect of the session, oldest first, with its undo entry's name, state and error."""
        ...

    def set_session_state(self, session_id: str, state: SessionState, *, allowed: Iterable[SessionState],
                          now: dt.datetime) -> bool:
        """Move the session to ``state`` if it is in one of ``allowed`` and the state table has that move; False
        (nothing written) otherwise or when there is no such session."""
        ...

    def refresh_changes_in(self, conn: Connection, session_id: str,
                           now: dt.datetime) -> builtins.list[StateChange]:
        """``refresh_awaiting_in`` as the state changes it made (none, or one)."""
        ...

    def resume_session(self, session_id: str, *, actor: str, reason: str | None,
                       now: dt.datetime) -> builtins.list[StateChange]:
        """Un-halt the session with its audit event ``session.resume`` in ONE transaction; the state changes, in
        order. Raises ``SessionNotFound`` or ``InvalidSessionState`` (not halted); nothing is written then."""
        ...

    def revalidate_session(self, session_id: str, *, actor: str, current: Mapping[str, int],
                           now: dt.datetime) -> tuple[dict[str, dict[str, int | None]], dict[str, int]]:
        """Re-pin the session's tool revisions (``current``; empty: the registry's newest) with its audit event
        ``session.revalidate`` in ONE transaction; (what changed, the new pins). Raises ``SessionNotFound``."""
        ...

    def get_or_create_session(self, session_id: str, *, create: bool, values: Mapping[str, Any]) -> Any:
        """The session's row; with ``create``, inserted first when missing. Two processes creating one session
        both get the row that won (the loser's insert is rolled back to a savepoint, not retried)."""
        ...

    def add_call_count(self, session_id: str, n: int, *, missing: Mapping[str, Any]) -> None:
        """Add ``n`` calls counted in memory, on the fast engine; a session not stored yet (only SAFE calls so
        far) is inserted with ``missing``."""
        ...

    def guard_in(self, conn: Connection, session_id: str, count: int, pins: dict[str, int] | None) -> Any:
        """In the caller's write: add ``count`` (and store ``pins``) only while the session accepts writes; None
        when it does, else its ``state`` and ``halted_reason``. Raises ``InvalidEffectState`` if the session is
        gone."""
        ...

    def halt_in(self, conn: Connection, session_id: str, reason: str, now: dt.datetime) -> None:
        """Halt the session for a person (not once it ended) with its ``session.halted`` outbox row, in the
        caller's transaction."""
        ...

    def refresh_awaiting_in(self, conn: Connection, session_id: str, now: dt.datetime) -> str | None:
        """Make the session ``awaiting_approval`` exactly while one of its requests is pending, in the caller's
        transaction; the new state when it changed."""
        ...

    def await_approval_in(self, conn: Connection, session_id: str, now: dt.datetime) -> None:
        """A request of the session was raised: it waits for a person (``await_approval``), in the caller's
        transaction."""
        ...

    def halt_session(self, session_id: str, reason: str) -> None:
        """``halt_in`` in a write transaction of its own."""
        ...

    def rollback_intent_in(self, conn: Connection, session_id: str) -> Any:
        """The session's rollback intent row, or None."""
        ...

    def write_intent_in(self, conn: Connection, session_id: str, *, exists: bool, actor: str,
                        reason: str | None, owner: str, lease_until: dt.datetime, now: dt.datetime) -> None:
        """Request the rollback (or, ``exists``, take the intent over) and move the session to ``rolling_back``,
        in the caller's transaction: from its commit the session takes no call."""
        ...

    def end_intent_in(self, conn: Connection, session_id: str, *, owner: str | None = None) -> None:
        """End the intent (``owner``: only if that owner holds it), in the caller's transaction."""
        ...

    def mark_rolled_back_in(self, conn: Connection, session_id: str, now: dt.datetime) -> None:
        """The rollback is complete: the session ``rolled_back`` and its intent ended, in the caller's
        transaction."""
        ...

    def claim_intent(self, session_id: str, seen_owner: str | None, owner: str, lease_until: dt.datetime) -> bool:
        """Compare-and-swap the intent's owner from ``seen_owner``: of several recoverers exactly one walks it."""
        ...

    def renew_intents_in(self, conn: Connection, owner: str, session_ids: Sequence[str],
                         until: dt.datetime) -> None:
        """Extend the lease of the intents ``owner`` still holds, in the caller's transaction."""
        ...


@runtime_checkable
class UndoRepository(Protocol):
    """``store.undo`` (``UndoSQL``): the undo entries (``undolog_undo_stack``), one per COMPENSABLE effect, its
    ``undo_id`` the effect's seq. The one place an entry is written (``arm_in``; the hot path's raw pre-writes write
    the same row, PostgreSQL's from ``hotpath.ARM_FROM_E``, SQLite's from migration 0010's trigger). It writes no
    other table; the transactions moving an entry with its effect are ``store.effects``'s, through the ``*_in``
    methods here. Every state change is a move of ``states.UNDO``.

    Fences: a compensation is claimed by compare-and-swap on the state and owner the plan saw (``claim_undo``),
    or only while armed (``claim_armed_in``), so two rollbacks or recoverers never run one compensation twice.

    Example:
        >>> [e["compensation_name"] for e in storage.undo.undo_plan("ticket-1042")]
        ['cancel_refund']
    """

    def arm_in(self, conn: Connection, *, undo_id: int, effect_id: str, session_id: str, compensation_name: str,
               compensation_version: int, args_snapshot: Any, now: dt.datetime) -> None:
        """Arm a COMPENSABLE effect's entry in the pre-write's transaction (``undo_id``: the effect's seq)."""
        ...

    def compensated_in(self, conn: Connection, undo_id: int, now: dt.datetime) -> None:
        """The entry ``compensated``, its attempt counted and its owner gone, in the caller's transaction."""
        ...

    def undo_failed_in(self, conn: Connection, undo_id: int, now: dt.datetime) -> None:
        """The entry ``compensation_failed`` (a person decides), in the caller's transaction."""
        ...

    def drop_armed_in(self, conn: Connection, effect_id: str) -> None:
        """The effect did not happen: its entry is deleted if still armed, in the caller's transaction."""
        ...

    def resolve_compensated_in(self, conn: Connection, effect_id: str, now: dt.datetime) -> None:
        """A person said the effect was compensated: its entry ``compensated``, in the caller's transaction."""
        ...

    def claim_armed_in(self, conn: Connection, undo_ids: Sequence[int], owner: str, lease_until: dt.datetime,
                       now: dt.datetime) -> set[int]:
        """Claim those of ``undo_ids`` still armed (``compensating``, ``owner``) in the caller's transaction; the
        ids claimed."""
        ...

    def renew_in(self, conn: Connection, owner: str, undo_ids: Sequence[int], until: dt.datetime) -> None:
        """Extend the lease of the entries ``owner`` still holds, in the caller's transaction."""
        ...

    def undo_entries_in(self, conn: Connection, session_id: str, only_effect: str | None) -> builtins.list[Any]:
        """The session's entries not compensated yet (or the one of ``only_effect``), newest first, with their
        effect's tool, state, result and owner."""
        ...

    def compensating_in(self, conn: Connection) -> builtins.list[Any]:
        """Every entry being compensated (recovery's scan)."""
        ...

    def state_of_effect_in(self, conn: Connection, effect_id: str) -> str | None:
        """The state of the effect's entry (None: it has none)."""
        ...

    def put_undo_args(self, effect_id: str, args: Any) -> bool:
        """Replace an armed entry's stored arguments (a gateway's capture before the call is sent); False when it
        is not armed or not there."""
        ...

    def claim_undo(self, undo_id: int, *, seen_state: str, seen_owner: str | None, owner: str,
                   lease_until: dt.datetime) -> bool:
        """Compare-and-swap the entry to ``compensating`` for ``owner`` from what the plan saw; False when another
        walk came first."""
        ...

    def undo_attempt_failed(self, undo_id: int, error: str) -> None:
        """Count a failed compensation attempt with its error, in a transaction of its own."""
        ...

    def undo_plan(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The compensations a rollback of the session would run now, in order (newest first)."""
        ...


@runtime_checkable
class EffectsRepository(Protocol):
    """``store.effects`` (``EffectsSQL``; ``SQLiteEffects``/``PostgresEffects`` per database): the effect log
    (``undolog_effect_log``), one row per logged call, from its pre-write to its outcome. A transaction that moves
    an effect with its undo entry, its session or an audit event writes those through ``store.undo``,
    ``store.sessions`` and ``store.audit`` (``*_in``). Every state change is a move of ``states.EFFECT``: a mark,
    failure or verdict that meets a state the table does not allow changes nothing and says what it met.

    Fences: a call id is unique per session (a second pre-write of it raises ``IntegrityConflict``, nothing
    written); a claim into flight is a compare-and-swap that bumps the effect's ``epoch`` (the fencing token a
    probe carries); a commit mark given ``owner`` lands only while the call is still that owner's, otherwise the
    take-over's state is returned and ``record_late_finish`` records the finish; recovery claims in-doubt effects
    ``FOR UPDATE SKIP LOCKED`` on PostgreSQL (waiting ``CLAIM_LOCK_WAIT`` at most for a row a dead backend holds),
    under the single writer on SQLite. Rows are locked in the call path's order: the effect, its undo entry, then
    the session.

    Example:
        >>> storage.effects.effect_by_call("ticket-1042", "call-7").state
        'committed'
    """

    def insert_effect_in(self, conn: Connection, values: Mapping[str, Any]) -> int:
        """An effect row; its seq (the undo entry's id). A COMPENSABLE effect's undo entry is armed by
        ``store.undo.arm_in`` in the same transaction (the hot path's pre-write writes both in one statement)."""
        ...

    def call_exists(self, session_id: str, call_id: str) -> bool:
        """Whether the session logged a call ``call_id`` (one read on the (session_id, call_id) index)."""
        ...

    def sessions_with_call(self, session_ids: Sequence[str], call_id: str) -> set[str]:
        """Those of ``session_ids`` that logged a call ``call_id``: one read on the (session_id, call_id) index."""
        ...

    def effect_by_call(self, session_id: str, call_id: str) -> Any:
        """The effect row of the session's call ``call_id``, or None."""
        ...

    def session_of_client_key(self, call_id: str) -> str | None:
        """The session holding the call with this client-keyed id (``ck:...``, unique across sessions), or None.
        The index's own predicate is repeated so that SQLite reads the partial index."""
        ...

    def session_of_effect(self, effect_id: str) -> str | None:
        """The session an effect belongs to, or None when there is no such effect."""
        ...

    def effect_state_in(self, conn: Connection, effect_id: str) -> str | None:
        """The effect's state as the caller's transaction sees it (None: no such effect)."""
        ...

    def request_of_effect_in(self, conn: Connection, effect_id: str) -> Any:
        """The approval request of an IRREVERSIBLE effect (id, state, decision, approved arguments), or None."""
        ...

    def claim_effect_in(self, conn: Connection, effect_id: str, *, from_state: str, to_state: str, owner: str,
                        lease_until: dt.datetime, now: dt.datetime) -> int:
        """Compare-and-swap an effect into flight (an approved call claimed to run, a released call re-claimed);
        its new ownership epoch (the fencing token, one more than before), or 0 when another caller won."""
        ...

    def back_in_flight_in(self, conn: Connection, seq: int) -> None:
        """The effect ``seq`` is in flight again (a released call re-claimed, an approved call claimed): where the
        database finds effects in flight by a cursor, it is moved back (per database)."""
        ...

    def effects_in_flight_in(self, conn: Connection) -> tuple[list[Any], tuple[Any, int] | None]:
        """The effects in flight as ``conn`` sees them, and the cursor to advance past what was seen settled (None:
        no cursor; per database)."""
        ...

    def advance_cursor(self, cursor: Any, upto: int) -> None:
        """Move recovery's cursor to ``upto`` (per database; nothing where there is no cursor)."""
        ...

    def release_effect(self, effect_id: str) -> str | None:
        """Hand an in-flight call back without an outcome; returns the state it had (None: no such effect)."""
        ...

    def find_irreversible(self, session_id: str, tool_name: str, call_id: str | None, digest: str) -> Any:
        """The same call again (by call id), or, without one, the same action still waiting or approved."""
        ...

    def kickoff_to_continue(self, session_id: str) -> str | None:
        """The kickoff a continuation of this session continues: the last one that raised an approval request,
        else the last one that logged any call; None when no call of the session recorded a kickoff."""
        ...

    def kickoff_effects(self, session_id: str, kickoff_id: str) -> list[Any]:
        """The committed effects a kickoff logged, in the order they were logged: (effect_id, tool_name, tier,
        args_digest, approved_digest, result_snapshot)."""
        ...

    def effects_of_calls(self, session_id: str, call_ids: Sequence[str]) -> list[Any]:
        """The committed effects of these calls of the session (a resumed conversation's history), in the order they
        were logged; the columns of :meth:`kickoff_effects`."""
        ...

    def recent_effects_in(self, conn: Connection, session_id: str, n: int) -> list[Any]:
        """The session's last ``n`` logged calls, oldest first (the approval request's context)."""
        ...

    def mark_committed(self, effect_id: str, text: str, now: dt.datetime, *, fast: bool,
                       owner: str | None = None) -> str | None:
        """The commit mark's general path; None when written, else the effect's state (or "" when it is gone).

        ``owner``: only while the call is still this owner's (the fence of ``HotPath.owner``); a call another
        process took over answers its state (in flight: being recovered now), see ``record_late_finish``."""
        ...

    def record_late_finish(self, effect_id: str, text: str, now: dt.datetime) -> LateFinish | None:
        """A call that finished after another process took it over, recorded in one transaction: the effect
        ``unknown`` (its result kept, the reason in ``error``), its session halted, and an audit event
        ``effect.finished_late`` with the result. None when the effect is in no state a take-over leaves
        (nothing recorded).

        Recovery's own records of that effect (compensated, settled) apply only while it is in flight, so
        whichever commits second, the effect ends ``unknown`` with this finish recorded.
        """
        ...

    def resolve_effect(self, effect_id: str, resolved_as: str, *, actor: str, reason: str,
                       principal: str | None, now: dt.datetime) -> Resolution:
        """A person settles an ``unknown`` effect, in one transaction: the effect moves (``RESOLUTIONS``), its undo
        entry follows (``compensated``: no rollback runs it again; ``not_happened``: an armed entry is dropped, as
        when recovery's probe says a call did not happen; ``committed``: left as it is, so an armed entry is still
        compensated by a rollback and one that already ran is not run again), and the immutable audit event
        ``effect.resolved`` records who, why and what it was before. The session is left as it is (not resumed).

        Raises:
            EffectNotFound: no such effect.
            InvalidEffectState: it is not ``unknown`` (nothing was written).
        """
        ...

    def mark_failed(self, effect_id: str, error: str, now: dt.datetime, nothing_happened: bool = False,
                    rollback: FailureRollback | None = None) -> tuple[str | None, Any]:
        """Record a failure: (None, the session's policy row) when written, else (its state or "", None).

        ``nothing_happened``: the tool said, by its contract, that it changed nothing (an MCP ``isError``): its
        armed undo entry is dropped in the same transaction, so no rollback calls a compensation for it.

        ``rollback``: the caller will roll the session back if its policy says so; then, in this same transaction,
        the rollback is requested (the intent, the session ``rolling_back``), so that a process that dies between
        the failure and its rollback leaves an intent that ``recover()`` finishes, never a session that carries on
        as if nothing had failed. The row's ``intent`` says whether it was written.
        """
        ...

    def renew_leases(self, owner: str, effects: list[str], undos: list[int], rolling: list[str],
                     until: dt.datetime) -> None:
        """Extend, on the fast engine in one transaction, the leases ``owner`` still holds: its effects in
        flight, its undo entries being compensated (``store.undo``) and its rollback intents (``store.sessions``)."""
        ...

    def undo_compensated(self, undo_id: int, effect_id: str, *, in_flight: bool = False) -> None:
        """The entry and its effect ``compensated``. ``in_flight``: the effect was in flight when the walk read it
        (recovery of an abandoned call); it becomes ``compensated`` only if it still is, so a late finish of its
        own process recorded meanwhile (``record_late_finish``: ``unknown``) stands."""
        ...

    def kept_irreversible_in(self, conn: Connection, session_id: str) -> list[Any]:
        """The IRREVERSIBLE calls of the session that ran: a rollback cannot take them back, and says so."""
        ...

    def in_flight(self) -> InFlight:
        """Everything in flight: effects (found the way each database finds them, see ``effects_in_flight_in``),
        undo entries being compensated, rollbacks requested."""
        ...

    def in_flight_q(self) -> Any:
        """The SELECT of the effects in flight, in seq order (a statement, not run: each database narrows it)."""
        ...

    def claim_in_doubt(self, effect_id: str, seen_state: str, seen_owner: str | None, owner: str,
                       lease_until: dt.datetime) -> bool:
        """Compare-and-swap an in-doubt effect's owner; on PostgreSQL SKIP LOCKED keeps racing recoverers from
        waiting on each other."""
        ...

    def claim_in_doubt_batch(self, seen: Sequence[tuple[str, str, str | None]], owner: str,
                             lease_until: dt.datetime, eligible: Callable[[Any], bool]) -> list[Any]:
        """Claim many in-doubt COMPENSABLE effects in ONE transaction; returns the rows claimed.

        ``seen`` is (effect_id, state, owner) as the scan saw each: an effect is claimed only if it is still so
        (the compare-and-swap of ``claim_in_doubt``, batched) and ``eligible(row)`` says the batch path can
        finish it (its undo entry armed and unowned, its compensation loaded here at the logged version).
        PostgreSQL locks the rows with SKIP LOCKED, so racing recoverers take disjoint sets. Each row carries the
        effect (``effect_id, seq, session_id, tool_name, state, args_snapshot``) and its undo entry (``undo_id,
        undo_args, compensation_name, compensation_version, attempts``).
        """
        ...

    def effect(self, effect_id: str) -> Any:
        """The effect row. Raises ``NoResultFound`` when there is no such effect."""
        ...

    def settle_in(self, conn: Connection, effect_id: str, state: EffectState, *, result: Any = None,
                  error: str | None = None, now: dt.datetime) -> None:
        """Recovery's verdict on an effect in flight (``committed`` with its ``result``, ``unknown``, ``approved``,
        ``failed``), its owner gone; nothing when it is no longer in a state the verdict's move leaves."""
        ...

    def attempt_failed_in(self, conn: Connection, effect_id: str, error: str, *, dead_letter_after: int,
                          now: dt.datetime) -> int:
        """Count a failed recovery attempt and release the claim; at ``dead_letter_after`` the effect is
        ``dead_letter``. Returns the attempts so far."""
        ...


@runtime_checkable
class RecoveryService(Protocol):
    """``store.recovery`` (``RecoverySQL``): recovery's verdicts, a service over ``store.effects``, ``store.undo``,
    ``store.sessions`` and ``store.audit`` rather than a repository: each verdict spans those tables in ONE
    transaction (the effect settled, its undo entry claimed or dropped, the session halted, the probe's answer
    audited), so a crash leaves all of it or none. It writes no statement of its own but one: on PostgreSQL a
    compensation's record runs the repositories' four statements as CTEs of one statement (``compensated_in_recovery``).

    Fences: a verdict applies only while the effect is in flight (a late finish recorded meanwhile stands); an undo
    entry is claimed only while armed.

    Example:
        >>> storage.recovery.note_event(PendingEvent("effect:e1", "effect.probe", "undolog", {"answer": "unknown"}))
    """

    def settle_and_claim_undos(self, committed: Sequence[tuple[str, Any]], undo_ids: Sequence[int], owner: str,
                               lease_until: dt.datetime, *, events: Sequence[PendingEvent] = ()) -> set[int]:
        """After the probes of a batch, in one transaction: the effects a probe proved ``committed`` (with its
        result), the probes' answers (``events``, audit), and the undo entries about to be compensated claimed
        (``compensating``, this owner). Returns the undo ids claimed (an entry no longer ``armed`` is not)."""
        ...

    def compensated_in_recovery(self, undo_id: int, effect_id: str, session_id: str, halt_reason: str, *,
                                durable: bool = True) -> None:
        """One compensation recovery ran, recorded in one transaction: the entry and the effect ``compensated``
        and the session halted for a person (a crash can never leave it writable with the effect undone).

        ``durable=False`` commits without waiting for the disk (the fast engine): a crashed process loses
        nothing so committed, only a power loss can, and then the next ``recover()`` runs the compensation again
        with the same ``undo-{id}`` key, as after a crash between a compensation and its record. Recovery
        commits the last record of each batch durably, which flushes the ones before it.
        """
        ...

    def settle_effect(self, effect_id: str, state: EffectState | None, *, result: Any = None,
                      error: str | None = None, halt: tuple[str, str] | None = None, drop_undo: bool = False,
                      event: PendingEvent | None = None) -> None:
        """Recovery's verdict on an effect, and (``halt`` = (session, reason)) the session halted for a person, in
        one transaction. ``drop_undo``: it did not happen, its armed undo entry goes. ``event``: the audit event of
        the probe's answer behind the verdict. ``state`` None records the event alone (the effect stays as it is).

        Only while the effect is in flight: a late finish recorded meanwhile (``record_late_finish``) stands."""
        ...

    def note_event(self, event: PendingEvent) -> None:
        """One audit event in a transaction of its own (a probe's answer that settles nothing by itself)."""
        ...

    def recovery_attempt_failed(self, effect_id: str, session_id: str, error: str, *, dead_letter_after: int,
                                halt_reason: str) -> int:
        """Count a failed attempt; at ``dead_letter_after`` the effect is dead-lettered and the session halted.
        Returns the attempts so far. Below the limit the claim is released, so the next recover() tries again."""
        ...


@runtime_checkable
class OwnersRepository(Protocol):
    """``store.owners`` (``OwnersSQL``): sessions held by a live process (``undolog_session_owners``): its lease,
    and a rollback filed for it to run. Its own repository: no transaction writes it with another table, and no
    call's path reads it. Each method is one transaction of its own.

    Fences: one filed rollback per session at a time (``file_rollback`` is False while one is filed); whoever
    serves a session now takes it (``hold_sessions``: the last writer wins, by design).

    Example:
        >>> storage.owners.session_owner("s1").owner
        'gateway-1@host:4242'
    """

    def session_owner(self, session_id: str) -> Any:
        """The process holding the session (``owner``, ``lease_until``, ``wakes_on_signal``), or None."""
        ...

    def hold_sessions(self, owner: str, session_ids: Iterable[str], *, until: dt.datetime,
                      wakes_on_signal: bool = False) -> None:
        """Take (or renew) the sessions for ``owner`` until ``until``, whoever held them before, in one
        transaction: the process serving a session now owns it."""
        ...

    def renew_sessions(self, owner: str, *, until: dt.datetime) -> None:
        """Renew the lease of every session ``owner`` holds."""
        ...

    def file_rollback(self, session_id: str, *, actor: str, reason: str | None, now: dt.datetime) -> bool:
        """File a rollback of the session for its owner to run; False when one is filed already (the caller
        waits on that one's report)."""
        ...

    def filed_rollbacks(self, owner: str) -> list[Any]:
        """The rollbacks filed for ``owner``'s sessions that it has not answered yet."""
        ...

    def answer_rollback(self, session_id: str, report: Mapping[str, Any]) -> None:
        """The owner's answer to a filed rollback: its report (or the error that refused it)."""
        ...

    def rollback_answer(self, session_id: str) -> Any:
        """What the requester of a rollback reads while it waits: the report (None: not answered yet)."""
        ...

    def close_rollback(self, session_id: str) -> None:
        """The filed rollback answered and read: the session can be filed for again."""
        ...

    def let_go_sessions(self, owner: str, *, now: dt.datetime) -> None:
        """``owner`` stops serving: the lease of every session it held ends ``now``."""
        ...


@runtime_checkable
class ApprovalsRepository(Protocol):
    """``store.approvals`` (``ApprovalsSQL``): the approval requests (``undolog_approval_requests``) of
    IRREVERSIBLE calls. A request leaves ``pending`` once (a decision, a timeout, a cancellation) and an approval
    lapses once; every change is audited in its own transaction, with its outbox row. The request row is written
    here too (``insert_request_in``), in the transaction of the call that asks for approval.

    Fences: a decision locks the session row first, then the request, then an audit head (the agent's call takes
    the same order), so a decision and a call never deadlock; the sweeps claim due requests ``FOR UPDATE SKIP
    LOCKED`` (PostgreSQL), so several sweepers take disjoint batches and each request is settled once. On SQLite
    the single writer serialises all of it.

    Example:
        >>> storage.approvals.decide_request(rid, action="approve", approver="ana", reason=None, now=utcnow())
        [StateChange(session_id='...', state=<SessionState.ACTIVE: 'active'>, only_from=...)]
    """

    def list_requests(self, *, state: RequestState | None = None, session_id: str | None = None,
                      tool_name: str | None = None, limit: int = 500, offset: int = 0,
                      brief: bool = False) -> builtins.list[ApprovalRecord]:
        """Requests newest first (ties by id: pages never overlap); ``brief`` reads the arguments and context as
        previews cut in the database."""
        ...

    def get_request(self, approval_request_id: str) -> ApprovalRecord | None:
        """One request, or None when there is no such request."""
        ...

    def request_events(self, approval_request_id: str) -> builtins.list[ApprovalEvent]:
        """The request's audit events, oldest first."""
        ...

    def joined_sessions_in(self, conn: Connection, approval_request_id: str) -> builtins.list[str]:
        """The sessions that joined the request, in the order they joined, as the caller's transaction sees it."""
        ...

    def note_request_event(self, approval_request_id: str, *, action: str, actor: str, session_id: str,
                           now: dt.datetime, extra: Mapping[str, Any] | None = None) -> int:
        """Audit, in a transaction of its own, that a session ``joined`` a pending request, that an approved
        request was ``released`` to one, or the ``model_message`` its call came from (``extra``, kept in the
        event's payload); returns the event id."""
        ...

    def due_request_ids(self, now: dt.datetime) -> builtins.list[str]:
        """Pending requests past their ``timeout_at``."""
        ...

    def decide_request(self, approval_request_id: str, *, action: str, approver: str, reason: str | None,
                       now: dt.datetime, approved_args: Mapping[str, Any] | None = None,
                       response: str | None = None) -> builtins.list[StateChange]:
        """Record a person's decision in ONE transaction (the request, its effect, the audit event and its outbox
        row; on a rejection the session halted and its other pending requests cancelled); the session state
        changes. Runs as an urgent writer (ahead of the agents' writes queued on SQLite's write lock).

        Raises ``ApprovalNotFound`` (no such request) or ``ApprovalAlreadyDecided`` (no longer pending: another
        decision or a timeout came first); nothing is written then.
        """
        ...

    def expire_request(self, approval_request_id: str, now: dt.datetime) -> builtins.list[StateChange] | None:
        """Apply the timeout to one due request per the policy (``auto_approved``, or ``timed_out`` with the
        session halted); None when it was not due, not pending, or another process is expiring it now."""
        ...

    def due_claim(self, now: dt.datetime, *, limit: int = EXPIRE_BATCH, only: Sequence[str] | None = None,
                  with_args: bool = False) -> Any:
        """The SELECT of up to ``limit`` pending requests due at ``now``, oldest first, in the due index's order
        (a statement, not run: ``expire_batch`` locks it)."""
        ...

    def expire_batch(self, now: dt.datetime, *, limit: int = EXPIRE_BATCH, only: Sequence[str] | None = None,
                     ) -> tuple[builtins.list[ExpiredRequest], builtins.list[StateChange]]:
        """Apply the timeout to up to ``limit`` due requests in ONE transaction, each exactly as
        ``expire_request`` would; a request another transaction holds is skipped, not waited for."""
        ...

    def approval_lapsed(self, decided_at: dt.datetime | None, now: dt.datetime) -> bool:
        """Whether an approval decided at ``decided_at`` is older than the policy's ``approved_ttl_seconds``."""
        ...

    def lapse_request(self, approval_request_id: str, now: dt.datetime) -> builtins.list[StateChange] | None:
        """Expire one approved request whose call was not re-issued in time; None when it is not lapsed or
        another process is expiring it now."""
        ...

    def lapse_batch(self, now: dt.datetime, *, limit: int = EXPIRE_BATCH, only: Sequence[str] | None = None,
                    ) -> tuple[builtins.list[str], builtins.list[StateChange]]:
        """Expire up to ``limit`` lapsed approvals in ONE transaction (request and effect ``expired``, the effect
        giving its call id up, audited); the session is not halted."""
        ...

    def sweep_slot_key(self) -> int:
        """The first key of this schema's sweep slots (PostgreSQL advisory locks bounding concurrent sweeps)."""
        ...

    def cancel_pending_in(self, conn: Connection, session_id: str, why: str, now: dt.datetime, *,
                          except_id: str | None = None) -> int:
        """Cancel every pending request of the session (but ``except_id``) in the caller's transaction; how many."""
        ...

    def cancel_request_in(self, conn: Connection, request_id: str, effect_id: str, why: str,
                          now: dt.datetime) -> bool:
        """Cancel a request that may still lead to a run, and its effect if it has not run, audited, in the
        caller's transaction; False when it was already settled."""
        ...

    def unsettled_requests_in(self, conn: Connection, session_id: str) -> builtins.list[Any]:
        """The session's requests that may still lead to a run (pending or approved), as the caller's transaction
        sees them: what a rollback cancels."""
        ...

    def insert_request_in(self, conn: Connection, record: Mapping[str, Any], now: dt.datetime, *,
                          actor: str, payload: dict[str, Any]) -> None:
        """Raise a request in the caller's transaction (the call's): the row, its session ``awaiting_approval``
        (``store.sessions``) and the audited ``requested`` event with its outbox row."""
        ...


@runtime_checkable
class AuditRepository(Protocol):
    """``store.audit`` (``AuditSQL``): the hash-chained audit events (``undolog_approval_events``) and their chain
    heads (``undolog_audit_head``). Events are appended, never changed or deleted (triggers refuse it).

    Fences: an append locks one chain head row until its transaction ends (PostgreSQL: the first head free,
    ``SKIP LOCKED``; SQLite: chain 1 under the single writer), so no two writers fork a chain, and a transaction
    holds one head at most, so two appending transactions never deadlock on heads.

    Example:
        >>> with storage.tx() as conn:
        ...     storage.audit.append_event_in(conn, subject="policy", action="policy.set", actor="ana", payload={})
    """

    def append_event_in(self, conn: Connection, *, subject: str, action: str, actor: str,
                        payload: Mapping[str, Any], approval_request_id: str | None = None,
                        outbox: Iterable[OutboxItem] = (), now: dt.datetime | None = None) -> int:
        """Append one event, and its ``outbox`` rows, in the caller's transaction; returns its event id.

        The event's hash covers every stored column and the hash before it in its chain; ids grow along every
        chain. ``now`` (default: the clock) is stored to the microsecond, so the hash recomputes from the row.
        """
        ...

    def append_events_in(self, conn: Connection, events: Sequence[PendingEvent], *,
                         now: dt.datetime | None = None) -> builtins.list[int]:
        """Append a batch in order in the caller's transaction (one head lock for the batch); the event ids, in
        order. The chain is the same as the events appended one by one."""
        ...

    def append_event(self, *, subject: str, action: str, actor: str, payload: Mapping[str, Any],
                     approval_request_id: str | None = None, outbox: Iterable[OutboxItem] = (),
                     now: dt.datetime | None = None) -> int:
        """``append_event_in`` in a write transaction of its own."""
        ...

    def chain(self) -> AbstractContextManager[AuditChainReader]:
        """Every chain and its heads read in ONE snapshot (REPEATABLE READ on PostgreSQL): what ``verify``
        recomputes. Appends committed meanwhile are not seen, in the events nor in the heads."""
        ...

    def locked_heads(self) -> builtins.list[ChainHead]:
        """Every chain's head, read holding every head's lock (then released): a cut with no append half done,
        what a checkpoint signs."""
        ...


@runtime_checkable
class OutboxRepository(Protocol):
    """``store.outbox`` (``OutboxSQL``): the outbox table (``undolog_outbox``). A row is written in the
    transaction of what it reports (it exists exactly when that does) and handed to a consumer once.

    Example:
        >>> storage.outbox.drain(lambda conn, events: None, OutboxEvent, limit=100)
        0
    """

    def write_in(self, conn: Connection, items: Iterable[OutboxItem], *, now: dt.datetime | None = None) -> None:
        """Queue ``items`` (event type, JSON payload) in the caller's transaction; nothing for no items."""
        ...

    def write_many_in(self, conn: Connection, items: Iterable[OutboxItem], *, now: dt.datetime | None = None) -> None:
        """``write_in`` for a large batch: one statement whatever the count on PostgreSQL."""
        ...

    def drain(self, handle: Callable[[Any, Sequence[Any]], None], make: Callable[..., Any], *, limit: int) -> int:
        """Claim up to ``limit`` undelivered rows in id order, build ``make(outbox_id, event_type, payload,
        created_at, risk_tags)`` for each, call ``handle(conn, events)`` inside the claiming transaction and
        mark them delivered in it; returns how many were handed over.

        Fences: PostgreSQL skips the rows another drainer holds (``FOR UPDATE SKIP LOCKED``), so each row goes to
        one drainer; SQLite's single writer does the same. If ``handle`` raises, nothing is marked delivered.
        """
        ...


@runtime_checkable
class PolicyRepository(Protocol):
    """``store.policy`` (``PolicySQL``): the org policy table (``undolog_org_policy``), exactly one row, changed
    only together with its audit event.

    Example:
        >>> storage.policy.get().approval_timeout_seconds
        3600
    """

    def get_in(self, conn: Connection) -> OrgPolicy:
        """The policy as the caller's transaction sees it."""
        ...

    def get(self) -> OrgPolicy:
        """The policy, in a read transaction of its own."""
        ...

    def set(self, changes: Mapping[str, Any], *, actor: str, now: dt.datetime) -> tuple[OrgPolicy, OrgPolicy]:
        """Apply ``changes`` (validated by the caller: ``PolicyService``) and append ``policy.set`` with the
        policy before and after, in one transaction; returns (before, after)."""
        ...


@runtime_checkable
class RegistryRepository(Protocol):
    """``store.registry`` (``RegistrySQL``): the tool registry (``undolog_tool_registry``). A revision is written
    once and never changed; revision numbers of a tool run 1, 2, 3... without gaps.

    Example:
        >>> [r.revision for r in storage.registry.register([contract], actor="ci", now=utcnow())[0]]
        [1]
    """

    def register(self, contracts: Sequence[ContractRevision], *, actor: str,
                 now: dt.datetime) -> tuple[builtins.list[RegisteredRevision], builtins.list[StateChange]]:
        """Store each contract as its tool's newest revision unless its fingerprint is the newest already, in one
        transaction; a changed contract cancels the approvals bound to another fingerprint not yet run.

        Returns each contract's revision (``created`` False: unchanged) and the session state changes the
        cancellations made. Fences: the primary key (tool, revision); a process that loses the race for a number
        reads again and retries (safe: it re-reads the newest revision), up to 3 times, then raises
        ``IntegrityError``.
        """
        ...

    def contract_of(self, tool_name: str, revision: int) -> dict[str, Any] | None:
        """The stored contract of one revision, or None when it is not registered."""
        ...

    def arguments_jsonschema_of(self, tool_name: str, revision: int) -> dict[str, Any] | None:
        """The JSON schema of one revision's arguments, or None when it is not registered."""
        ...

    def history(self, tool_name: str | None = None) -> builtins.list[dict[str, Any]]:
        """Every revision (of one tool, or of all), ordered by (tool, revision)."""
        ...


@runtime_checkable
class ArchiveRepository(Protocol):
    """``store.archive`` (``ArchiveSQL``): the archive table (``undolog_archive``) that ``undolog gc`` moves the
    effects and undo entries of settled sessions into. Audit events are never archived.

    Example:
        >>> ids = storage.archive.settled_sessions(cutoff, limit=500)
        >>> storage.archive.archive_sessions(ids, cutoff, run_id="r1", actor="ana", now=utcnow()).effects
        3
    """

    def settled_sessions(self, cutoff: dt.datetime, *, limit: int,
                         after: str | None = None) -> builtins.list[str]:
        """Up to ``limit`` settled sessions idle since before ``cutoff``, in id order after ``after``: ended, or
        active with nothing that can still run, be decided or be compensated; never halted ones."""
        ...

    def archive_sessions(self, session_ids: Sequence[str], cutoff: dt.datetime, *, run_id: str, actor: str,
                         now: dt.datetime) -> GcBatch:
        """Move the rows of those of ``session_ids`` still settled into the archive, closing the active ones
        (``completed``), with the ``gc.archive`` audit event, in ONE transaction.

        Fences: the session rows are locked (``SKIP LOCKED``: a session another gc holds is left to it) and
        re-checked as settled under the lock. Effects an approval request refers to stay.
        """
        ...

    def archived(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The archived rows of one session, oldest first."""
        ...


#: The repositories a ``Storage`` exposes, by attribute, and the Protocol each satisfies.
REPOSITORIES: dict[str, type[Any]] = {
    "sessions": SessionsRepository,
    "undo": UndoRepository,
    "effects": EffectsRepository,
    "recovery": RecoveryService,
    "owners": OwnersRepository,
    "approvals": ApprovalsRepository,
    "audit": AuditRepository,
    "outbox": OutboxRepository,
    "policy": PolicyRepository,
    "registry": RegistryRepository,
    "archive": ArchiveRepository,
}

__all__ = [
    "REPOSITORIES",
    "SessionsRepository",
    "UndoRepository",
    "EffectsRepository",
    "RecoveryService",
    "OwnersRepository",
    "ApprovalsRepository",
    "ArchiveRepository",
    "AuditRepository",
    "OutboxRepository",
    "PolicyRepository",
    "RegistryRepository",
    "StoreProtocol",
]
