"""The gate: the IRREVERSIBLE path. A call that needs a person's decision raises an approval request (with the
agent's recent calls as its context), a re-issue resumes it (still waiting, approved and claimed to run, released
and claimed again, rejected, timed out, cancelled or answered), an approval that lapsed asks again. The engine
(``_engine.Engine``) holds one (``engine.gate``) and binds ``intercept_irreversible`` under its own name."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, Protocol

from ._compensable import CompensablePath
from ._decisions import (
    IRREVERSIBLE,
    KICKOFF,
    AwaitingApproval,
    Completed,
    Decision,
    Execute,
)
from ._faults import FaultPoint, fault
from ._json import canonical_json, sha256_hex
from ._leases import Leases
from ._observe import engine_log, ids
from ._session_record import SessionCache
from ._sessions_table import SessionTable
from ._tools import ToolSpec
from .errors import (
    ApprovalCancelled,
    ApprovalRejected,
    ApprovalTimedOut,
    CallIdConflict,
    InvalidEffectState,
)
from .limits import safe_result
from .storage.base import new_id, utcnow
from .storage.pool import IntegrityConflict
from .storage.schema import EffectState, RequestState, SessionState

if TYPE_CHECKING:
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


class Gate:
    """The IRREVERSIBLE calls' gate: an approval request, its resumes and the claim of an approved call to run.

    Its collaborators are explicit: the storage, the session table (its public methods: the session's record, its
    guard inside a write, its counts given back), the policy (approval timeouts, the context's length), the
    approvals (timeouts and lapses applied on read), the leases and the COMPENSABLE path (a re-issue's answer,
    shared by both tiers).

    Example:
        >>> gate = undolog.engine.gate                                                       # doctest: +SKIP
        >>> d = gate.intercept_irreversible("thread-1", spec, {"user_id": "u1"}, "c-7")     # doctest: +SKIP
        >>> isinstance(d, AwaitingApproval)                                                 # doctest: +SKIP
        True
    """

    def __init__(self, store: Storage, table: SessionTable, policy: PolicyReader, approvals: ApprovalExpirer,
                 leases: Leases, calls: CompensablePath) -> None:
        self.store = store
        self.table = table
        self._policy = policy
        self._approvals = approvals
        self.leases = leases
        self.lease_seconds = leases.lease_seconds
        self._inflight = leases.inflight
        self.calls = calls

    # -- IRREVERSIBLE ------------------------------------------------------------------------------

    def intercept_irreversible(
        self, session_id: str, spec: ToolSpec, args_json: Any, call_id: str | None, *, match_digest: bool = False
    ) -> Decision:
        fault(FaultPoint.BEFORE_GATE, session_id, spec.name)
        sc = self.table.written_record(session_id)
        pin = spec if sc.check_pin(spec) else None
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
            return self.calls.reclaim(sc, row, spec)
        if state == EffectState.REJECTED:
            raise ApprovalRejected(row.approval_request_id, row.decision_reason, row.decided_by)
        if state == EffectState.TIMED_OUT:
            raise ApprovalTimedOut(row.approval_request_id)
        if state == EffectState.CANCELLED:
            if row.req_state == RequestState.RESPONDED:
                # A person answered in the tool's place: their answer is the result, the tool never runs.
                return Completed(row.effect_id, row.result_snapshot, row.tool_name)
            raise ApprovalCancelled(row.approval_request_id, row.decision_reason)
        return self.calls.replay(row)

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
                self.table.guard(conn, sc, count, pin=None)
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
            self.table.give_back(sc, count - 1)
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
                self.table.guard(conn, sc, count, pin=pin)
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
            self.table.give_back(sc, count - 1)
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
            self.table.give_back(sc, count - 1)
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

