"""A rejection given in the same resume as its siblings' approvals is recorded first, whichever task runs first.

``create_agent`` runs each tool call as its own task (a LangGraph ``Send``), so ``UndoLogMiddleware`` pauses once per
gated call and one resume answers several pauses at once: ``Command(resume={interrupt_id: decision, ...})``. Each task
reads only its own answer, and the tasks run in parallel: left alone, the task of an approved call could run it before
the task of a rejected sibling records the rejection. UndoLog's rule is that a rejection halts the session and cancels
its other pending requests, so an approved sibling of the same batch must not run (``UndoLogToolNode``, which pauses
once per message, never had the problem).

So each task, before recording its own answer, looks through the whole resume map (LangGraph hands every task of the
resume the same map) for rejections of its siblings' pauses and records those first; the rejected request's own task
then finds it decided (``ApprovalAlreadyDecided``: nothing twice). Which pause an entry answers is read where LangGraph
itself keeps it: with the interrupts saved in the checkpoint being resumed, whose ids are the map's keys and whose
values carry UndoLog's approval request ids. UndoLog stores nothing more for this, and the ids are LangGraph's own,
not recomputed. Imports LangGraph (its config keys) and ``_payload``; the guard that calls it is handed in (a
``Recorder``), so this module does not import ``_guard``.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Protocol

from pydantic import BaseModel, TypeAdapter, ValidationError

from undolog_core import UndoLog, errors
from undolog_core.integration import AwaitingApproval

from ._payload import (
    RESPONSE_SCHEMA,
    ApprovalDecision,
    ApprovalDecisions,
    RejectDecision,
    _ours_of,
    asking,
    done_asking,
    requests_of,
)

log = logging.getLogger("undolog.approvals")

try:
    from langgraph._internal import _constants as _lg
except ImportError:  # pragma: no cover - the module moved: its values, as of langgraph 1.2, below
    _lg = None  # type: ignore[assignment]
# LangGraph's own config keys and channel names (private: pinned by tests/adapters/test_langgraph_siblings.py, which
# fails if any of them stops finding a sibling's pause).
CONFIG_KEY_RESUME_MAP: str = getattr(_lg, "CONFIG_KEY_RESUME_MAP", "__pregel_resume_map")
CONFIG_KEY_CHECKPOINTER: str = getattr(_lg, "CONFIG_KEY_CHECKPOINTER", "__pregel_checkpointer")
CONFIG_KEY_CHECKPOINT_MAP: str = getattr(_lg, "CONFIG_KEY_CHECKPOINT_MAP", "checkpoint_map")
CONFIG_KEY_CHECKPOINT_NS: str = getattr(_lg, "CONFIG_KEY_CHECKPOINT_NS", "checkpoint_ns")
INTERRUPT: str = getattr(_lg, "INTERRUPT", "__interrupt__")
NS_SEP: str = getattr(_lg, "NS_SEP", "|")
PUSH: str = getattr(_lg, "PUSH", "__pregel_push")  # the trigger of a task started by a Send (one per call)
CONFIG_KEY_SCRATCHPAD: str = getattr(_lg, "CONFIG_KEY_SCRATCHPAD", "__pregel_scratchpad")
CONFIG_KEY_SEND: str = getattr(_lg, "CONFIG_KEY_SEND", "__pregel_send")
RESUME: str = getattr(_lg, "RESUME", "__resume__")
_COUNT = re.compile(r"count\((\d+)\)")  # the repr of the itertools.count behind LangGraph's interrupt counter


class Recorder(Protocol):
    """What this module uses of the guard (``_guard._Guard``), which imports this module."""

    @property
    def u(self) -> UndoLog: ...

    def approver_for(self, config: Mapping[str, Any]) -> str | None: ...

    def apply(self, value: Any, pending: Sequence[AwaitingApproval], *, only_rejects: bool = False) -> str | None: ...


def siblings_rejected(guard: Recorder, config: Mapping[str, Any], value: Any, pending: Sequence[AwaitingApproval],
                      session_id: str) -> None:
    """Record the rejections the current resume gives to other UndoLog pauses of ``session_id``, before ``value``
    (this task's own, validated answer for ``pending``) is recorded.

    Costs nothing unless the resume answers several pauses and one of the other answers may be a rejection; then one
    read of the checkpoint's saved interrupts. A failure to read them is logged and leaves the old behaviour (each task
    records its own answer only); it never fails the run.
    """
    conf = config.get("configurable") or {}
    resume_map = conf.get(CONFIG_KEY_RESUME_MAP)
    if not isinstance(resume_map, Mapping) or len(resume_map) < 2 or not pending or _only_rejects(value):
        return  # one answer, or this task's own rejection halts the session anyway
    maybe = [iid for iid, answer in resume_map.items() if _may_reject(answer)]
    if not maybe:
        return
    try:
        saved = _saved_interrupts(conf)
    except Exception as exc:  # noqa: BLE001 - a checkpointer we cannot read: each task records its own answer
        log.warning("could not read the checkpoint's interrupts to apply a sibling's rejection first (session %s): "
                    "%s: %s", session_id, type(exc).__name__, exc)
        return
    own = {a.approval_request_id for a in pending}
    for iid in maybe:
        interrupt_value = saved.get(iid)
        reqs = requests_of(interrupt_value)
        if not reqs or _ours_of(interrupt_value).get("session_id") != session_id:
            continue  # not an UndoLog pause of this session (another graph's, or the thread's next session)
        ids = [str(r.get("approval_request_id")) for r in reqs]
        if own & set(ids):
            continue  # this task's own pause
        answer = _validated(guard, config, resume_map[iid], [str(r.get("tool")) for r in reqs])
        if answer is None or not _any_reject(answer):
            continue  # malformed (its own task refuses it, and nothing of it is recorded), or no rejection in it
        siblings = [_awaiting(guard, rid) for rid in ids]
        if any(s is None for s in siblings):
            continue
        log.info("a sibling's rejection (interrupt %s) is recorded before requests %s of session %s are answered",
                 iid, ", ".join(sorted(own)), session_id)
        guard.apply(answer, [s for s in siblings if s is not None], only_rejects=True)


def _decisions(value: Any) -> list[Any]:
    decisions = value.decisions if isinstance(value, ApprovalDecisions) else [value]
    return list(decisions.values()) if isinstance(decisions, Mapping) else list(decisions)


def _is_reject(decision: Any) -> bool:
    return isinstance(decision, RejectDecision) or (isinstance(decision, ApprovalDecision)
                                                    and decision.decision == "reject")


def _only_rejects(value: Any) -> bool:
    return all(_is_reject(d) for d in _decisions(value))


def _any_reject(value: Any) -> bool:
    return any(_is_reject(d) for d in _decisions(value))


def _may_reject(answer: Any) -> bool:
    """Whether a raw resume value may hold a rejection (cheap: no validation, no store)."""
    if isinstance(answer, BaseModel):
        answer = answer.model_dump()
    if not isinstance(answer, Mapping):
        return False
    if "decisions" in answer:
        inner = answer["decisions"]
        items = inner.values() if isinstance(inner, Mapping) else inner if isinstance(inner, list) else []
        return any(_may_reject(d) for d in items)
    return answer.get("type") == "reject" or answer.get("decision") == "reject"


def _saved_interrupts(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``{interrupt id: value}`` of the interrupts saved with the checkpoint this task resumes."""
    saver = conf.get(CONFIG_KEY_CHECKPOINTER)
    if saver is None:
        return {}
    ns = str(conf.get(CONFIG_KEY_CHECKPOINT_NS) or "")
    # The task's namespace is "<graph's namespace>|<node>:<task id>" (or "<node>:<task id>" in the root graph).
    graph_ns = ns.rsplit(NS_SEP, 1)[0] if NS_SEP in ns else ""
    checkpoint_id = (conf.get(CONFIG_KEY_CHECKPOINT_MAP) or {}).get(graph_ns)
    if checkpoint_id is None:
        return {}
    found = saver.get_tuple({"configurable": {"thread_id": conf.get("thread_id"), "checkpoint_ns": graph_ns,
                                              "checkpoint_id": checkpoint_id}})
    out: dict[str, Any] = {}
    for write in (found.pending_writes or []) if found is not None else []:
        if write[1] != INTERRUPT:
            continue
        for i in write[2] if isinstance(write[2], list | tuple) else [write[2]]:
            iid = i.get("id") if isinstance(i, Mapping) else getattr(i, "id", None)
            if iid is not None:
                out[str(iid)] = i.get("value") if isinstance(i, Mapping) else getattr(i, "value", None)
    return out


def _awaiting(guard: Recorder, approval_request_id: str) -> AwaitingApproval | None:
    try:
        rec = guard.u.approvals.get(approval_request_id)
    except errors.UndoLogError:
        return None
    return AwaitingApproval(effect_id=rec.effect_id, approval_request_id=rec.approval_request_id, retry_after=0.0,
                            tool_name=rec.tool_name, args=dict(rec.proposed_args), reason=rec.reason,
                            risk_tags=tuple(rec.risk_tags), timeout_at=rec.timeout_at, call_id=rec.call_id)


@cache
def _adapter(several: bool) -> TypeAdapter[Any]:
    return TypeAdapter(ApprovalDecisions if several else RESPONSE_SCHEMA)


def _validated(guard: Recorder, config: Mapping[str, Any], answer: Any, names: Sequence[str]) -> Any:
    """The sibling's answer checked as its own pause checks it: the approver of a LangChain decision is found the same
    way (LangGraph's auth, else the adapter's ``approver``), an edit is pinned to its tool. None when it does not fit."""
    token = asking(names, lambda: guard.approver_for(config))
    try:
        return _adapter(len(names) > 1).validate_python(answer)
    except ValidationError:
        return None
    finally:
        done_asking(token)


def next_interrupt_index(config: Mapping[str, Any]) -> int | None:
    """The index LangGraph gives the task's next ``interrupt()`` (how many it has asked in this run), or None when
    the scratchpad is not the one UndoLog knows. Read without moving the counter (``itertools.count``'s repr)."""
    pad = (config.get("configurable") or {}).get(CONFIG_KEY_SCRATCHPAD)
    counter: Any = getattr(pad, "interrupt_counter", None)
    if counter is None or not hasattr(counter, "_counter"):
        return None
    nxt = counter._counter
    if nxt is None:
        return 0  # not asked yet in this run
    found = _COUNT.fullmatch(repr(getattr(nxt, "__self__", None)))
    return int(found.group(1)) if found else None


def forget_answers(config: Mapping[str, Any], start: int | None, asked: int) -> None:
    """Drop the ``asked`` resume values from index ``start`` on: the answers to UndoLog's pauses of this task, all
    decided now.

    LangGraph hands a task's resume values to its ``interrupt()`` calls by order. UndoLog pauses before the call's
    tool runs, and once the call is decided it does not pause again on the next re-run: its answers, still in the
    task's list, would be handed to whatever asks next (the tool's own ``interrupt()``: an ask-the-customer tool
    would read UndoLog's ``{"type": "approve"}`` as the customer's answer). Called where UndoLog's pauses are over and
    before the tool runs; the task's next ``interrupt()`` gets index ``start`` again, and the shortened list is what
    LangGraph saves for the task. Interrupts asked before UndoLog's (a middleware outside it) keep theirs.
    """
    if asked <= 0 or start is None:
        return
    conf = config.get("configurable") or {}
    pad, send = conf.get(CONFIG_KEY_SCRATCHPAD), conf.get(CONFIG_KEY_SEND)
    resume = getattr(pad, "resume", None)
    counter: Any = getattr(pad, "interrupt_counter", None)
    if (not isinstance(resume, list) or len(resume) < start + asked or not callable(send)
            or not hasattr(counter, "_counter") or next_interrupt_index(config) != start + asked):
        log.warning("could not drop UndoLog's %d answer(s) from the task's resume values (LangGraph's scratchpad is "
                    "not the one UndoLog knows): a tool's own interrupt() in this task may be handed one of them",
                    asked)
        return
    del resume[start:start + asked]
    counter._counter = itertools.count(start).__next__
    send([(RESUME, list(resume))])
