"""The interrupt payload an IRREVERSIBLE call pauses the graph with, and the resume values it accepts.

The payload speaks LangChain's human-in-the-loop vocabulary (``langchain.agents.middleware.human_in_the_loop``), so a
client written for ``HumanInTheLoopMiddleware`` (Agent Chat UI, deep-agents UI...) can be UndoLog's approval UI:

* ``UndoLogMiddleware`` pauses once per call with a ``ToolApprovalRequest`` (``type: "tool_approval"``,
  ``tool_call_id``, ``name``, ``args``, ``description``), answered with one ``Decision`` (``{"type": "approve"}``,
  ``{"type": "edit", "edited_action": {"name", "args"}}``, ``{"type": "reject", "message"?}``,
  ``{"type": "respond", "message"}``);
* ``UndoLogToolNode`` pauses once per model message with an ``HITLRequest`` (``action_requests``,
  ``review_configs``), answered with ``{"decisions": [...]}`` in the order of ``action_requests``.

UndoLog's own fields (approval request id, reason, risk tags, timeout, undo plan...) ride along under the one extra
key ``"undolog"``, and UndoLog's richer resume form (``{"decision": "approve", "approver": "ana"}``) is accepted too.
Every answer is checked here, inside LangGraph's ``interrupt()``, before LangGraph saves it: a malformed one (or a
LangChain decision with no approver to record) fails the resume and can simply be sent again.

Imports pydantic and ``undolog_core`` only (no framework).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
    create_model,
    model_validator,
)

from undolog_core import RequestState
from undolog_core.integration import AwaitingApproval, jsonable

if TYPE_CHECKING:
    from undolog_core import UndoLog

APPROVAL_INTERRUPT_TYPE = "undolog.approval_request"
UNDOLOG_KEY = "undolog"
#: What a person may answer an UndoLog pause with, in LangChain's words (``review_configs.allowed_decisions``).
ALLOWED_DECISIONS = ("approve", "edit", "reject", "respond")
REJECTED_WITHOUT_REASON = "rejected without a reason"

NO_APPROVER = (
    "UndoLog records who decided, and this decision names nobody: run the graph with LangGraph's auth "
    "(config['configurable']['langgraph_auth_user'].identity), or give the adapter an approver "
    "(UndoLogMiddleware(..., approver='ana') or approver=lambda config: ...; the same on UndoLogToolNode), "
    "or answer in UndoLog's form {'decision': 'approve', 'approver': 'ana'}. Nothing was saved; send the answer again."
)


def _compact(schema: dict[str, Any]) -> None:
    # The response schema is published with every interrupt: keep the docstrings out of it.
    schema.pop("description", None)


_CONFIG = ConfigDict(extra="forbid", json_schema_extra=_compact)


@dataclass(frozen=True)
class _Asking:
    """What the pause being answered asks about: the tools, in order, and who answers when the answer does not say."""

    names: tuple[str, ...]
    approver: Callable[[], str | None]


# Set around ``interrupt()`` by the guard, so the answer's validation (inside ``interrupt()``) can pin an edit to
# its tool and find the approver of a LangChain decision. Unset (validation elsewhere): those two checks are skipped.
_ASKING: contextvars.ContextVar[_Asking | None] = contextvars.ContextVar("undolog_lg_asking", default=None)


def _approver_or_refuse() -> str | None:
    asking = _ASKING.get()
    if asking is None:
        return None
    who = asking.approver()
    if not (who and str(who).strip()):
        raise ValueError(NO_APPROVER)
    return str(who)


class ApprovalDecision(BaseModel):
    """UndoLog's own resume value: a decision with its approver, recorded through the approval service (audited).

    ``approve`` / ``modify`` (``args``: the complete edited arguments) / ``reject`` (``reason``) / ``respond``
    (``response``: the text that stands in for the tool's result; the tool does not run); ``from_store`` means "use
    whatever was decided elsewhere" (what ``undolog_resume`` sends for requests still undecided, which pauses the
    graph again). ``approver`` may be left out when the adapter has one (``approver=`` or LangGraph's auth).

    Example:
        >>> Command(resume={"decision": "modify", "args": {"user_id": "u-7"}, "approver": "ana"})  # doctest: +SKIP
    """

    model_config = _CONFIG

    decision: Literal["approve", "reject", "modify", "respond", "from_store"]
    approver: str | None = None
    reason: str | None = None
    args: dict[str, Any] | None = None
    response: str | None = None
    approval_request_id: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ApprovalDecision:
        # Checked here, before LangGraph stores the value, so a bad resume can simply be sent again.
        if self.decision == "reject" and not (self.reason and self.reason.strip()):
            raise ValueError("a rejection needs a 'reason' (the agent is told it)")
        if self.decision == "modify" and self.args is None:
            raise ValueError("'modify' needs 'args': the complete edited arguments")
        if self.decision != "modify" and self.args is not None:
            raise ValueError("'args' goes with decision 'modify' only")
        if self.decision == "respond" and not (self.response and self.response.strip()):
            raise ValueError("'respond' needs 'response': the text the agent gets in place of the tool's result")
        if self.decision != "from_store" and not (self.approver and self.approver.strip()):
            found = _approver_or_refuse()
            if found is None:
                raise ValueError("a decision needs 'approver' (who decided; it goes into the audit trail)")
            self.approver = found
        return self


class _LangChainDecision(BaseModel):
    """A LangChain ``Decision``; its approver comes from the run (``_ASKING``), since the decision names nobody."""

    model_config = _CONFIG
    _approver: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _who(self) -> _LangChainDecision:
        self._approver = _approver_or_refuse()
        return self

    def as_undolog(self, tool: str, approval_request_id: str) -> ApprovalDecision:  # pragma: no cover - abstract
        raise NotImplementedError

    def _dec(self, **kw: Any) -> ApprovalDecision:
        # The approver was found while the answer was validated, inside the pause (outside one, nobody is known).
        return ApprovalDecision.model_validate({"approver": self._approver or "unknown", **kw})


class ApproveDecision(_LangChainDecision):
    type: Literal["approve"]

    def as_undolog(self, tool: str, approval_request_id: str) -> ApprovalDecision:
        return self._dec(decision="approve", approval_request_id=approval_request_id)


class EditedAction(BaseModel):
    model_config = ConfigDict(json_schema_extra=_compact)

    name: str
    args: dict[str, Any]


class EditDecision(_LangChainDecision):
    type: Literal["edit"]
    edited_action: EditedAction

    @model_validator(mode="after")
    def _pinned(self) -> EditDecision:
        asking = _ASKING.get()
        if asking is not None and len(asking.names) == 1:
            _pin(self, asking.names[0])
        return self

    def as_undolog(self, tool: str, approval_request_id: str) -> ApprovalDecision:
        return self._dec(decision="modify", args=self.edited_action.args, approval_request_id=approval_request_id)


class RejectDecision(_LangChainDecision):
    type: Literal["reject"]
    message: str | None = None

    def as_undolog(self, tool: str, approval_request_id: str) -> ApprovalDecision:
        reason = self.message if self.message and self.message.strip() else REJECTED_WITHOUT_REASON
        return self._dec(decision="reject", reason=reason, approval_request_id=approval_request_id)


class RespondDecision(_LangChainDecision):
    type: Literal["respond"]
    message: str

    def as_undolog(self, tool: str, approval_request_id: str) -> ApprovalDecision:
        return self._dec(decision="respond", response=self.message, approval_request_id=approval_request_id)


#: LangChain's ``Decision``: checked only against the branch its ``type`` names (one precise error).
HITLDecision = Annotated[ApproveDecision | EditDecision | RejectDecision | RespondDecision, Discriminator("type")]
_Any = ApprovalDecision | HITLDecision


def _pin(edit: EditDecision, tool: str) -> None:
    if edit.edited_action.name != tool:
        raise ValueError(
            f"an edit cannot switch tools: edited_action.name must be {tool!r}, not {edit.edited_action.name!r} "
            "(reject the call instead)"
        )


class ApprovalDecisions(BaseModel):
    """Decisions for a pause holding several calls (``UndoLogToolNode``: one pause per model message).

    LangChain's ``HITLResponse``: ``{"decisions": [decision, ...]}`` in the order of ``action_requests``; or UndoLog's
    ``{"decisions": {approval_request_id or tool_call_id: decision, ...}}``. Each decision in either LangChain's or
    UndoLog's form. (The map is wrapped in ``decisions`` because LangGraph reads a top-level map of 32-hex-digit
    keys, as approval request ids are, as ``{interrupt_id: value}``.)

    Example:
        >>> Command(resume={"decisions": [{"type": "approve"},
        ...                               {"type": "reject", "message": "wrong user"}]})  # doctest: +SKIP
    """

    model_config = _CONFIG

    decisions: list[_Any] | dict[str, _Any]

    @model_validator(mode="before")
    @classmethod
    def _not_single(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and ("decision" in data or "type" in data):
            asking = _ASKING.get()
            if asking is not None and len(asking.names) == 1:
                raise ValueError("one decision, not {'decisions': [...]}")  # the union's other branches say more
            raise ValueError(
                "this pause holds several calls: resume with {'decisions': [one decision per action_request, "
                "in order]} or {'decisions': {approval_request_id: decision, ...}}"
            )
        return data

    @model_validator(mode="after")
    def _in_order(self) -> ApprovalDecisions:
        asking = _ASKING.get()
        if asking is None or not isinstance(self.decisions, list):
            return self
        if len(self.decisions) != len(asking.names):
            raise ValueError(
                f"{len(self.decisions)} decision(s) for {len(asking.names)} action request(s): send one per "
                "action_request, in order"
            )
        for dec, name in zip(self.decisions, asking.names, strict=True):
            if isinstance(dec, EditDecision):
                _pin(dec, name)
        return self


_FORMS = (
    "answer with a LangChain decision {'type': 'approve'|'edit'|'reject'|'respond', ...}, "
    "{'decisions': [one decision per action_request, in order]}, or UndoLog's {'decision': ..., 'approver': ...}. "
    "Nothing was saved; send the answer again"
)


def _one_error(value: Any, handler: Any) -> Any:
    """Validate an answer against the one form it is written in, and say what is wrong with it in one error.

    The plain union reported every branch's complaint (four or five, the useful one third or fourth): a LangChain
    decision (``type``) is checked against LangChain's forms only, UndoLog's (``decision``) against UndoLog's, a
    ``decisions`` list against that form; the first line after pydantic's header is the problem and the fix.
    """
    try:
        return handler(value)
    except ValidationError as exc:
        if not isinstance(value, Mapping):
            raise ValueError(f"not an answer ({type(value).__name__}): {_FORMS}") from None
        form: Any = (ApprovalDecisions if "decisions" in value else ApprovalDecision if "decision" in value
                     else _HITL_ADAPTER if "type" in value else None)
        if form is None:
            raise ValueError(f"not an answer (keys {sorted(map(str, value))}): {_FORMS}") from None
        try:
            (form if isinstance(form, TypeAdapter) else TypeAdapter(form)).validate_python(value)
        except ValidationError as branch:
            problems = []
            for err in branch.errors():
                where = ".".join(str(p) for p in err["loc"] if not str(p).endswith("Decision"))
                text = str(err["msg"]).removeprefix("Value error, ")
                problems.append(f"{where}: {text}" if where else text)
            raise ValueError("; ".join(dict.fromkeys(problems)) + ". Nothing was saved; send the answer again") \
                from None
        raise exc from None


_HITL_ADAPTER: TypeAdapter[Any] = TypeAdapter(HITLDecision)

#: The ``response_schema`` of every UndoLog pause: LangChain's forms and UndoLog's, one union (a malformed answer gets
#: the one error of the form it is written in, not every branch's).
RESPONSE_SCHEMA = Annotated[ApprovalDecision | HITLDecision | ApprovalDecisions, WrapValidator(_one_error)]


def response_schema_for(tool: str, args_schema: Mapping[str, Any] | None) -> Any:
    """:data:`RESPONSE_SCHEMA` for a pause about one call of ``tool``, its ``edit`` branch publishing the tool's
    argument schema (as LangChain's per-call pause does), so a reviewer's UI can build the edit form.

    The schema is published, not enforced by LangGraph before the answer is saved: the edited arguments are checked
    against the tool's contract when the decision is recorded, and arguments that do not fit keep the request
    pending and pause again, the field and the problem named in the new pause's ``description``.
    """
    if not args_schema:
        return RESPONSE_SCHEMA
    return _response_schema_for(tool, json.dumps(dict(args_schema), sort_keys=True, default=str))


@functools.lru_cache(maxsize=256)
def _response_schema_for(tool: str, args_schema_json: str) -> Any:
    args_schema = json.loads(args_schema_json)
    args_schema.pop("title", None)
    safe = "".join(ch if ch.isalnum() else "_" for ch in tool)[:60] or "tool"
    edited: Any = create_model(
        f"EditedAction_{safe}", __base__=EditedAction,
        args=(Annotated[dict[str, Any], WithJsonSchema(args_schema)], ...),
    )
    edit: Any = create_model(f"EditDecision_{safe}", __base__=EditDecision, edited_action=(edited, ...))
    decision = Annotated[ApproveDecision | edit | RejectDecision | RespondDecision,
                         Discriminator("type")]
    return Annotated[ApprovalDecision | decision | ApprovalDecisions, WrapValidator(_one_error)]


@dataclass(frozen=True)
class _Pause:
    """A call waiting for a person: what ``interrupt()`` asks about."""

    awaiting: AwaitingApproval
    session_id: str


def description(a: AwaitingApproval, error: str | None = None) -> str:
    """The text a reviewer reads (LangChain's ``description``); with ``error``, why the previous answer was not
    applied comes first (a LangChain client shows the description, not UndoLog's own fields)."""
    text = f"Your previous answer was not applied: {error}. " if error else ""
    text += f"UndoLog: {a.tool_name} is irreversible and needs a person's approval"
    if a.reason:
        text += f". {a.reason}"
    if a.risk_tags:
        text += f". Risk: {', '.join(a.risk_tags)}"
    if a.timeout_at is not None:
        text += f". Decide before {_iso(a.timeout_at)} (unanswered, it is refused)"
    return text + "."


def payload(pauses: Sequence[_Pause], error: str | None, *, batched: bool,
            undo_plan: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The interrupt value for ``pauses``: a ``ToolApprovalRequest`` (one call) or an ``HITLRequest`` (``batched``),
    with UndoLog's own fields under ``"undolog"``."""
    reqs = [
        {
            "approval_request_id": p.awaiting.approval_request_id,
            "tool_call_id": p.awaiting.call_id,
            "tool": p.awaiting.tool_name,
            "args": dict(p.awaiting.args),
            "reason": p.awaiting.reason,
            "risk_tags": list(p.awaiting.risk_tags),
            "timeout_at": _iso(p.awaiting.timeout_at),
            "effect_id": p.awaiting.effect_id,
        }
        for p in pauses
    ]
    ours: dict[str, Any] = {
        "type": APPROVAL_INTERRUPT_TYPE,
        "session_id": pauses[0].session_id,
        "requests": reqs,
        "allowed_decisions": list(ALLOWED_DECISIONS),
        "undo_plan": [
            {"tool": s.get("tool_name"), "compensation": s.get("compensation_name"), "effect_id": s.get("effect_id")}
            for s in undo_plan
        ],
        "resume_with": (
            "{'decisions': [one LangChain decision per action_request, in order]}" if batched
            else "a LangChain decision: {'type': 'approve'|'edit'|'reject'|'respond', ...}"
        ) + ", or UndoLog's {'decision': ..., 'approver': ...}; or decide elsewhere and resume with "
            "undolog_resume(graph, config)",
        "error": error,
    }
    if batched:
        return {
            "action_requests": [{"name": r["tool"], "args": r["args"], "description": description(p.awaiting, error)}
                                for r, p in zip(reqs, pauses, strict=True)],
            "review_configs": [{"action_name": r["tool"], "allowed_decisions": list(ALLOWED_DECISIONS)}
                               for r in reqs],
            UNDOLOG_KEY: jsonable({**ours, **reqs[0]}),  # the first request's fields at the top, as for one call
        }
    first = pauses[0].awaiting
    return {
        "type": "tool_approval",
        "tool_call_id": first.call_id,
        "name": first.tool_name,
        "args": dict(first.args),
        "description": description(first, error),
        UNDOLOG_KEY: jsonable({**ours, **reqs[0]}),
    }


def decisions_for(value: Any, pending: Sequence[AwaitingApproval]) -> tuple[list[tuple[AwaitingApproval, ApprovalDecision]],
                                                                          list[str]]:
    """Pair each pending request with its decision, every one in UndoLog's form; and any problem to report."""
    problems: list[str] = []
    if isinstance(value, ApprovalDecisions):
        value = value.decisions
    if isinstance(value, ApprovalDecision | _LangChainDecision):
        value = [value]
    pairs: list[tuple[AwaitingApproval, Any]] = []
    if isinstance(value, list):
        pairs = list(zip(pending, value, strict=False))
    else:
        for a in pending:
            dec = value.get(a.approval_request_id) or (value.get(a.call_id) if a.call_id else None)
            if dec is not None:
                pairs.append((a, dec))
        if not pairs:
            problems.append("no decision matched a pending request; key the map by approval_request_id "
                            "(or tool_call_id), or send a list in the order of action_requests")
    out: list[tuple[AwaitingApproval, ApprovalDecision]] = []
    for a, dec in pairs:
        if isinstance(dec, EditDecision) and dec.edited_action.name != a.tool_name:
            problems.append(f"an edit cannot switch tools: {a.tool_name} stays {a.tool_name}")
            continue
        out.append((a, dec.as_undolog(a.tool_name, a.approval_request_id) if isinstance(dec, _LangChainDecision)
                    else dec))
    return out, problems


def resume_value_for(u: UndoLog, value: Mapping[str, Any]) -> Any:
    """The resume value for one UndoLog interrupt, built from what the store says was decided."""
    out: dict[str, Any] = {}
    for req in _ours_of(value).get("requests") or []:
        rid = req["approval_request_id"]
        rec = u.approvals.get(rid)
        if rec.state == RequestState.APPROVED and rec.decided_by:
            modified = rec.approved_args is not None and rec.approved_args != rec.proposed_args
            dec: dict[str, Any] = {"decision": "modify" if modified else "approve", "approver": rec.decided_by,
                                   "reason": rec.decision_reason, "approval_request_id": rid}
            if modified:
                dec["args"] = rec.approved_args
        elif rec.state == RequestState.REJECTED:
            dec = {"decision": "reject", "approver": rec.decided_by or "unknown",
                   "reason": rec.decision_reason or REJECTED_WITHOUT_REASON, "approval_request_id": rid}
        else:
            # Pending (pauses again), or settled in the store (responded, timed out, cancelled): read at re-run.
            dec = {"decision": "from_store", "approval_request_id": rid}
        out[rid] = dec
    return next(iter(out.values())) if len(out) == 1 else {"decisions": out}


def _ours_of(value: Any) -> Mapping[str, Any]:
    inner = value.get(UNDOLOG_KEY) if isinstance(value, Mapping) else None
    return inner if isinstance(inner, Mapping) else {}


def ours(interrupts: Iterable[Any]) -> list[Any]:
    """The interrupts UndoLog raised (not the graph's own)."""
    return [i for i in interrupts if _ours_of(i.value).get("type") == APPROVAL_INTERRUPT_TYPE]


def requests_of(value: Any) -> list[Mapping[str, Any]]:
    """UndoLog's requests in one of its interrupt values (``value["undolog"]["requests"]``)."""
    return list(_ours_of(value).get("requests") or [])


def asking(names: Sequence[str], approver: Callable[[], str | None]) -> contextvars.Token[_Asking | None]:
    return _ASKING.set(_Asking(tuple(names), approver))


def done_asking(token: contextvars.Token[_Asking | None]) -> None:
    _ASKING.reset(token)


def _iso(value: Any) -> str | None:
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    return None if value is None else str(value)


__all__ = ["APPROVAL_INTERRUPT_TYPE", "ApprovalDecision", "ApprovalDecisions", "HITLDecision"]
