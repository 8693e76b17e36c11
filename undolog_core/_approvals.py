"""Human approvals: decisions are recorded here; the tool runs when the caller re-issues the call."""

from __future__ import annotations

import builtins
import datetime as dt
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import _observe as obs
from ._json import canonical_json, sha256_hex
from ._validation import build_args_model, check_json_schema
from .errors import (
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    ArgumentsInvalid,
    SelfDecisionForbidden,
    UndoLogError,
)
from .limits import check_identity, clean_text, encodes, input_problem
from .storage.approvals import EXPIRE_BATCH, KEPT
from .storage.base import utcnow
from .storage.records import (
    ApprovalEvent,
    ApprovalRecord,
    ExpiredRequest,
    RequestState,
    SessionState,
    StateChange,
)
from .storage.schema import DecisionKind

if TYPE_CHECKING:
    from ._registry import Registry
    from .storage import Storage


class ApprovalService:
    """Decide approval requests from code, the CLI or the server.

    Example:
        >>> for req in undolog.approvals.pending():
        ...     undolog.approvals.approve(req.approval_request_id, approver="ana")
    """

    def __init__(
        self, storage: Storage, registry: Registry, *, note_state: Callable[[str, str], None]
    ) -> None:
        """``registry``: the tools loaded in this process (to validate edits); ``note_state(session_id, state)``:
        keeps the in-memory session caches in step with the session states a decision writes."""
        self._storage = storage
        self._registry = registry
        self._note_state = note_state

    def _changed(self, changes: Iterable[StateChange], why: str = "") -> None:
        for change in changes:
            self._note_state(change.session_id, change.state.value)
            if change.state is SessionState.HALTED:
                obs.approvals_log.warning("halt: session %s halted: %s", change.session_id, why,
                                          extra=obs.ids(change.session_id))

    # -- reading -------------------------------------------------------------------------------------

    def pending(
        self,
        session_id: str | None = None,
        *,
        tool_name: str | None = None,
        risk_tag: str | None = None,
    ) -> builtins.list[ApprovalRecord]:
        """Pending requests, newest first. Requests past their timeout are expired first."""
        self.expire_due()
        return self.list(state="pending", session_id=session_id, tool_name=tool_name, risk_tag=risk_tag)

    def list(
        self,
        *,
        state: str | None = None,
        session_id: str | None = None,
        tool_name: str | None = None,
        risk_tag: str | None = None,
        limit: int = 500,
        offset: int = 0,
        brief: bool = False,
    ) -> builtins.list[ApprovalRecord]:
        """Requests newest first, without expiring any (a read only; :meth:`pending` expires first).

        ``offset`` skips that many of the matching requests (paging). The risk tag filter runs in Python
        (the tags are a JSON list, queried differently by the two databases), after the page is read.
        ``brief=True`` reads the arguments and the agent context as previews (``{"undolog_truncated": ...}`` when
        longer than ``limits.PREVIEW_CHARS``), for listings that poll.

        Example:
            >>> undolog.approvals.list(state="pending", tool_name="delete_user_account", limit=50, offset=50)
        """
        wanted: RequestState | None = None
        if state:
            known = [s.value for s in RequestState]
            if state not in known:
                raise UndoLogError(f"unknown approval state {state!r}; known: {', '.join(known)}")
            wanted = RequestState(state)
        rows = self._storage.approvals.list_requests(state=wanted, session_id=session_id, tool_name=tool_name, limit=limit,
                                           offset=offset, brief=brief)
        if risk_tag:
            rows = [x for x in rows if risk_tag in x.risk_tags]
        return rows

    def get(self, approval_request_id: str) -> ApprovalRecord:
        """One request; a pending request past its timeout is expired on read, and so is an approval whose call was
        not re-issued within the policy's ``approved_ttl_seconds``."""
        rec = self._get(approval_request_id)
        if rec.state is RequestState.PENDING and rec.timeout_at <= utcnow():
            self.expire([approval_request_id])
            rec = self._get(approval_request_id)
        elif rec.state in (RequestState.APPROVED, RequestState.AUTO_APPROVED) and self._storage.approvals.approval_lapsed(
            rec.decided_at, utcnow()
        ):
            self.lapse([approval_request_id])
            rec = self._get(approval_request_id)
        return rec

    def _get(self, approval_request_id: str) -> ApprovalRecord:
        rec = self._storage.approvals.get_request(approval_request_id)
        if rec is None:
            raise ApprovalNotFound(approval_request_id)
        return rec

    def join(self, approval_request_id: str, session_id: str, *, actor: str) -> None:
        """Record (audited) that ``session_id`` asked the same call as the pending request, and waits on it rather
        than raising a request of its own: a reject halts it together with the request's own session.

        Example:
            >>> undolog.approvals.join(rec.approval_request_id, later_session_id, actor="key:4f2a")
        """
        check_identity("actor", actor)
        self._storage.approvals.note_request_event(approval_request_id, action="joined", actor=actor, session_id=session_id,
                                         now=utcnow())

    def note_released(self, approval_request_id: str, session_id: str, *, actor: str) -> None:
        """Record (audited) that the approved request ran for ``session_id``, another session than its own; the
        run itself is recorded on the request's effect.

        Example:
            >>> undolog.approvals.note_released(rec.approval_request_id, later_session_id, actor="key:4f2a")
        """
        check_identity("actor", actor)
        self._storage.approvals.note_request_event(approval_request_id, action="released", actor=actor,
                                         session_id=session_id, now=utcnow())

    def keep_message(self, approval_request_id: str, session_id: str, key: str, message: Mapping[str, Any]) -> None:
        """Keep (audited) the model message the request's call came from, under ``key``, for :meth:`kept_message`.

        An adapter that asks a person inside the model call (LangGraph's batched gate) keeps the message before it
        pauses: the framework re-runs that model call from its start on resume, and the kept message answers it, so
        the model is not called a second time. ``message`` is JSON; ``key`` names the paused run (LangGraph: the
        model task's checkpoint namespace).

        Example:
            >>> undolog.approvals.keep_message(rec.approval_request_id, sid, "model:1f0c", {"messages": [...]})
        """
        self._storage.approvals.note_request_event(approval_request_id, action=KEPT, actor=f"agent:{session_id}",
                                                   session_id=session_id, now=utcnow(),
                                                   extra={"key": key, "message": dict(message)})

    def kept_message(self, session_id: str, key: str, *, within: int = 20) -> dict[str, Any] | None:
        """The message :meth:`keep_message` kept under ``key`` on one of the session's newest ``within`` requests.

        Example:
            >>> undolog.approvals.kept_message(sid, "model:1f0c")
            {'messages': [...]}
        """
        for rec in self.list(session_id=session_id, limit=within, brief=True):
            for ev in self._storage.approvals.request_events(rec.approval_request_id):
                if ev.action == KEPT and ev.payload.get("key") == key:
                    kept = ev.payload.get("message")
                    return kept if isinstance(kept, dict) else None
        return None

    def find_for_call(self, session_id: str, tool_name: str, args: Mapping[str, Any]) -> ApprovalRecord | None:
        """The newest request of this session for the same (tool, canonical arguments), in any state.

        Matches the proposed arguments or the approved (modified) ones; a rejected or timed-out request is
        returned too, so an adapter can tell the agent the truth again.
        """
        spec = self._registry.tools.get(tool_name)
        values = spec.snapshot(spec.validate(args)) if spec else dict(args)
        problem = input_problem(values)  # no request was raised for such arguments: say why, not a digest error
        if problem is not None:
            raise ArgumentsInvalid(tool_name, [problem])
        digest = sha256_hex(canonical_json(values))
        for rec in self.list(session_id=session_id, tool_name=tool_name, limit=200):
            if sha256_hex(canonical_json(rec.proposed_args)) == digest:
                return self.get(rec.approval_request_id)
            if rec.approved_args is not None and sha256_hex(canonical_json(rec.approved_args)) == digest:
                return self.get(rec.approval_request_id)
        return None

    def events(self, approval_request_id: str) -> builtins.list[ApprovalEvent]:
        """The request's audit events, oldest first."""
        self._get(approval_request_id)
        return self._storage.approvals.request_events(approval_request_id)

    # -- deciding ------------------------------------------------------------------------------------

    def approve(self, approval_request_id: str, *, approver: str, reason: str | None = None,
                principal: str | None = None) -> ApprovalRecord:
        """Approve as proposed. The tool runs when the agent re-issues the same call.

        ``principal``: the decider's principal reference (the desk's ``key:<id>``); a decider that is the principal
        which created the request's session is refused (:class:`SelfDecisionForbidden`, audited). Without it,
        ``approver`` itself is compared.
        """
        return self._decide(approval_request_id, approver, "approve", reason=reason, principal=principal)

    def modify(
        self, approval_request_id: str, *, approver: str, args: Mapping[str, Any], reason: str | None = None,
        principal: str | None = None,
    ) -> ApprovalRecord:
        """Approve with edited arguments, validated against the tool's schema (a bad edit names the field)."""
        if not isinstance(args, Mapping):
            raise ArgumentsInvalid("<unknown>", [{"loc": [], "msg": "edited arguments must be a JSON object"}])
        self.refuse_own(approval_request_id, approver, "modify", principal)
        problem = input_problem(args)  # too deep, not valid Unicode, NaN or infinite: refused, still pending
        if problem is not None:
            raise ArgumentsInvalid(self._tool_of(approval_request_id), [problem])
        return self._decide(approval_request_id, approver, "modify", reason=reason, args=dict(args),
                            principal=principal)

    def _tool_of(self, approval_request_id: str) -> str:
        return self._get(approval_request_id).tool_name

    def reject(self, approval_request_id: str, *, approver: str, reason: str,
               principal: str | None = None) -> ApprovalRecord:
        """Reject: the call never runs, the session halts and its other pending requests are cancelled."""
        return self._decide(approval_request_id, approver, "reject", reason=reason, principal=principal)

    def refuse_own(self, approval_request_id: str, approver: str, action: str, principal: str | None) -> None:
        """Refuse (and audit) a decision by the principal that created the request's session.

        Raises:
            SelfDecisionForbidden: ``principal`` (else ``approver``) created the session; an audit event
                ``refused`` was appended first.

        Example:
            >>> undolog.approvals.refuse_own(rid, "bot (key ab12)", "approve", "key:ab12")
            Traceback (most recent call last):
            SelfDecisionForbidden: key:ab12 created the session that raised approval request ...

        Checked here, under every door (desk, REST API, CLI, code), so that no caller can forget it: a key holding
        the agent and approver roles raised the request and may still not decide it.
        """
        rec = self._get(approval_request_id)
        session = self._storage.sessions.get_session(rec.session_id)
        owner = session.created_by if session is not None else None
        # Only principal references (``key:<id>``, the desk's form) are compared: free-text actor names are a
        # person's say-so, not an identity the store can hold anyone to.
        who = principal or approver
        if not owner or not owner.startswith("key:") or who != owner:
            return
        self._storage.audit.append_event(
            subject=f"approval:{approval_request_id}", approval_request_id=approval_request_id,
            action="refused", actor=approver,
            payload={"attempted": action, "principal": who, "why": SelfDecisionForbidden.code},
        )
        obs.approvals_log.warning("refused: %s by %s on approval request %s: it created the session", action,
                                  approver, approval_request_id, extra=obs.ids(rec.session_id))
        raise SelfDecisionForbidden(approval_request_id, who)

    def respond(
        self, approval_request_id: str, *, approver: str, response: str, reason: str | None = None
    ) -> ApprovalRecord:
        """Answer in the tool's place (LangChain's ``respond``): the tool never runs, ``response`` is its result.

        The request becomes ``responded`` (audit event ``respond``, with the response); the session goes on, as
        after an approval. The re-issued call (same ``call_id``) returns ``response`` as the tool's result, without
        running the tool: for "ask a person" tools, or to tell the agent what to do instead.

        Example:
            >>> undolog.approvals.respond(rid, approver="ana", response="Use the archive instead; nothing deleted.")
        """
        if not isinstance(response, str) or not response.strip():
            raise UndoLogError("a respond decision needs the response text (it stands in for the tool's result)")
        if not encodes(response):  # refused like any input: it would be stored, hashed and served as the result
            raise UndoLogError("the response contains a lone surrogate (\\ud800-\\udfff), which is not valid "
                               "Unicode; nothing was decided")
        return self._decide(approval_request_id, approver, DecisionKind.RESPOND, reason=reason, response=response)

    def _validate_edit(self, rec: ApprovalRecord, args: dict[str, Any]) -> dict[str, Any]:
        spec = self._registry.tools.get(rec.tool_name)
        if spec is not None and spec.revision == rec.tool_revision:
            validated: dict[str, Any] = spec.snapshot(spec.validate(args))
            return validated
        # This process (a CLI, a server) does not have the tool loaded: validate against the stored contract.
        stored = self._storage.registry.arguments_jsonschema_of(rec.tool_name, rec.tool_revision)
        if stored is None:
            raise UndoLogError(f"the contract of {rec.tool_name!r} revision {rec.tool_revision} is not in the registry")
        model = build_args_model(rec.tool_name, None, stored)
        try:
            edited = dict(model.model_validate(args).model_dump(mode="json", exclude_unset=True))
            # Then the full JSON Schema (enum, bounds, patterns, nested objects...), on the values to be stored.
            check_json_schema(rec.tool_name, stored, edited)
            return edited
        except Exception as exc:
            import pydantic

            if isinstance(exc, pydantic.ValidationError):
                raise ArgumentsInvalid(
                    rec.tool_name, [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
                ) from None
            raise

    def _decide(
        self,
        approval_request_id: str,
        approver: str,
        action: str,
        *,
        reason: str | None = None,
        args: dict[str, Any] | None = None,
        response: str | None = None,
        principal: str | None = None,
    ) -> ApprovalRecord:
        if not approver or not str(approver).strip():
            raise UndoLogError("a decision needs the approver's identity (approver=...)")
        check_identity("approver", approver)  # the one length rule: the same refusal on both databases
        if action != "respond":
            self.refuse_own(approval_request_id, approver, action, principal)
        if action == "reject" and not (reason and reason.strip()):
            raise UndoLogError("a rejection needs a reason")
        if reason is not None:
            reason = clean_text(reason)
        # Expire first, so a decision that arrives after the deadline is refused, not silently applied.
        rec = self.get(approval_request_id)
        if rec.state is not RequestState.PENDING:
            raise ApprovalAlreadyDecided(approval_request_id, rec.state)
        # A request's tool and revision never change, so the edit is validated before the decision's transaction;
        # the storage re-checks that the request is still pending under its lock (a racing decision loses there).
        approved = self._validate_edit(rec, args or {}) if action == "modify" else None
        changes = self._storage.approvals.decide_request(
            approval_request_id, action=action, approver=approver, reason=reason, approved_args=approved,
            response=response, now=utcnow(),
        )
        done = self._get(approval_request_id)
        self._logged(done, action)
        self._changed(changes, f"approval request {approval_request_id} ({rec.tool_name}) was rejected by {approver}: "
                               f"{reason}")
        return done

    @staticmethod
    def _logged(rec: ApprovalRecord | ExpiredRequest, decision: str) -> None:
        """A decision's log record and metrics: who decided what, and how long the call waited."""
        level = logging.WARNING if decision in ("reject", "timeout") else logging.INFO
        if obs.approvals_log.isEnabledFor(level):
            obs.approvals_log.log(
                level, "decision: %s on approval request %s for %s by %s (session %s, effect %s)%s", decision,
                rec.approval_request_id, rec.tool_name, rec.decided_by, rec.session_id, rec.effect_id,
                f": {rec.decision_reason}" if rec.decision_reason else "",
                extra=obs.ids(rec.session_id, rec.effect_id, rec.approval_request_id))
        obs.count_decision(decision, rec.tool_name, rec.created_at, rec.decided_at)

    def _settled(self, got: builtins.list[ExpiredRequest], changes: builtins.list[StateChange]) -> None:
        """A sweep batch's logs, metrics and cache updates (from what the batch returned: nothing is read back)."""
        why: dict[str, str] = {}
        for rec in got:
            self._logged(rec, "auto_approve" if rec.state is RequestState.AUTO_APPROVED else "timeout")
            why.setdefault(rec.session_id, f"approval request {rec.approval_request_id} ({rec.tool_name}) timed "
                                           "out without a decision")
        for change in changes:
            self._changed([change], why.get(change.session_id, ""))

    def cancel(self, conn: Any, request_id: str, effect_id: str, why: str, now: dt.datetime) -> None:
        """Cancel a request (and its effect if it has not run) inside the caller's transaction (the engine's and
        the saga's); ``store.approvals.cancel_request_in``."""
        self._storage.approvals.cancel_request_in(conn, request_id, effect_id, why, now)

    # -- timeouts ------------------------------------------------------------------------------------

    def expire_due(self, now: dt.datetime | None = None) -> builtins.list[str]:
        """Apply the timeout to every pending request past ``timeout_at``; returns the ids timed out or
        auto-approved here.

        Due requests are claimed in batches of ``storage.EXPIRE_BATCH`` (one transaction, one audit-chain lock
        each). Several processes may call it at once: on PostgreSQL each batch is claimed with SKIP LOCKED and
        each state change is conditional, so each timeout is applied exactly once; at most ``SWEEP_SLOTS``
        (storage) processes sweep at once, and one that finds every slot held returns having read nothing of the
        requests, so more sweepers add no work to the ones sweeping. A request cancelled because another request of its session timed out is not in the result.

        Example:
            >>> undolog.approvals.expire_due()
            ['3f2c9d...', ...]
        """
        now = now or utcnow()
        done: builtins.list[str] = []
        while True:
            got, changes = self._storage.approvals.expire_batch(now)
            if not got:
                return done
            self._settled(got, changes)
            done.extend(x.approval_request_id for x in got)

    def expire(self, ids: Iterable[str], *, now: dt.datetime | None = None) -> builtins.list[str]:
        """Apply the timeout (per the org policy) to each of ``ids`` that is due; returns the ones expired here."""
        now = now or utcnow()
        wanted = list(ids)
        done: builtins.list[str] = []
        for i in range(0, len(wanted), EXPIRE_BATCH):
            got, changes = self._storage.approvals.expire_batch(now, only=wanted[i:i + EXPIRE_BATCH])
            self._settled(got, changes)
            done.extend(x.approval_request_id for x in got)
        return done

    # -- approved calls never re-issued ----------------------------------------------------------------

    def lapse_due(self, now: dt.datetime | None = None) -> builtins.list[str]:
        """Expire every approval whose call was not re-issued within the policy's ``approved_ttl_seconds`` (default
        24 h), in batches of ``storage.EXPIRE_BATCH`` like :meth:`expire_due`; returns their ids. Each becomes ``expired`` (request and effect), audited as ``expire`` by
        ``undolog:approval-ttl``; its session is not halted, and re-issuing the call raises a new request.

        The sweeper of ``undolog serve`` runs it; reads (:meth:`get`) and re-issues apply it too, like timeouts.

        Example:
            >>> undolog.policy.set(actor="ops", approved_ttl_seconds=3600)
            >>> undolog.approvals.lapse_due()
            ['3f9c...']
        """
        now = now or utcnow()
        done: builtins.list[str] = []
        while True:
            got, changes = self._storage.approvals.lapse_batch(now)
            if not got:
                return done
            self._changed(changes)
            done.extend(got)

    def lapse(self, ids: Iterable[str], *, now: dt.datetime | None = None) -> builtins.list[str]:
        """Expire each of ``ids`` whose approval has lapsed; returns the ones expired here (once across processes)."""
        now = now or utcnow()
        wanted = list(ids)
        done: builtins.list[str] = []
        for i in range(0, len(wanted), EXPIRE_BATCH):
            got, changes = self._storage.approvals.lapse_batch(now, only=wanted[i:i + EXPIRE_BATCH])
            self._changed(changes)
            done.extend(got)
        return done

    def lapsed(self, decided_at: dt.datetime | None) -> bool:
        """Whether an approval decided at ``decided_at`` has outlived ``approved_ttl_seconds`` (one policy read)."""
        return self._storage.approvals.approval_lapsed(decided_at, utcnow())


__all__ = ["ApprovalEvent", "ApprovalRecord", "ApprovalService"]
