"""The approvals' SQL: requests, their decisions, timeouts and cancellations, each with its audit event."""

from __future__ import annotations

import builtins
import datetime as dt
import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._json import canonical_json, sha256_hex
from ..errors import ApprovalAlreadyDecided, ApprovalNotFound, UndoLogError
from ..limits import PREVIEW_CHARS, TRUNCATED
from ..states import EFFECT, REQUEST, SESSION
from . import schema as t
from .audit import PendingEvent
from .base import Store
from .records import ApprovalEvent, ApprovalRecord, ExpiredRequest, StateChange
from .schema import DecisionKind, EffectState, RequestState, SessionState

if TYPE_CHECKING:
    from .audit import AuditSQL
    from .policy import PolicySQL

#: ``SessionsSQL.halt_in``: the session stops for a person, in the caller's transaction.
HaltIn = Callable[[Connection, str, str, dt.datetime], None]
#: ``SessionsSQL.refresh_changes_in``: the session state changes a request's end made, in the caller's transaction.
RefreshChangesIn = Callable[[Connection, str, dt.datetime], "builtins.list[StateChange]"]
#: ``SessionsSQL.await_approval_in``: a request of the session was raised, it waits for a person.
AwaitApprovalIn = Callable[[Connection, str, dt.datetime], None]

#: How many due requests one sweep transaction claims: large enough that the chain-head lock and the commit are
#: paid once per few hundred timeouts, small enough that a transaction stays short (a few tens of ms).
EXPIRE_BATCH = 250
#: PostgreSQL: at most this many sweep batches (``expire_due``) of one schema run at once, whatever the number of
#: sweeping processes. Each holds a transaction-level advisory lock ``(sweep_slot_key(schema), 0..SWEEP_SLOTS-1)``;
#: a sweeper that finds none free stops (``expire_due`` returns what it did): the holders keep claiming until
#: nothing is left, and a dead holder frees its slot with its connection. Beyond a few concurrent batches the
#: machine only spends more CPU per timeout (more processes share the cores, each claim steps over the rows the
#: other batches hold): on the 2-core machine 8 warm sweepers used 4-11% more CPU than 4 for the same 6,000
#: timeouts without the slots, the same or less with them (paired runs). A sweeper that WAITED for a slot did not
#: help: its waiting statement holds a snapshot, which keeps the rows the others time out from being pruned, and
#: every claim walks them again (the due index is walked oldest first).
#: Two: from two concurrent batches on, CPU per timeout grew 10-20% (each claim steps over the rows the other
#: batches hold and over the entries of rows just timed out), and two sweepers already sweep 8,000-12,000 timeouts/s
#: on the 2-core machine, several times any approval desk's need; a third and fourth batch bought no rate there
#: (2 workers 12,258 and 9,388/s against 4 workers 8,865 and 8,300/s with four slots, same quiet window).
SWEEP_SLOTS = 2
#: A free slot, and (only then) whether anything is due, in one round trip. The slot first: a sweeper that finds
#: every slot held stops having touched nothing but the lock manager, so workers beyond ``SWEEP_SLOTS`` add no work
#: to the sweepers: no walk of the due index over the rows the holders are timing out (and the entries of rows
#: they timed out, not pruned yet), no buffer locks on its pages. Asked the other way round (due first, then a
#: slot), each extra sweeper scanned the due index first (a test counts the scans). With the slot first,
#: ``benchmarks/scale.py --expire-probe`` counts the same database work per timeout at 2, 4 and 8 workers (73.0-73.9
#: blocks, 6,000 due). A sweep with nothing due holds a slot for this one
#: statement and its commit: a sweeper arriving in that instant stops, and what becomes due in it is the next
#: sweep's (a sweep is a periodic pass; the exactly-once guarantee is the claims', not the slots'). The
#: generate_series is walked in order and stops at the first slot locked; the EXISTS is evaluated only when the
#: CASE reaches it.
#:
#: It also turns bitmap scans off for the rest of the sweep's transaction (``set_config(.., true)`` is SET LOCAL):
#: without statistics on the requests (a table never analyzed, or a backlog newer than its statistics) PostgreSQL
#: estimated a handful of pending rows and answered the claim with a bitmap scan of EVERY due row and a sort, each
#: batch re-reading the whole backlog (12.8 ms a claim with 20,000 due against 0.3 ms for the ordered index walk
#: that stops at the batch). Without bitmap scans the due index is walked in order; the sweep's
#: other statements look rows up by key (see ``_still``).
_SLOT_AND_DUE = sa.text(
    "SELECT h.slot, CASE WHEN h.slot IS NOT NULL THEN EXISTS (SELECT 1 FROM undolog_approval_requests "
    f"WHERE {t.DUE_PREDICATE} AND timeout_at <= :now) END AS due, "
    "set_config('enable_bitmapscan', 'off', true) AS ordered_claim "
    "FROM (SELECT (SELECT s FROM generate_series(0, :n - 1) AS s WHERE pg_try_advisory_xact_lock(:key, s) LIMIT 1) "
    "AS slot) AS h"
).bindparams(sa.bindparam("now", type_=t.approval_requests.c.timeout_at.type))
#: What a person may decide, and the audit action each one is recorded as.
DECISIONS = tuple(d.value for d in DecisionKind)
# An effect that has not run (or was handed back without running) is cancelled with its request: the state
# table's ``cancel`` (``states.EFFECT``).


_BLOBS = ("proposed_args", "approved_args", "agent_context")


#: ``state = 'pending'``: the due index's own predicate (``schema.DUE_PREDICATE``), the value in the statement's
#: text: psycopg prepares a statement from its sixth run, and PostgreSQL's generic plan of it, made without the
#: parameters' values, cannot prove a partial index's predicate from a bound state. With one the claim's generic
#: plan read the whole table and sorted it (a test EXPLAINs the generic plan). Unqualified: every statement using it
#: reads the requests table alone.
_DUE = sa.text(t.DUE_PREDICATE)


def _still_in(transition: str) -> Any:
    """:func:`_still` for the sources of a transition of the state table (``states.REQUEST``)."""
    return REQUEST.guard(transition, t.approval_requests.c.state.concat(""))


def _still(state: RequestState) -> Any:
    """``state = <state>`` for rows already found by key (ids, a session): the column compared through an
    expression no index covers, so PostgreSQL looks the rows up by that key. Written as a plain comparison, the
    ``(state, ..)`` indexes competed with the key's: without statistics on the table (never analyzed, or a backlog
    newer than its statistics) PostgreSQL estimated a handful of pending rows and read EVERY pending row to find a
    batch's 250 (74 ms a statement with 20,000 pending against 6 ms by primary key), so each batch of a sweep cost
    more the larger the backlog."""
    return t.approval_requests.c.state.concat("") == state.value


class _Brief:
    """A row read with previews in place of its blobs, shaped like a full row for ``_record``."""

    def __init__(self, row: Any) -> None:
        self.__dict__.update(row._mapping)


def _previewed(row: Any) -> Any:
    out = _Brief(row)
    for name in _BLOBS:
        text = getattr(out, name)
        if text is None:
            continue
        if len(text) > PREVIEW_CHARS:
            marker = {TRUNCATED: {"reason": "preview", "preview": text[:PREVIEW_CHARS]}}
            setattr(out, name, [marker] if name == "agent_context" else marker)
        else:
            setattr(out, name, json.loads(text))
    return out


def _record(row: Any) -> ApprovalRecord:
    return ApprovalRecord(
        approval_request_id=row.approval_request_id,
        effect_id=row.effect_id,
        session_id=row.session_id,
        call_id=row.call_id,
        tool_name=row.tool_name,
        tool_revision=row.tool_revision,
        proposed_args=row.proposed_args,
        approved_args=row.approved_args,
        reason=row.reason,
        risk_tags=list(row.risk_tags or []),
        agent_context=list(row.agent_context or []),
        state=RequestState(row.state),
        timeout_at=row.timeout_at,
        created_at=row.created_at,
        decided_at=row.decided_at,
        decided_by=row.decided_by,
        decision_reason=row.decision_reason,
        action_digest=row.action_digest,
    )


# Audit actions on a request made by sessions other than its own (the MCP gateway's shared approvals over HTTP).
JOINED = "joined"
RELEASED = "released"
# The model message a request's call came from, kept by an adapter that asks inside the model call (LangGraph's
# batched gate): LangGraph re-runs that call from its start on resume, and the kept message answers it instead of a
# second model call. An audit event, so it is as tamper-evident as the decisions taken on it.
KEPT = "model_message"


class ApprovalsSQL:
    """``store.approvals``: the approval requests (``undolog_approval_requests``): reads, decisions, timeouts and
    cancellations (``contract.ApprovalsRepository``). It receives the session-side writes a decision makes in its
    own transaction (halting a session, refreshing a session's state) and the audit trail and policy it reads and
    appends to.

    Example:
        >>> storage.approvals.decide_request(rid, action="approve", approver="ana", reason=None, now=utcnow())
        [StateChange(session_id='...', state=<SessionState.ACTIVE: 'active'>, only_from=...)]
    """

    def __init__(self, store: Store, *, audit: AuditSQL, policy: PolicySQL, halt_in: HaltIn,
                 refresh_changes_in: RefreshChangesIn, await_approval_in: AwaitApprovalIn) -> None:
        self._store = store
        self._audit = audit
        self._policy = policy
        self._halt_in = halt_in
        self._refresh_changes_in = refresh_changes_in
        self._await_approval_in = await_approval_in

    # -- reads ---------------------------------------------------------------------------------------

    def list_requests(
        self,
        *,
        state: RequestState | None = None,
        session_id: str | None = None,
        tool_name: str | None = None,
        limit: int = 500,
        offset: int = 0,
        brief: bool = False,
    ) -> builtins.list[ApprovalRecord]:
        """Requests newest first (ties by id, so pages do not overlap); ``offset`` skips that many.

        ``brief``: the arguments and the agent context are read as previews (at most ``PREVIEW_CHARS`` of their JSON
        text, cut in the database), so a listing never moves a large stored argument.
        """
        r = t.approval_requests
        cols: builtins.list[Any] = list(r.c)
        if brief:
            cols = [c for c in cols if c.name not in _BLOBS]
            for name in _BLOBS:
                text = sa.cast(r.c[name], sa.Text)
                cols.append(sa.func.substr(text, 1, PREVIEW_CHARS + 1).label(name))
        q = sa.select(*cols).order_by(r.c.created_at.desc(), r.c.approval_request_id.desc()).limit(limit).offset(offset)
        if state:
            q = q.where(r.c.state == state)
        if session_id:
            q = q.where(r.c.session_id == session_id)
        if tool_name:
            q = q.where(r.c.tool_name == tool_name)
        with self._store.read() as conn:
            return [_record(_previewed(x) if brief else x) for x in conn.execute(q)]

    def get_request(self, approval_request_id: str) -> ApprovalRecord | None:
        r = t.approval_requests
        with self._store.read() as conn:
            row = conn.execute(sa.select(r).where(r.c.approval_request_id == approval_request_id)).first()
        return None if row is None else _record(row)

    def request_events(self, approval_request_id: str) -> builtins.list[ApprovalEvent]:
        """The request's audit events, oldest first."""
        e = t.approval_events
        with self._store.read() as conn:
            rows = conn.execute(
                sa.select(e).where(e.c.approval_request_id == approval_request_id).order_by(e.c.event_id)
            ).all()
        return [
            ApprovalEvent(int(r.event_id), r.approval_request_id, r.action, r.actor, json.loads(r.payload),
                          r.created_at, r.prev_hash, r.hash)
            for r in rows
        ]

    def joined_sessions_in(self, conn: Connection, approval_request_id: str) -> builtins.list[str]:
        """The sessions that joined the request (its ``joined`` events), in the order they joined."""
        e = t.approval_events
        payloads = conn.execute(
            sa.select(e.c.payload).where(e.c.approval_request_id == approval_request_id, e.c.action == JOINED)
            .order_by(e.c.event_id)
        ).scalars().all()
        out: builtins.list[str] = []
        for text in payloads:
            sid = json.loads(text).get("session_id")
            if isinstance(sid, str) and sid not in out:
                out.append(sid)
        return out

    def note_request_event(self, approval_request_id: str, *, action: str, actor: str, session_id: str,
                           now: dt.datetime, extra: Mapping[str, Any] | None = None) -> int:
        """Audit that another session ``joined`` a pending request (asked the same call), that an approved
        request was ``released`` to one (it ran for that session, recorded on the originating effect), or the
        ``model_message`` its call came from (``extra``: what is kept beside the session id)."""
        if action not in (JOINED, RELEASED, KEPT):
            raise ValueError(f"not a request event: {action!r}")
        with self._store.tx() as conn:
            return self._audit.append_event_in(
                conn, subject=f"approval:{approval_request_id}", approval_request_id=approval_request_id,
                action=action, actor=actor, payload={**(extra or {}), "session_id": session_id}, now=now)

    def due_request_ids(self, now: dt.datetime) -> builtins.list[str]:
        """Pending requests past their ``timeout_at``."""
        r = t.approval_requests
        with self._store.read() as conn:
            return list(conn.execute(
                sa.select(r.c.approval_request_id).where(_DUE, r.c.timeout_at <= now)
            ).scalars().all())

    # -- decisions -----------------------------------------------------------------------------------

    def decide_request(
        self,
        approval_request_id: str,
        *,
        action: str,
        approver: str,
        reason: str | None,
        now: dt.datetime,
        approved_args: Mapping[str, Any] | None = None,
        response: str | None = None,
    ) -> builtins.list[StateChange]:
        """Record a person's decision in one transaction: the request, its effect, the audit event with its
        ``approval.decided`` outbox row and, on a rejection, the session halted with its other pending requests
        cancelled. Returns the session state changes.

        ``action`` is one of ``DECISIONS``; ``modify`` needs ``approved_args`` (already validated); ``respond`` needs
        ``response`` (the person's answer, stored as the call's result: the tool never runs).

        Raises:
            ApprovalNotFound: no such request.
            ApprovalAlreadyDecided: it is no longer pending (another decision or a timeout came first).
        """
        if action not in DECISIONS:
            raise UndoLogError(f"unknown decision {action!r}; known: {', '.join(DECISIONS)}")
        if action == "modify" and approved_args is None:
            raise UndoLogError("a modify decision needs the edited arguments")
        if action == "respond" and response is None:
            raise UndoLogError("a respond decision needs the response (the text that stands in for the result)")
        r, e = t.approval_requests, t.effect_log
        # Urgent: a person waits for this answer; on SQLite it goes ahead of the agents' queued writes.
        with self._store.tx(urgent=True) as conn:
            self._lock_session_of_in(conn, approval_request_id)
            req = conn.execute(
                self._store.for_update(sa.select(r).where(r.c.approval_request_id == approval_request_id))
            ).first()
            if req is None:
                raise ApprovalNotFound(approval_request_id)
            if req.state != RequestState.PENDING:
                raise ApprovalAlreadyDecided(approval_request_id, req.state)
            payload: dict[str, Any] = {"reason": reason}
            # Each statement's guard is the state table's (``states.REQUEST`` / ``states.EFFECT``), by decision.
            moves = {"approve": "approve", "modify": "approve", "respond": "respond", "reject": "reject"}[action]
            pending = (r.c.approval_request_id == approval_request_id, REQUEST.guard(moves, r.c.state))
            if action in ("approve", "modify"):
                approved = req.proposed_args if action == "approve" else dict(approved_args or {})
                if action == "modify":
                    payload["args"] = approved
                    payload["proposed_args"] = req.proposed_args
                conn.execute(
                    r.update().where(*pending).values(
                        state=RequestState.APPROVED, approved_args=approved,
                        approved_digest=sha256_hex(canonical_json(approved)), decided_at=now, decided_by=approver,
                        decision_reason=reason,
                    )
                )
                conn.execute(
                    e.update().where(e.c.effect_id == req.effect_id, EFFECT.guard("approve", e.c.state))
                    .values(state=EffectState.APPROVED, updated_at=now)
                )
                decided = RequestState.APPROVED
            elif action == "respond":
                payload["response"] = response
                conn.execute(
                    r.update().where(*pending).values(
                        state=RequestState.RESPONDED, decided_at=now, decided_by=approver, decision_reason=reason
                    )
                )
                # The tool never runs: its effect ends cancelled, with the person's answer as its result (what a
                # re-issued call replays).
                conn.execute(
                    e.update().where(e.c.effect_id == req.effect_id, EFFECT.guard("respond", e.c.state))
                    .values(state=EffectState.CANCELLED, result_snapshot=response,
                            error=f"answered by {approver} in the tool's place; the tool did not run", updated_at=now)
                )
                decided = RequestState.RESPONDED
            else:
                conn.execute(
                    r.update().where(*pending).values(
                        state=RequestState.REJECTED, decided_at=now, decided_by=approver, decision_reason=reason
                    )
                )
                conn.execute(
                    e.update().where(e.c.effect_id == req.effect_id, EFFECT.guard("reject", e.c.state))
                    .values(state=EffectState.REJECTED, error=f"rejected by {approver}: {reason}", updated_at=now)
                )
                decided = RequestState.REJECTED
            out = {
                "approval_request_id": approval_request_id,
                "session_id": req.session_id,
                "tool_name": req.tool_name,
                "decision": action,
                "state": decided.value,
                "approver": approver,
                "reason": reason,
            }
            self._audit.append_event_in(
                conn, subject=f"approval:{approval_request_id}", approval_request_id=approval_request_id,
                action=action, actor=approver, payload=payload, outbox=[("approval.decided", out)], now=now,
            )
            if action == "reject":
                why = f"approval {approval_request_id} ({req.tool_name}) rejected by {approver}: {reason}"
                self.cancel_pending_in(conn, req.session_id, why, now, except_id=approval_request_id)
                self._halt_in(conn, req.session_id, why, now)
                changes = [StateChange(req.session_id, SessionState.HALTED)]
                # Sessions that joined the request (the same ask from another session of the same key, see
                # ``note_request_event``) are halted with it: the reject answers every one of them.
                for joiner in self.joined_sessions_in(conn, approval_request_id):
                    if joiner != req.session_id:
                        self.cancel_pending_in(conn, joiner, why, now)
                        self._halt_in(conn, joiner, f"{why} (this session had joined that request)", now)
                        changes.append(StateChange(joiner, SessionState.HALTED))
                return changes
            return self._refresh_changes_in(conn, req.session_id, now)

    def expire_request(self, approval_request_id: str, now: dt.datetime) -> builtins.list[StateChange] | None:
        """Apply the timeout to one due request, per the policy: ``auto_approved`` (event ``auto_approve``) or
        ``timed_out`` (event ``timeout``, the session halted, its other pending requests cancelled).

        Returns the session state changes, or None when the request was not due, not pending, or is being expired
        by another process right now (``expire_batch`` restricted to this one id).
        """
        got, changes = self.expire_batch(now, only=[approval_request_id])
        return changes if got else None

    def due_claim(self, now: dt.datetime, *, limit: int = EXPIRE_BATCH, only: Sequence[str] | None = None,
                  with_args: bool = False) -> Any:
        """The SELECT of up to ``limit`` pending requests due at ``now`` (``expire_batch`` locks it), oldest first;
        ``with_args``: with their ``proposed_args`` (what an auto-approval approves; a timeout does not read them).

        Ordered by ``timeout_at`` alone, the order of the due index (``ix_undolog_approval_due``: the pending requests
        by ``timeout_at``), so the database walks the index and stops after ``limit`` rows. Ordered by the id as well, no index gave the order and the claim
        sorted: on a freshly filled table PostgreSQL's estimates chose a full sort of every due row, each batch of a
        sweep re-reading the whole backlog (4.5 ms a claim with 6,000 due, against 0.3 ms).
        """
        r = t.approval_requests
        # Restricted to ids, the rows are found by key (``_still``: otherwise a batch of ids read every due row).
        pending = _DUE if only is None else _still(RequestState.PENDING)
        cols = [r.c.approval_request_id, r.c.session_id, r.c.effect_id, r.c.tool_name, r.c.timeout_at, r.c.created_at]
        q = (sa.select(*cols, *([r.c.proposed_args] if with_args else []))
             .where(pending, r.c.timeout_at <= now)
             .order_by(r.c.timeout_at).limit(limit))
        if only is not None:
            q = q.where(self._store.one_of(r.c.approval_request_id, list(only)))
        return q

    def expire_batch(
        self, now: dt.datetime, *, limit: int = EXPIRE_BATCH, only: Sequence[str] | None = None
    ) -> tuple[builtins.list[ExpiredRequest], builtins.list[StateChange]]:
        """Apply the timeout to up to ``limit`` due requests in ONE transaction; (requests expired here, state
        changes).

        The claim is one ``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL), so several sweepers take disjoint
        batches instead of queuing on the same rows; the state changes are a handful of set-wise statements and
        the audit events one ``append_events_in`` (one chain-head lock per batch). Per request the outcome is
        exactly ``expire_request``'s: with ``auto_approve_on_timeout`` each is ``auto_approved``; otherwise the
        oldest due request of each session is ``timed_out``, the session halted, and its other pending requests
        cancelled. A pending request of such a session that another transaction holds locked right now (another
        sweeper timing it out, a person deciding it) is skipped rather than waited for: waiting is how two
        sweepers would deadlock on one session, and whoever holds it settles it. ``only`` restricts the claim to
        those ids (``ApprovalService.expire``).
        """
        r, e, s = t.approval_requests, t.effect_log, t.sessions
        with self._store.tx() as conn:
            if self._store.is_postgres and only is None and not self._sweep_slot_in(conn, now):
                return [], []
            # The policy first: only an auto-approval needs the requests' arguments (a JSON document per row).
            policy = self._policy.get_in(conn)
            claim = self._store.for_update(self.due_claim(now, limit=limit, only=only,
                                                   with_args=policy.auto_approve_on_timeout), skip_locked=True)
            due = self._sessions_held_in(conn, conn.execute(claim).all())
            if not due:
                return [], []
            # The claim's order stops at timeout_at (see ``due_claim``); the tie-break is applied to the batch here,
            # so which request of a session is its oldest due one (timed out; the others cancelled) stays decided.
            due.sort(key=lambda x: (x.timeout_at, x.approval_request_id))
            events: builtins.list[PendingEvent] = []
            ids = [x.approval_request_id for x in due]

            def base(x: Any) -> dict[str, Any]:
                return {"approval_request_id": x.approval_request_id, "session_id": x.session_id,
                        "tool_name": x.tool_name, "timeout_at": x.timeout_at.isoformat()}

            if policy.auto_approve_on_timeout:
                conn.execute(
                    r.update().where(r.c.approval_request_id == sa.bindparam("rid"),
                                     REQUEST.guard("auto_approve", r.c.state))
                    .values(state=RequestState.AUTO_APPROVED, approved_args=sa.bindparam("args"),
                            approved_digest=sa.bindparam("digest"), decided_at=now,
                            decided_by="undolog:timeout-policy",
                            decision_reason="auto-approved on timeout by org policy")
                    .execution_options(synchronize_session=False),
                    [{"rid": x.approval_request_id, "args": x.proposed_args,
                      "digest": sha256_hex(canonical_json(x.proposed_args))} for x in due],
                )
                conn.execute(
                    e.update().where(self._store.one_of(e.c.effect_id, [x.effect_id for x in due]),
                                     EFFECT.guard("approve", e.c.state))
                    .values(state=EffectState.APPROVED, updated_at=now)
                )
                for x in due:
                    events.append(PendingEvent(
                        subject=f"approval:{x.approval_request_id}", approval_request_id=x.approval_request_id,
                        action="auto_approve", actor="undolog:timeout-policy",
                        payload={"policy": "auto_approve_on_timeout"},
                        outbox=[("approval.timed_out", {**base(x), "outcome": "auto_approved"}),
                                ("approval.decided", {**base(x), "state": "auto_approved",
                                                      "decision": "auto_approve"})]))
                self._audit.append_events_in(conn, events, now=now)
                sessions = sorted({x.session_id for x in due})
                still = sa.select(r.c.approval_request_id).where(r.c.session_id == s.c.session_id,
                                                                 _still(RequestState.PENDING))
                woke = conn.execute(
                    s.update().where(self._store.one_of(s.c.session_id, sessions),
                                     SESSION.guard("approval_settled", s.c.state), ~sa.exists(still))
                    .values(state=SessionState.ACTIVE, updated_at=now).returning(s.c.session_id)
                ).scalars().all()
                auto = [ExpiredRequest(x.approval_request_id, x.effect_id, x.session_id, x.tool_name,
                                       RequestState.AUTO_APPROVED, x.created_at, now, "undolog:timeout-policy",
                                       "auto-approved on timeout by org policy") for x in due]
                return auto, [StateChange(sid, SessionState.ACTIVE) for sid in woke]
            # Timed out: the oldest due request of each session; the session's others are cancelled with it.
            cause: dict[str, Any] = {}
            for x in due:
                cause.setdefault(x.session_id, x)
            timed_out = list(cause.values())
            conn.execute(
                r.update().where(self._store.one_of(r.c.approval_request_id, [x.approval_request_id for x in timed_out]),
                                 _still_in("time_out"))
                .values(state=RequestState.TIMED_OUT, decided_at=now, decided_by="undolog:timeout",
                        decision_reason="no decision before timeout_at")
            )
            conn.execute(
                e.update().where(self._store.one_of(e.c.effect_id, [x.effect_id for x in timed_out]),
                                 EFFECT.guard("time_out", e.c.state))
                .values(state=EffectState.TIMED_OUT, error="approval timed out", updated_at=now)
            )
            why = {x.session_id: f"approval {x.approval_request_id} ({x.tool_name}) timed out without a decision"
                   for x in timed_out}
            # The sessions' other pending requests: those in this batch are ours already; the rest are claimed
            # here without waiting (see above).
            cause_ids = {x.approval_request_id for x in timed_out}
            others = [x for x in due if x.approval_request_id not in cause_ids]
            more = conn.execute(self._store.for_update(
                sa.select(r.c.approval_request_id, r.c.session_id, r.c.effect_id)
                .where(self._store.one_of(r.c.session_id, list(why)), _still(RequestState.PENDING),
                       sa.not_(self._store.one_of(r.c.approval_request_id, ids))), skip_locked=True)).all()
            cancelled = [(x.approval_request_id, x.session_id, x.effect_id) for x in [*others, *more]]
            # Each statement below is set-wise, the reason text built by the database from the session's timed-out
            # request: a statement per row (an executemany) costs a round trip and a parse per row.
            by = r.alias("cause")

            def reason_of(session_col: Any) -> Any:
                text = (sa.literal("approval ") + by.c.approval_request_id + sa.literal(" (") + by.c.tool_name
                        + sa.literal(") timed out without a decision"))
                return (sa.select(text).where(by.c.session_id == session_col,
                                              self._store.one_of(by.c.approval_request_id, list(cause_ids)))
                        .scalar_subquery())

            if cancelled:
                conn.execute(
                    r.update().where(self._store.one_of(r.c.approval_request_id, [c[0] for c in cancelled]),
                                     _still_in("withdraw"))
                    .values(state=RequestState.CANCELLED, decided_at=now, decided_by="undolog",
                            decision_reason=reason_of(r.c.session_id))
                )
                conn.execute(
                    e.update().where(self._store.one_of(e.c.effect_id, [c[2] for c in cancelled]),
                                     EFFECT.guard("cancel", e.c.state))
                    .values(state=EffectState.CANCELLED, error=reason_of(e.c.session_id), updated_at=now)
                )
            conn.execute(
                s.update().where(self._store.one_of(s.c.session_id, list(why)), SESSION.guard("halt", s.c.state))
                .values(state=SessionState.HALTED.value, halted_reason=reason_of(s.c.session_id), updated_at=now)
            )
            by_session: dict[str, builtins.list[tuple[str, str, str]]] = {}
            for c in cancelled:
                by_session.setdefault(c[1], []).append(c)
            for x in timed_out:
                events.append(PendingEvent(
                    subject=f"approval:{x.approval_request_id}", approval_request_id=x.approval_request_id,
                    action="timeout", actor="undolog:timeout", payload={"timeout_at": x.timeout_at.isoformat()},
                    outbox=[("approval.timed_out", {**base(x), "outcome": "timed_out"}),
                            ("session.halted", {"session_id": x.session_id, "reason": why[x.session_id]})]))
                for rid, sid, _ in by_session.get(x.session_id, []):
                    events.append(PendingEvent(subject=f"approval:{rid}", approval_request_id=rid, action="cancel",
                                               actor="undolog", payload={"reason": why[sid]}))
            self._audit.append_events_in(conn, events, now=now)
            return ([ExpiredRequest(x.approval_request_id, x.effect_id, x.session_id, x.tool_name,
                                    RequestState.TIMED_OUT, x.created_at, now, "undolog:timeout",
                                    "no decision before timeout_at") for x in timed_out],
                    [StateChange(sid, SessionState.HALTED) for sid in why])

    # -- approved calls that were never re-issued (approved_ttl_seconds) ---------------------------------

    def approval_lapsed(self, decided_at: dt.datetime | None, now: dt.datetime) -> bool:
        """Whether an approval decided at ``decided_at`` is older than the policy's ``approved_ttl_seconds``."""
        if decided_at is None:
            return False
        with self._store.read() as conn:
            ttl = self._policy.get_in(conn).approved_ttl_seconds
        return decided_at <= now - dt.timedelta(seconds=ttl)

    def lapse_request(self, approval_request_id: str, now: dt.datetime) -> builtins.list[StateChange] | None:
        """Expire one approved request whose call was not re-issued in time (``lapse_batch`` restricted to it).

        Returns the session state changes, or None when the request is not lapsed (not approved any more, its call
        claimed to run meanwhile, younger than the TTL) or another process is expiring it right now.
        """
        got, changes = self.lapse_batch(now, only=[approval_request_id])
        return changes if got else None

    def lapse_batch(
        self, now: dt.datetime, *, limit: int = EXPIRE_BATCH, only: Sequence[str] | None = None
    ) -> tuple[builtins.list[str], builtins.list[StateChange]]:
        """Expire up to ``limit`` approved requests whose call was not re-issued within the policy's
        ``approved_ttl_seconds``, in ONE transaction; (the ids expired here, session state changes).

        Each request and its effect become ``expired``, audited as ``expire`` (actor ``undolog:approval-ttl``) with
        its ``approval.expired`` outbox row, the events of the batch appended together. The session is NOT halted:
        nothing ran, the agent may ask again. The effect gives its ``call_id`` up (it becomes
        ``expired:<effect_id>``; the request keeps the original), so re-issuing the same call raises a new request
        instead of finding this one. Only requests whose effect is still ``approved`` are claimed (a call claimed to
        run meanwhile is not lapsed), with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL: several sweepers take disjoint
        batches and each request is expired exactly once. ``only`` restricts the claim to those ids.
        """
        r, e = t.approval_requests, t.effect_log
        with self._store.tx() as conn:
            ttl = self._policy.get_in(conn).approved_ttl_seconds
            cutoff = now - dt.timedelta(seconds=ttl)
            q = (sa.select(r.c.approval_request_id, r.c.effect_id, r.c.session_id, r.c.tool_name, r.c.call_id,
                           r.c.decided_at, r.c.decided_by)
                 .select_from(r.join(e, e.c.effect_id == r.c.effect_id))
                 .where(r.c.state.in_((RequestState.APPROVED.value, RequestState.AUTO_APPROVED.value)),
                        r.c.decided_at <= cutoff, e.c.state == EffectState.APPROVED.value)
                 .order_by(r.c.decided_at, r.c.approval_request_id).limit(limit))
            if only is not None:
                q = q.where(self._store.one_of(r.c.approval_request_id, list(only)))
            due = self._sessions_held_in(conn, conn.execute(self._store.for_update(q, skip_locked=True)).all())
            if not due:
                return [], []
            error = f"approval lapsed: not re-issued within {ttl} s of the decision"
            # Still conditional on the effect (both rows are locked on PostgreSQL; SQLite has one writer).
            moved = set(conn.execute(
                e.update().where(self._store.one_of(e.c.effect_id, [x.effect_id for x in due]),
                                 EFFECT.guard("lapse", e.c.state))
                .values(state=EffectState.EXPIRED.value, call_id=sa.literal("expired:") + e.c.effect_id,
                        error=error, updated_at=now)
                .returning(e.c.effect_id)
            ).scalars())
            lapsed = [x for x in due if x.effect_id in moved]
            if not lapsed:
                return [], []
            ids = [x.approval_request_id for x in lapsed]
            conn.execute(r.update().where(self._store.one_of(r.c.approval_request_id, ids), REQUEST.guard("lapse", r.c.state))
                         .values(state=RequestState.EXPIRED.value))
            events = []
            for x in lapsed:
                payload = {"decided_at": x.decided_at.isoformat(), "decided_by": x.decided_by,
                           "approved_ttl_seconds": ttl}
                out = {"approval_request_id": x.approval_request_id, "session_id": x.session_id,
                       "tool_name": x.tool_name, "call_id": x.call_id, **payload}
                events.append(PendingEvent(subject=f"approval:{x.approval_request_id}",
                                           approval_request_id=x.approval_request_id, action="expire",
                                           actor="undolog:approval-ttl", payload=payload,
                                           outbox=[("approval.expired", out)]))
            self._audit.append_events_in(conn, events, now=now)
            changes: builtins.list[StateChange] = []
            for sid in sorted({x.session_id for x in lapsed}):
                changes.extend(self._refresh_changes_in(conn, sid, now))
            return ids, changes

    def sweep_slot_key(self) -> int:
        """The first key of this schema's sweep slots (PostgreSQL advisory locks ``(key, 0..SWEEP_SLOTS-1)``)."""
        return zlib.crc32((self._store.schema or "").encode()) & 0x7FFFFFFF  # an int4, as two-key advisory locks take

    def _sweep_slot_in(self, conn: Connection, now: dt.datetime) -> bool:
        """PostgreSQL, a sweep batch's first statement: True with one of ``SWEEP_SLOTS`` slots held until the
        transaction ends and something due at ``now``; False when every slot is held (the sweep then stops having
        read nothing of the requests: the holders loop until nothing they can claim is left, so every due request
        is still settled, once) or nothing is due (the slot is let go with the transaction)."""
        key = self.sweep_slot_key()
        row = conn.execute(_SLOT_AND_DUE, {"n": SWEEP_SLOTS, "key": key, "now": now}).one()
        return row.slot is not None and bool(row.due)

    def _sessions_held_in(self, conn: Connection, claimed: Sequence[Any]) -> builtins.list[Any]:
        """The claimed rows (each with a ``session_id``) whose session row this sweep could lock without waiting.

        A decision locks session, then request, then head (``_lock_session_of_in``); a sweep claims requests first
        (SKIP LOCKED, so sweepers split the due rows). Had a sweep then waited for a session row a decision holds
        while that decision waited for a request the sweep claimed, PostgreSQL would abort one as a deadlock. So the
        sweep takes the session rows SKIP LOCKED too and leaves the requests of a busy session to the next batch or
        sweep (their rows are released at its commit; the decision then finds them as they are). On SQLite every
        writer holds the one write lock: nothing to skip.
        """
        if not self._store.is_postgres or not claimed:
            return list(claimed)
        s = t.sessions
        held = set(conn.execute(
            sa.select(s.c.session_id).where(self._store.one_of(s.c.session_id, sorted({x.session_id for x in claimed})))
            .with_for_update(skip_locked=True)
        ).scalars())
        return [x for x in claimed if x.session_id in held]

    def _lock_session_of_in(self, conn: Connection, approval_request_id: str) -> None:
        """Lock the session row of a request first (PostgreSQL), before the request and any audit chain head.

        An agent's call locks its session row first (the guard that counts its calls) and an audit head last (the
        ``approval.requested`` event). A decision used to take a head first (its event) and the session row after it
        (the state refresh, a halt): an agent raising a request in the same session at that moment held the row and
        waited for a head the decision held, while the decision waited for the row, and PostgreSQL aborted one of
        them as a deadlock (a 500 under the load test, with one chain; with several chains taken SKIP LOCKED it
        remains possible whenever every head is held). Session row first, then request, then head: one order for
        the agent's call and the decision. On SQLite every writer already holds the one write lock.
        """
        if not self._store.is_postgres:
            return
        r, s = t.approval_requests, t.sessions
        conn.execute(
            sa.select(s.c.session_id)
            .where(s.c.session_id == sa.select(r.c.session_id).where(r.c.approval_request_id == approval_request_id)
                   .scalar_subquery())
            .with_for_update()
        )

    # -- cancellations (inside the caller's transaction) ---------------------------------------------

    def cancel_pending_in(
        self, conn: Connection, session_id: str, why: str, now: dt.datetime, *, except_id: str | None = None
    ) -> int:
        """Cancel every pending request of the session (but ``except_id``); returns how many."""
        r = t.approval_requests
        q = sa.select(r.c.approval_request_id, r.c.effect_id).where(
            r.c.session_id == session_id, _still(RequestState.PENDING)
        )
        if except_id:
            q = q.where(r.c.approval_request_id != except_id)
        n = 0
        for other in conn.execute(self._store.for_update(q)).all():
            n += self.cancel_request_in(conn, other.approval_request_id, other.effect_id, why, now)
        return n

    def cancel_request_in(self, conn: Connection, request_id: str, effect_id: str, why: str, now: dt.datetime) -> bool:
        """Cancel a request that may still lead to a run (pending or approved), its effect if it has not run, and
        audit it (event ``cancel``); False when the request was already settled."""
        r = t.approval_requests
        res = conn.execute(
            r.update()
            .where(r.c.approval_request_id == request_id, REQUEST.guard("cancel", r.c.state))
            .values(state=RequestState.CANCELLED, decided_at=now, decided_by="undolog", decision_reason=why)
        )
        if res.rowcount == 0:
            return False
        # A released call (handed back by a framework mid-run, not re-issued yet) is cancelled with its request:
        # its re-issue must not run it in a session that has stopped.
        conn.execute(
            t.effect_log.update()
            .where(t.effect_log.c.effect_id == effect_id, EFFECT.guard("cancel", t.effect_log.c.state))
            .values(state=EffectState.CANCELLED, error=why, updated_at=now)
        )
        self._audit.append_event_in(
            conn, subject=f"approval:{request_id}", approval_request_id=request_id, action="cancel",
            actor="undolog", payload={"reason": why}, now=now,
        )
        return True

    def unsettled_requests_in(self, conn: Connection, session_id: str) -> builtins.list[Any]:
        """The session's requests that may still lead to a run: what a rollback cancels."""
        r = t.approval_requests
        return list(conn.execute(
            sa.select(r.c.approval_request_id, r.c.effect_id)
            .where(r.c.session_id == session_id, r.c.state.in_([s.value for s in t.OPEN_REQUEST_STATES]))
        ).all())

    def insert_request_in(self, conn: Connection, record: Mapping[str, Any], now: dt.datetime, *,
                          actor: str, payload: dict[str, Any]) -> None:
        """An approval request, its session waiting, and the audited ``requested`` event with its outbox row."""
        request_id = record["approval_request_id"]
        conn.execute(t.approval_requests.insert(), dict(record))
        self._await_approval_in(conn, record["session_id"], now)
        self._audit.append_event_in(conn, subject=f"approval:{request_id}", approval_request_id=request_id,
                             action="requested", actor=actor, payload=payload,
                             outbox=[("approval.requested", payload)], now=now)
