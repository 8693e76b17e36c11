"""What a framework integration needs beyond the public API.

The adapters and the MCP gateway import these from here, never from the core's private modules, so the core can
move its internals without breaking them.

- ``Execute``, ``AwaitingApproval``, ``Completed`` (a call's decision), ``Outcome`` and ``NothingHappened`` (what
  the call driver reports of it), ``CallDriver`` and ``ToolSpec`` (a registered tool's contract): the decision types
  an adapter drives a call with (importable from ``undolog_core`` itself until 0.1).
- ``WouldBlock``: raised by the call driver, before anything is written, when a caller on an event loop asked not
  to wait (``wait=False``) and the decision would wait for a pool slot or SQLite's write lock; decide again in a
  worker thread.
- ``execute_now`` and ``SessionCache``: the decision of a SAFE call built without the outcome machinery, and what
  the process knows of a session (for adapters that keep a session per conversation).
- ``tool_name_of``: the name a tool is registered under (its declaration's name, a framework tool's ``name``, or
  the function's ``__name__``).
- ``jsonable``: a value as the store keeps it (JSON; NaN and infinities as strings, the same on both databases).
- ``run_coro_blocking``: a coroutine run to completion from sync code, in a thread of its own when this thread
  already runs an event loop (the caller's context variables travel with it).
- ``Continuation`` and ``KICKOFF``: a kickoff continued without repeating what it did (CrewAI, Semantic Kernel's
  ``resume()``), and the context variable naming the kickoff each effect is recorded under.
- ``metering``: counters for work that is SAFE by nature and not audited (the gateway's resource reads).
- ``WAKE_SIGNAL``: the signal a rollback requester on this host sends a session's owning process.
- ``IN_FLIGHT``: the effect states of a call still in flight.
- ``ApprovalRecord``: an approval request as read from the store.
- ``persist_session``: write a session this process started but has not written yet, now (for a reader in another
  process: the desk's HTTP agents).
- ``session_table`` and ``SessionTable``: the session lifecycle an adapter drives (look a conversation's session up,
  start it, read its state, bound what is kept), and ``hot_path`` and ``HotPath``: the decision of one call without
  the driver's frames (a SAFE call counted in memory, a logged one's pre-write). Both hand back the core's own object
  typed by the protocol, so a call through them costs no Python frame of its own: take it once, when the adapter is
  built, and call its methods.
- ``put_undo_args``: store what a gateway captured before a call with the call's undo entry.
- ``shared_store``: the store the desk's and the gateway's own tables live on (one pool, one migration run).
- ``find_effect`` and ``EffectRef``: one effect's session, tool and state, or None (the desk's Resolve checks who
  may see the call before a person settles it); ``find_call``: the same, found by the call's id in its session (a
  gateway's client re-sending a call still running); ``session_of_client_key``: which session holds a client-keyed
  call (the gateway's idempotency keys span an API key's sessions).

Example:
    >>> from undolog_core.integration import jsonable, tool_name_of
    >>> def refund(user_id: str) -> None: ...
    >>> tool_name_of(refund), jsonable({"amount": float("nan")})
    ('refund', {'amount': 'NaN'})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._continuation import Continuation
from ._decisions import KICKOFF, AwaitingApproval, Completed, Execute, execute_now
from ._driver import CallDriver, NothingHappened, Outcome
from ._json import jsonable
from ._observe import metering
from ._owners import WAKE_SIGNAL
from ._saga import run_coro_blocking
from ._session_record import SessionCache
from ._tools import ToolSpec, tool_name_of
from .storage.pool import WouldBlock
from .storage.records import ApprovalRecord
from .storage.schema import IN_FLIGHT, EffectState

if TYPE_CHECKING:
    from ._decisions import Decision
    from ._session import SessionRecord
    from ._undolog import UndoLog
    from .storage import Storage

__all__ = ["IN_FLIGHT", "KICKOFF", "WAKE_SIGNAL", "ApprovalRecord", "AwaitingApproval", "CallDriver", "Completed",
           "Continuation", "EffectRef", "Execute", "HotPath", "NothingHappened", "Outcome", "SessionCache",
           "SessionTable", "ToolSpec", "WouldBlock", "execute_now", "find_call", "find_effect", "hot_path", "jsonable",
           "metering", "persist_session", "put_undo_args", "run_coro_blocking", "session_of_client_key",
           "session_table", "shared_store", "tool_name_of"]


def persist_session(undolog: UndoLog, session_id: str) -> None:
    """Write the session ``session_id`` now, if this process started it and has not written it yet.

    A minted id's row waits for its first logged call on PostgreSQL; another process that reads the store (the
    desk's next request, served elsewhere) then finds it.

    Example:
        >>> s = undolog.session(agent_id="support-bot")                  # doctest: +SKIP
        >>> persist_session(undolog, s.id)                               # doctest: +SKIP
    """
    undolog.engine.persist(session_id)


class SessionTable(Protocol):
    """The sessions this process keeps in memory, as an adapter drives them (one session per conversation).

    Each method answers from this process's record (a ``SessionCache``) when it has one and reads or writes the
    store only when it must. ``wait=False`` (a caller on an event loop) raises ``WouldBlock`` instead of waiting for
    a connection; the caller then asks again in a worker thread.

    Example:
        >>> sessions = session_table(undolog)                          # doctest: +SKIP
        >>> sc = sessions.look_up_session("chat-1", agent_id="support-bot")  # doctest: +SKIP
        >>> sc.state                                                    # doctest: +SKIP
        'active'
    """

    @property
    def max_sessions(self) -> int:
        """How many session records are kept in memory (``UndoLog(max_sessions=...)``): bound an adapter's too."""

    def cached(self, session_id: str) -> SessionCache | None:
        """This process's record of the session, or None: no I/O."""

    def look_up_session(self, session_id: str, *, agent_id: str | None = None, wait: bool = True,
                        minted: bool = False) -> SessionCache:
        """The record, read from the store when this process does not know the session (else kept in memory)."""

    def ensure_session(self, session_id: str, *, agent_id: str | None = None, created_by: str | None = None,
                       on_failure: str = "rollback", create: bool = True, fresh: bool = False, durable: bool = True,
                       wait: bool = True) -> SessionCache:
        """The record, read from the store, or the session started there.

        ``fresh``: a just-minted id, inserted first; ``durable=False``: its row may wait for its first logged call.
        """

    def try_start(self, session_id: str, *, agent_id: str | None = None, on_failure: str = "rollback",
                  unless: str | None = None, durable: bool = True) -> SessionCache | None:
        """The session started without reading the store first (never beside ``unless``), or None: read it then."""

    def session_states(self, session_ids: list[str], *, wait: bool = True) -> dict[str, tuple[str, str | None]]:
        """The stored state (and halt reason) of each of the sessions the store has: a read only."""

    def sessions_with_call(self, session_ids: list[str], call_id: str) -> set[str]:
        """Which of the sessions already hold a call with this id (a call re-issued by a replay)."""

    def remember(self, row: SessionRecord, *, write: bool = True) -> SessionCache:
        """Put a session read from the store back into this process's records, and return its record.

        For a record found out of date (a person resumed or revalidated the session from another process): the
        state, pins and failure policy become the row's; the calls counted in memory are kept. ``write=False``: a
        caller that may not wait for the store (trimming the records writes the ones it drops).
        """

    def needs_trim(self) -> bool:
        """Whether more records are kept than ``max_sessions``."""

    def trim(self, *, write: bool = True) -> int:
        """Bring the records down to ``max_sessions``, oldest first (written first with ``write``)."""


class HotPath(Protocol):
    """One call's decision without the call driver's frames: what a framework adapter calls on every tool call.

    ``decide_safe`` decides a SAFE call in memory (its arguments checked, the session's pin checked, the call
    counted); ``note_safe_in`` counts a SAFE call already checked into the session's record; ``intercept_spec``
    decides a COMPENSABLE or IRREVERSIBLE call (its durable pre-write, or the approval it waits for).

    Example:
        >>> hot = hot_path(undolog)                                          # doctest: +SKIP
        >>> hot.decide_safe("chat-1", spec, {"query": "refunds"}, "call-1")  # doctest: +SKIP
        Execute(...)
    """

    def decide_safe(self, session_id: str, spec: ToolSpec, args: Mapping[str, Any], call_id: str | None = None,
                    wait: bool = True) -> Execute:
        """A SAFE call's decision: nothing is written."""

    def note_safe_in(self, sc: SessionCache, spec: ToolSpec, args: Mapping[str, Any]) -> None:
        """Count a SAFE call (its contract already checked) into the session's record: nothing is written."""

    def intercept_spec(self, session_id: str, spec: ToolSpec, args: Mapping[str, Any], call_id: str | None = None,
                       match_digest: bool = False, wait: bool = True) -> Decision:
        """A logged call's decision: its pre-write, or the approval it waits for, or its earlier answer."""


def session_table(undolog: UndoLog) -> SessionTable:
    """The session lifecycle of ``undolog``, for an adapter to hold from its construction on.

    It is the engine itself, typed by the protocol: a call costs no frame of the contract's own, and a method
    replaced on the engine (a test's spy) is the one called.

    Example:
        >>> sessions = session_table(undolog)                            # doctest: +SKIP
        >>> sessions.ensure_session("chat-1", agent_id="support-bot")    # doctest: +SKIP
    """
    return undolog.engine


def hot_path(undolog: UndoLog) -> HotPath:
    """The per-call decisions of ``undolog``, for an adapter to hold from its construction on (see ``HotPath``).

    Example:
        >>> hot = hot_path(undolog)                                      # doctest: +SKIP
        >>> decision = hot.intercept_spec("chat-1", spec, {"to": "a@b.c"}, "call-2")  # doctest: +SKIP
    """
    return undolog.engine


def put_undo_args(undolog: UndoLog, effect_id: str, args: Any) -> bool:
    """Replace the arguments stored with the effect's armed undo entry (what its compensation is given).

    A gateway stores there what it captured before the call was sent. False when the entry is no longer armed.

    Blocking I/O: from an event loop, call it in a worker thread.

    Example:
        >>> before = {"path": "a.txt", "dev.undolog/before": {"content": "old"}}
        >>> put_undo_args(undolog, effect_id, before)                       # doctest: +SKIP
        True
    """
    return undolog.store.undo.put_undo_args(effect_id, args)


def shared_store(undolog: UndoLog) -> Storage:
    """The store of ``undolog``, for the packages that keep tables of their own beside the core's.

    The desk's tables and the gateway's API keys: one pool and one migration run for all of them.

    Example:
        >>> from undolog_server.storage import ServerStore                # doctest: +SKIP
        >>> ServerStore(shared_store(undolog)).migrate()                   # doctest: +SKIP
    """
    return undolog.store


@dataclass(frozen=True)
class EffectRef:
    """Where one effect belongs: its session and the tool (and revision) of its call, and where it stands.

    Attributes:
        effect_id: The effect.
        session_id: The session it was recorded in.
        tool_name: The tool the call ran.
        tool_revision: The tool revision it ran under (None for a call recorded before revisions).
        state: Its state when read (``state in IN_FLIGHT``: the call is still running).
    """

    effect_id: str
    session_id: str
    tool_name: str
    tool_revision: int | None
    state: EffectState


def find_effect(undolog: UndoLog, effect_id: str) -> EffectRef | None:
    """The session and tool of the effect ``effect_id``, or None when there is no such effect.

    A read for a client that must check who may see a call before acting on it (the desk's Resolve: an approver
    outside the tool's groups is refused before the decision).

    Example:
        >>> ref = find_effect(undolog, "3f2a...")                         # doctest: +SKIP
        >>> ref.session_id, ref.tool_name                                # doctest: +SKIP
        ('support.9f2c...', 'issue_refund')
    """
    session_id = undolog.store.effects.session_of_effect(effect_id)
    if session_id is None:
        return None
    return _effect_ref(undolog.store.effects.effect(effect_id))


def find_call(undolog: UndoLog, session_id: str, call_id: str) -> EffectRef | None:
    """The effect the call ``call_id`` recorded in the session ``session_id``, or None (no such logged call).

    A read for a client that was refused a call because the same call is in flight (a gateway's client re-sending
    a keyed call): while ``ref.state in IN_FLIGHT`` it is still running; else ask the call driver again for its
    recorded answer. Blocking I/O: from an event loop, call it in a worker thread.

    Example:
        >>> ref = find_call(undolog, "support.9f2c...", "ck:1f0e...")        # doctest: +SKIP
        >>> ref is not None and ref.state in IN_FLIGHT                   # doctest: +SKIP
        True
    """
    row = undolog.store.effects.effect_by_call(session_id, call_id)
    return None if row is None else _effect_ref(row)


def session_of_client_key(undolog: UndoLog, call_id: str) -> str | None:
    """The session holding the client-keyed call ``call_id`` (``ck:...``), or None when no session holds it.

    A client-keyed call id is unique across sessions (one API key's sessions share its keys): the gateway sends a
    call re-issued under an earlier session's key to that session. Blocking I/O: from an event loop, call it in a
    worker thread.

    Example:
        >>> session_of_client_key(undolog, "ck:1f0e...")                  # doctest: +SKIP
        'mcp.7d1a...'
    """
    return undolog.store.effects.session_of_client_key(call_id)


def _effect_ref(row: Any) -> EffectRef:
    revision = row.tool_revision
    return EffectRef(str(row.effect_id), str(row.session_id), str(row.tool_name),
                     None if revision is None else int(revision), EffectState(row.state))
