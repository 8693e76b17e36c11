"""Module-level helpers: a thread's session, rollback, and resuming threads whose approvals were decided.

Imports LangGraph's ``Command`` and the sibling modules; holds no state of its own.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langgraph.types import Command

from undolog_core import RequestState, errors
from undolog_core.integration import session_table

from ._payload import ours as _ours
from ._payload import requests_of as _requests_of
from ._payload import resume_value_for as _resume_value_for
from ._sessions import _ADAPTERS, _base_of, _chain, _chain_index, _default_undolog, _thread, _thread_config
from ._tools import emit, rollback_events

if TYPE_CHECKING:
    from undolog_core import UndoLog


def session_for_thread(thread_id: str, *, undolog: UndoLog | None = None) -> str:
    """The id of the thread's current UndoLog session (``thread_id``, or ``thread_id#N`` after rollbacks).

    Example:
        >>> undolog.sessions.get(session_for_thread("ticket-1042", undolog=undolog)).state  # doctest: +SKIP
        'active'
    """
    u = _default_undolog(undolog)
    n = 1
    while True:
        try:
            u.sessions.get(_chain(str(thread_id), n + 1))
            n += 1
        except errors.SessionNotFound:
            return _chain(str(thread_id), n)


def new_session(thread_id: str, *, undolog: UndoLog | None = None, agent_id: str = "langgraph") -> str:
    """Open the thread's next session, e.g. after a rollback in a hand-built graph; returns its id.

    ``UndoLogMiddleware`` does this by itself at the next user turn.

    Example:
        >>> new_session("ticket-1042", undolog=undolog)  # doctest: +SKIP
        'ticket-1042#2'
    """
    u = _default_undolog(undolog)
    current = session_for_thread(thread_id, undolog=u)
    sid = _chain(str(thread_id), _chain_index(str(thread_id), current) + 1)
    session_table(u).ensure_session(sid, agent_id=agent_id)
    for a in list(_ADAPTERS):
        with a._undolog_guard.lock:
            a._undolog_guard.heads.pop(str(thread_id), None)
    return sid


def rollback(thread_id: str, *, undolog: UndoLog | None = None, reason: str | None = None) -> Any:
    """Undo the thread's current session, newest effect first, for a graph's own failure paths.

    Returns the core's ``RollbackReport``. Irreversible steps stay done (the report lists them); a
    compensation that fails halts the session for a person.

    Example:
        >>> report = rollback("ticket-1042", undolog=undolog)               # doctest: +SKIP
        >>> [(s.tool_name, s.outcome) for s in report.steps]               # doctest: +SKIP
        [('send_refund_email', 'compensated')]
    """
    u = _default_undolog(undolog)
    sid = session_for_thread(thread_id, undolog=u)
    return _told(u.saga.rollback_sync(sid, reason=reason or "requested by the graph", actor="langgraph"))


async def arollback(thread_id: str, *, undolog: UndoLog | None = None, reason: str | None = None) -> Any:
    """Async :func:`rollback`."""
    u = _default_undolog(undolog)
    sid = session_for_thread(thread_id, undolog=u)
    return _told(await u.saga.rollback(sid, reason=reason or "requested by the graph", actor="langgraph"))


def _told(report: Any) -> Any:
    """The rollback's report, each compensation told to the run's callbacks (in a node, they see what was undone)."""
    for name, data in rollback_events(report, None):
        emit(name, data)
    return report


def undolog_resume(graph: Any, config: Mapping[str, Any], *, undolog: UndoLog | None = None) -> dict[str, Any]:
    """The resume value for every UndoLog interrupt of the thread, built from the store.

    Use it when the decisions were made elsewhere (``undolog approvals approve``, the REST API, the
    dashboard). Requests still undecided resume as ``from_store``: nothing runs and the graph
    pauses again.

    Returns:
        ``{interrupt_id: value}``, ready for ``Command(resume=...)``.

    Example:
        >>> undolog.approvals.approve(request_id, approver="ana")                      # doctest: +SKIP
        >>> graph.invoke(Command(resume=undolog_resume(graph, config)), config)          # doctest: +SKIP
    """
    return _resume_values(_default_undolog(undolog), config, graph.get_state(config).interrupts)


async def aundolog_resume(graph: Any, config: Mapping[str, Any], *, undolog: UndoLog | None = None) -> dict[str, Any]:
    """Async :func:`undolog_resume` (for async checkpointers)."""
    return _resume_values(_default_undolog(undolog), config, (await graph.aget_state(config)).interrupts)


def _resume_values(u: UndoLog, config: Mapping[str, Any], interrupts: Sequence[Any]) -> dict[str, Any]:
    """``{interrupt_id: resume value}`` for the thread's UndoLog interrupts among ``interrupts``."""
    mine = _ours(interrupts)
    if not mine:
        raise errors.UndoLogError(f"thread {_thread(config)!r} is not paused on an UndoLog approval")
    return {i.id: _resume_value_for(u, i.value) for i in mine}


def _decided_threads(u: UndoLog, thread_ids: Iterable[str] | None) -> list[str]:
    u.approvals.expire_due()
    if thread_ids is not None:
        return list(dict.fromkeys(str(t) for t in thread_ids))
    sessions: dict[str, None] = {}
    for state in (RequestState.APPROVED, RequestState.REJECTED, RequestState.TIMED_OUT, RequestState.AUTO_APPROVED,
                  RequestState.CANCELLED, RequestState.RESPONDED):
        for rec in u.approvals.list(state=state):
            sessions[rec.session_id] = None
    return list(dict.fromkeys(_base_of(s) for s in sessions))


def _all_decided(u: UndoLog, interrupts: Sequence[Any]) -> bool:
    for i in interrupts:
        for req in _requests_of(i.value):
            if u.approvals.get(req["approval_request_id"]).state == RequestState.PENDING:
                return False
    return True


def resume_decided(
    graph: Any, *, undolog: UndoLog | None = None, thread_ids: Iterable[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Resume every thread paused on UndoLog approvals that are now all decided (or timed out).

    Run it from a worker or a cron job next to the approval UI. Threads are found through the store
    (or given in ``thread_ids``); a thread still waiting on any request is left alone.

    Returns:
        ``{thread_id: the graph's output}`` for each thread resumed.

    Example:
        >>> resume_decided(agent, undolog=undolog)  # doctest: +SKIP
        {'ticket-1042': {'messages': [...]}}
    """
    walk = _resuming(_default_undolog(undolog), thread_ids, config)
    try:
        step = next(walk)
        while True:  # each step the graph's sync form: read a thread's state, or resume it
            step = walk.send(graph.get_state(step[1]) if step[0] is _STATE else graph.invoke(*step[1:]))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def aresume_decided(
    graph: Any, *, undolog: UndoLog | None = None, thread_ids: Iterable[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Async :func:`resume_decided`."""
    walk = _resuming(_default_undolog(undolog), thread_ids, config)
    try:
        step = next(walk)
        while True:  # as in resume_decided, the graph's async form
            step = walk.send(await graph.aget_state(step[1]) if step[0] is _STATE else await graph.ainvoke(*step[1:]))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


_STATE, _RESUME = "state", "resume"  # what a resume walk asks of the graph


def _resuming(u: UndoLog, thread_ids: Iterable[str] | None,
              config: Mapping[str, Any] | None) -> Generator[tuple[Any, ...], Any, dict[str, Any]]:
    """The steps of :func:`resume_decided` and :func:`aresume_decided`; returns the outputs by thread.

    For each thread with decided requests: ask for its state (``(_STATE, config)``, sent the graph's state), and
    resume it when every UndoLog request it waits on is decided (``(_RESUME, Command, config)``, sent the graph's
    output).
    """
    done: dict[str, Any] = {}
    for tid in _decided_threads(u, thread_ids):
        cfg = _thread_config(config, tid)
        mine = _ours((yield _STATE, cfg).interrupts)
        if mine and _all_decided(u, mine):
            done[tid] = yield _RESUME, Command(resume={i.id: _resume_value_for(u, i.value) for i in mine}), cfg
    return done
