"""SQLAlchemy Core tables. The names and the columns listed in the docs are a contract for reports."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from ..errors import ConfigurationError

metadata = sa.MetaData()


class UTCDateTime(sa.types.TypeDecorator[dt.datetime]):
    """Aware UTC datetimes on both databases (SQLite keeps no zone, so it is stored naive UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to UndoLog storage; use an aware UTC datetime")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        parsed: dt.datetime = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=dt.UTC)
        return parsed.astimezone(dt.UTC)


TIERS = ("safe", "compensable", "irreversible")


class SessionState(enum.StrEnum):
    ACTIVE = "active"
    AWAITING_APPROVAL = "awaiting_approval"
    HALTED = "halted"
    # A rollback was requested and is durable (``undolog_rollbacks``): no call is accepted until it ends
    # ``rolled_back`` or, when a compensation fails, ``halted``.
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    COMPLETED = "completed"


class EffectState(enum.StrEnum):
    PENDING = "pending"  # COMPENSABLE: pre-written, the tool runs (or ran without its mark)
    COMMITTED = "committed"
    FAILED = "failed"
    AWAITING_APPROVAL = "awaiting_approval"  # IRREVERSIBLE
    APPROVED = "approved"
    RUNNING = "running"
    REJECTED = "rejected"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    COMPENSATED = "compensated"
    UNKNOWN = "unknown"
    DEAD_LETTER = "dead_letter"
    RELEASED = "released"  # handed back by a framework's control flow; its re-issue runs it
    # IRREVERSIBLE: approved, but not re-issued within the policy's approved_ttl_seconds. Never runs; re-issuing
    # the call raises a new request (the expired effect gives its call_id up, see ApprovalsSQL.lapse_request).
    EXPIRED = "expired"


class UndoState(enum.StrEnum):
    ARMED = "armed"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"


class RequestState(enum.StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    TIMED_OUT = "timed_out"
    AUTO_APPROVED = "auto_approved"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # approved, but the call was not re-issued in time (approved_ttl_seconds)
    # A person answered in the tool's place (LangChain's ``respond``): the tool never runs, and the person's text is
    # the call's result. Its effect is ``cancelled`` (it never ran) and holds that text as its result.
    RESPONDED = "responded"


#: A request that may still lead to a run (pending, or approved and not re-issued yet): cancelling it stops that
#: run, and a rollback cancels a session's open requests.
OPEN_REQUEST_STATES = (RequestState.PENDING, RequestState.APPROVED, RequestState.AUTO_APPROVED)

class DecisionKind(enum.StrEnum):
    """What a person may decide on a pending request; each is recorded as the audit event of the same name."""

    APPROVE = "approve"
    MODIFY = "modify"
    REJECT = "reject"
    RESPOND = "respond"


class OnFailure(enum.StrEnum):
    """What a session does when a COMPENSABLE or IRREVERSIBLE call fails. Values are what the database stores.

    Example:
        >>> OnFailure.coerce("continue")
        <OnFailure.CONTINUE: 'continue'>
    """

    ROLLBACK = "rollback"  # roll the session back, newest first (the default)
    CONTINUE = "continue"  # record the failure and let the caller decide

    @classmethod
    def coerce(cls, value: OnFailure | str) -> OnFailure:
        """``value`` as an ``OnFailure``; anything else is refused naming the values allowed."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigurationError(
                f"on_failure must be one of {', '.join(repr(v.value) for v in cls)}, got {value!r}"
            ) from None


SESSION_STATES = tuple(s.value for s in SessionState)
EFFECT_STATES = tuple(s.value for s in EffectState)
UNDO_STATES = tuple(s.value for s in UndoState)
REQUEST_STATES = tuple(s.value for s in RequestState)
# A session accepts calls in these states.
WRITABLE = (SessionState.ACTIVE.value, SessionState.AWAITING_APPROVAL.value)
# An effect whose tool is (or may be) running.
IN_FLIGHT = (EffectState.PENDING.value, EffectState.RUNNING.value)


def _in(col: str, values: tuple[str, ...]) -> str:
    return f"{col} IN ({', '.join(repr(v) for v in values)})"


org_policy = sa.Table(
    "undolog_org_policy",
    metadata,
    sa.Column("policy_id", sa.Integer, primary_key=True),
    sa.Column("approval_timeout_seconds", sa.Integer, nullable=False),
    sa.Column("auto_approve_on_timeout", sa.Boolean, nullable=False),
    sa.Column("context_calls", sa.Integer, nullable=False),
    sa.Column("approved_ttl_seconds", sa.Integer, nullable=False, server_default=str(24 * 3600)),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.Column("updated_by", sa.String(200), nullable=False),
    sa.CheckConstraint("policy_id = 1", name="ck_undolog_org_policy_single_row"),
)

sessions = sa.Table(
    "undolog_sessions",
    metadata,
    sa.Column("session_id", sa.String(200), primary_key=True),
    sa.Column("agent_id", sa.String(200)),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("tool_calls_total", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("created_by", sa.String(200)),
    sa.Column("halted_reason", sa.Text),
    sa.Column("on_failure", sa.String(16), nullable=False, server_default="rollback"),
    sa.Column("pinned_revisions", sa.JSON, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.CheckConstraint(_in("state", SESSION_STATES), name="ck_undolog_sessions_state"),
    sa.CheckConstraint(_in("on_failure", tuple(v.value for v in OnFailure)), name="ck_undolog_sessions_on_failure"),
)

# A 64-bit sequence on PostgreSQL; exactly INTEGER on SQLite, where that makes it the rowid.
SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

effect_log = sa.Table(
    "undolog_effect_log",
    metadata,
    # Rows are clustered in the order they are written (on SQLite the rowid): an insert appends to the last
    # page instead of splitting a random one, which is most of the cost of a durable pre-write. The public id
    # stays the random effect_id, with its own unique index.
    sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
    sa.Column("effect_id", sa.String(64), nullable=False, unique=True),
    sa.Column("session_id", sa.String(200), sa.ForeignKey("undolog_sessions.session_id"), nullable=False),
    sa.Column("call_id", sa.String(200), nullable=False),
    sa.Column("tool_name", sa.String(200), nullable=False),
    sa.Column("tool_revision", sa.Integer, nullable=False),
    sa.Column("tier", sa.String(16), nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("args_snapshot", sa.JSON, nullable=False),
    sa.Column("args_digest", sa.String(64), nullable=False),
    sa.Column("result_snapshot", sa.JSON),
    sa.Column("error", sa.Text),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_until", UTCDateTime),
    sa.Column("recovery_attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("released_from", sa.String(32)),
    # The ownership epoch (revision 0015): 1 at the pre-write, one more at every claim (an approved call claimed, a
    # released call re-claimed, recovery taking it over). The fencing token a tool passes upstream beside its key.
    sa.Column("epoch", sa.Integer, nullable=False, server_default="1"),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    # The framework run (a CrewAI kickoff, a Semantic Kernel turn) that logged the call, when the adapter names one:
    # a continuation of that run replays these effects instead of running them again (revision 0014).
    sa.Column("kickoff_id", sa.String(200)),
    sa.UniqueConstraint("session_id", "call_id", name="uq_undolog_effect_call"),
    sa.CheckConstraint(_in("tier", TIERS), name="ck_undolog_effect_tier"),
    sa.CheckConstraint(_in("state", EFFECT_STATES), name="ck_undolog_effect_state"),
)
# Finding what was in flight when a process died. On PostgreSQL a partial index holds exactly the in-flight
# effects. On SQLite that index would cost a page in every pre-write and every commit mark (a third of a
# COMPENSABLE call's pages), so recovery reads the rows written since its cursor instead: SQLite has one
# writer, so rowids become visible in order and nothing can appear behind the cursor unseen. The one way an
# older row goes back in flight (an approved call claimed to run, a released call re-claimed) moves the cursor
# back in the same transaction.
_IN_FLIGHT = "state IN ('pending', 'running')"
sa.Index(
    "ix_undolog_effect_in_flight",
    effect_log.c.state,
    postgresql_where=sa.text(_IN_FLIGHT),
).ddl_if(dialect="postgresql")

# A client's own idempotency key, scoped beyond one session (the MCP gateway over HTTP: an API key, a tool, a key),
# rides in the call_id as ``ck:<digest>``: this partial unique index makes the pre-write itself refuse a second
# effect with it in any session (no statement more). Other call ids are unique per session only (above).
CLIENT_KEY_PREFIX = "ck:"
CLIENT_KEY_PREDICATE = "call_id LIKE 'ck:%'"
sa.Index(
    "ux_undolog_effect_client_key",
    effect_log.c.call_id,
    unique=True,
    sqlite_where=sa.text(CLIENT_KEY_PREDICATE),
    postgresql_where=sa.text(CLIENT_KEY_PREDICATE),
)

recovery_cursor = sa.Table(
    "undolog_recovery_cursor",
    metadata,
    sa.Column("cursor_id", sa.Integer, primary_key=True, autoincrement=False),
    # Every effect with seq <= effect_seq was settled (or known to recovery) when it was last advanced.
    sa.Column("effect_seq", SEQ, nullable=False),
    # Bumped on every change: recovery advances the cursor by compare-and-swap on it.
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.CheckConstraint("cursor_id = 1", name="ck_undolog_recovery_cursor_single"),
)

# An undo entry's id is its effect's seq, so it needs no index of its own: one per effect (the primary key says
# so), in call order (LIFO is undo_id descending), found from the effect without a lookup, and a session's
# entries are reached through the effect log's (session_id, call_id) index.
undo_stack = sa.Table(
    "undolog_undo_stack",
    metadata,
    sa.Column("undo_id", SEQ, primary_key=True, autoincrement=False),
    sa.Column("effect_id", sa.String(64), sa.ForeignKey("undolog_effect_log.effect_id"), nullable=False),
    sa.Column("session_id", sa.String(200), nullable=False),
    sa.Column("compensation_name", sa.String(200), nullable=False),
    sa.Column("compensation_version", sa.Integer, nullable=False),
    sa.Column("args_snapshot", sa.JSON, nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_until", UTCDateTime),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.CheckConstraint(_in("state", UNDO_STATES), name="ck_undolog_undo_state"),
)
# SQLite, revisions 0003 to 0009: the undo entry of a COMPENSABLE effect was written by this trigger, looking the
# compensation up in the registry. Kept for those migrations (and 0010's downgrade); 0010 replaced it by the
# pre-write view below.
SQLITE_UNDO_TRIGGER = """
CREATE TRIGGER undolog_effect_undo_entry AFTER INSERT ON undolog_effect_log
WHEN NEW.tier = 'compensable' AND NEW.state = 'pending'
BEGIN
  INSERT INTO undolog_undo_stack (undo_id, effect_id, session_id, compensation_name, compensation_version,
                                  args_snapshot, state, attempts, created_at, updated_at)
  SELECT NEW.seq, NEW.effect_id, NEW.session_id, r.compensation_name, r.compensation_version,
         NEW.args_snapshot, 'armed', 0, NEW.created_at, NEW.created_at
  FROM undolog_tool_registry r
  WHERE r.tool_name = NEW.tool_name AND r.revision = NEW.tool_revision AND r.compensation_name IS NOT NULL;
  SELECT RAISE(ABORT, 'undolog: a compensable effect needs its tool revision and compensation in the registry')
  WHERE NOT EXISTS (SELECT 1 FROM undolog_undo_stack WHERE undo_id = NEW.seq);
END
"""

# SQLite (revision 0010): the hot path's pre-write is one autocommit INSERT into this view, whose INSTEAD OF trigger
# writes the effect (only while its session accepts writes: the same check as the statement's EXISTS before) and
# its undo entry (only if the effect was written; ``changes()`` inside a trigger counts the trigger's own last
# statement), with the compensation the caller passes: what PostgreSQL's one-statement pre-write takes too. One
# statement, so no BEGIN and COMMIT to pay for; no registry lookup. An INSERT into a view reports no changes, so
# the caller reads the connection's ``total_changes`` (2: both rows written; 0: the session refused). The view
# reads no table: nothing later done to the effect log has to rebuild it. The writable states are fixed here, as a
# migration writes them (a change to them is a new migration).
SQLITE_PREWRITE_VIEW = """
CREATE VIEW undolog_prewrite AS SELECT
  NULL AS effect_id, NULL AS session_id, NULL AS call_id, NULL AS tool_name, NULL AS tool_revision,
  NULL AS args_snapshot, NULL AS args_digest, NULL AS owner, NULL AS lease_until, NULL AS created_at,
  NULL AS compensation_name, NULL AS compensation_version
WHERE 0
"""
SQLITE_PREWRITE_TRIGGER = """
CREATE TRIGGER undolog_prewrite_insert INSTEAD OF INSERT ON undolog_prewrite
BEGIN
  INSERT INTO undolog_effect_log (effect_id, session_id, call_id, tool_name, tool_revision, tier, state,
                                  args_snapshot, args_digest, owner, lease_until, recovery_attempts, created_at,
                                  updated_at)
  SELECT NEW.effect_id, NEW.session_id, NEW.call_id, NEW.tool_name, NEW.tool_revision, 'compensable', 'pending',
         NEW.args_snapshot, NEW.args_digest, NEW.owner, NEW.lease_until, 0, NEW.created_at, NEW.created_at
  WHERE EXISTS (SELECT 1 FROM undolog_sessions
                WHERE session_id = NEW.session_id AND state IN ('active', 'awaiting_approval'));
  INSERT INTO undolog_undo_stack (undo_id, effect_id, session_id, compensation_name, compensation_version,
                                  args_snapshot, state, attempts, created_at, updated_at)
  SELECT last_insert_rowid(), NEW.effect_id, NEW.session_id, NEW.compensation_name, NEW.compensation_version,
         NEW.args_snapshot, 'armed', 0, NEW.created_at, NEW.created_at
  WHERE changes() = 1;
END
"""

# Recovery looks for interrupted compensations; an entry is only in this index while it is being compensated,
# so the pre-write (state 'armed') never writes it.
sa.Index(
    "ix_undolog_undo_compensating",
    undo_stack.c.state,
    sqlite_where=sa.text("state = 'compensating'"),
    postgresql_where=sa.text("state = 'compensating'"),
)

approval_requests = sa.Table(
    "undolog_approval_requests",
    metadata,
    sa.Column("approval_request_id", sa.String(64), primary_key=True),
    sa.Column("effect_id", sa.String(64), sa.ForeignKey("undolog_effect_log.effect_id"), nullable=False, unique=True),
    sa.Column("session_id", sa.String(200), nullable=False),
    sa.Column("call_id", sa.String(200), nullable=False),
    sa.Column("tool_name", sa.String(200), nullable=False),
    sa.Column("tool_revision", sa.Integer, nullable=False),
    sa.Column("tool_fingerprint", sa.String(64), nullable=False),
    sa.Column("proposed_args", sa.JSON, nullable=False),
    sa.Column("approved_args", sa.JSON),
    sa.Column("action_digest", sa.String(64), nullable=False),
    sa.Column("approved_digest", sa.String(64)),
    sa.Column("reason", sa.Text),
    sa.Column("risk_tags", sa.JSON, nullable=False),
    sa.Column("agent_context", sa.JSON, nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("timeout_at", UTCDateTime, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("decided_at", UTCDateTime),
    sa.Column("decided_by", sa.String(200)),
    sa.Column("decision_reason", sa.Text),
    sa.CheckConstraint(_in("state", REQUEST_STATES), name="ck_undolog_approval_state"),
)
# The sweep's due index: the pending requests by timeout_at, and only them (revision 0011; it was (state,
# timeout_at) over every request). A request leaves it when it is settled: the update that times it out, decides or
# cancels it writes no entry here (a settled row is outside the predicate), where the full index took one per
# change, and the claim walks pending rows only. The lists by state use ``ix_undolog_approval_state_created``.
#: The due index's predicate, and the text the sweep's statements write (``approvals._DUE``, ``_SLOT_AND_DUE``): one
#: string, so the query's WHERE and the index's predicate cannot drift apart (a test pins it on both databases).
DUE_PREDICATE = f"state = '{RequestState.PENDING.value}'"
sa.Index("ix_undolog_approval_due", approval_requests.c.timeout_at,
         sqlite_where=sa.text(DUE_PREDICATE), postgresql_where=sa.text(DUE_PREDICATE))
sa.Index("ix_undolog_approval_session", approval_requests.c.session_id)

# A requested rollback, written before its first compensation and deleted when the walk ends (rolled back, or
# halted by a failing compensation). Its owner and lease say whether a live process is walking it; recovery takes
# over an intent whose owner is gone, so a crash at any point of the walk, between two steps included, is finished.
rollbacks = sa.Table(
    "undolog_rollbacks",
    metadata,
    sa.Column("session_id", sa.String(200), sa.ForeignKey("undolog_sessions.session_id"), primary_key=True),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_until", UTCDateTime),
    sa.Column("requested_at", UTCDateTime, nullable=False),
)

# Which live process serves a session (the MCP gateway holding its upstreams' connections), under a lease it
# renews, and a rollback filed for that process to run: a compensation must reach the upstream process that did the
# work (its state may live in that process only). No foreign key: a session minted by the owner may not be written
# yet when the owner starts holding it. The rollback columns are the filed request and, once run, its report.
session_owners = sa.Table(
    "undolog_session_owners",
    metadata,
    sa.Column("session_id", sa.String(200), primary_key=True),
    sa.Column("owner", sa.String(200), nullable=False),
    sa.Column("lease_until", UTCDateTime, nullable=False),
    # The owner looks for a filed rollback when sent SIGUSR1 (on its host); else it finds it when it renews.
    sa.Column("wakes_on_signal", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("rollback_actor", sa.String(200)),
    sa.Column("rollback_reason", sa.Text),
    sa.Column("rollback_requested_at", UTCDateTime),
    sa.Column("rollback_report", sa.JSON),
)
sa.Index("ix_undolog_session_owners_owner", session_owners.c.owner)

#: How many hash chains the audit trail has (head rows 1..AUDIT_CHAINS). A transaction appends to ONE chain, the
#: first whose head it can lock without waiting, so concurrent writers on PostgreSQL do not queue on one row; the
#: signed checkpoints pin every chain's head at once. SQLite has one writer at a time and appends to chain 1 only.
AUDIT_CHAINS = 16

# Every audited action: approval decisions, policy changes, session resumes and revalidations.
# Hash-chained per ``chain`` (each event's ``prev_hash`` is the hash of the event before it in its chain, in
# ``event_id`` order); the table is append-only by trigger on both databases.
approval_events = sa.Table(
    "undolog_approval_events",
    metadata,
    sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=False),
    sa.Column("approval_request_id", sa.String(64)),
    sa.Column("subject", sa.String(300), nullable=False),
    sa.Column("action", sa.String(64), nullable=False),
    # Wider than the identity rule (200): UndoLog's own prefixes ride on it (``agent:<session id>``).
    sa.Column("actor", sa.String(300), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
    # Which chain the event is in (a head row's ``head_id``); every event before revision 0009 is in chain 1.
    sa.Column("chain", sa.SmallInteger, nullable=False, server_default="1"),
)
sa.Index("ix_undolog_events_request", approval_events.c.approval_request_id)
sa.Index("ix_undolog_events_chain", approval_events.c.chain, approval_events.c.event_id)

# The chain heads, one row per chain: locking a chain's row serialises appends to that chain, so two writers never
# fork it, while writers holding different chains append side by side.
audit_head = sa.Table(
    "undolog_audit_head",
    metadata,
    sa.Column("head_id", sa.Integer, primary_key=True),
    sa.Column("last_event_id", sa.BigInteger, nullable=False),
    sa.Column("last_hash", sa.String(64), nullable=False),
)

# The head rows only move forward (revision 0015): no new chain, none removed, none renumbered or cut back. Defence
# in depth (a trigger can be dropped by whoever can write the database); ``verify --checkpoints`` is the real check.
PG_AUDIT_HEAD_GUARD_FUNCTION = """
CREATE OR REPLACE FUNCTION undolog_audit_head_guard() RETURNS trigger AS $$
BEGIN
  IF TG_OP = 'UPDATE' AND NEW.head_id = OLD.head_id AND NEW.last_event_id >= OLD.last_event_id THEN
    RETURN NEW;
  END IF;
  RAISE EXCEPTION 'undolog_audit_head only moves forward (% refused: chains are 1..%(chains)d, never added, removed, renumbered or cut back)', TG_OP
    USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql
""".replace("%(chains)d", str(AUDIT_CHAINS))
PG_AUDIT_HEAD_GUARD_TRIGGER = ("CREATE TRIGGER undolog_audit_head_guard BEFORE INSERT OR UPDATE OR DELETE ON "
                               "undolog_audit_head FOR EACH ROW EXECUTE FUNCTION undolog_audit_head_guard()")
SQLITE_AUDIT_HEAD_GUARDS = {
    "undolog_audit_head_no_insert": "CREATE TRIGGER undolog_audit_head_no_insert BEFORE INSERT ON undolog_audit_head "
                                    "BEGIN SELECT RAISE(ABORT, 'undolog_audit_head only moves forward (INSERT "
                                    "refused)'); END",
    "undolog_audit_head_no_delete": "CREATE TRIGGER undolog_audit_head_no_delete BEFORE DELETE ON undolog_audit_head "
                                    "BEGIN SELECT RAISE(ABORT, 'undolog_audit_head only moves forward (DELETE "
                                    "refused)'); END",
    "undolog_audit_head_no_back": "CREATE TRIGGER undolog_audit_head_no_back BEFORE UPDATE ON undolog_audit_head "
                                  "WHEN NEW.head_id <> OLD.head_id OR NEW.last_event_id < OLD.last_event_id "
                                  "BEGIN SELECT RAISE(ABORT, 'undolog_audit_head only moves forward (renumbered "
                                  "or cut back)'); END",
}

tool_registry = sa.Table(
    "undolog_tool_registry",
    metadata,
    sa.Column("tool_name", sa.String(200), primary_key=True),
    sa.Column("revision", sa.Integer, primary_key=True),
    sa.Column("tier", sa.String(16), nullable=False),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("previous_fingerprint", sa.String(64)),
    sa.Column("contract", sa.JSON, nullable=False),
    sa.Column("compensation_name", sa.String(200)),
    sa.Column("compensation_version", sa.Integer),
    sa.Column("registered_at", UTCDateTime, nullable=False),
    sa.Column("registered_by", sa.String(200), nullable=False),
    sa.CheckConstraint(_in("tier", TIERS), name="ck_undolog_tool_registry_tier"),
)

outbox = sa.Table(
    "undolog_outbox",
    metadata,
    sa.Column("outbox_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("event_type", sa.String(64), nullable=False),
    sa.Column("payload", sa.JSON, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("delivered_at", UTCDateTime),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_attempt_at", UTCDateTime),
    sa.Column("claimed_by", sa.String(200)),
    sa.Column("claimed_until", UTCDateTime),
)
sa.Index("ix_undolog_outbox_pending", outbox.c.delivered_at, outbox.c.outbox_id)

# What `undolog gc` moved out of the effect log and the undo stack: one row per archived effect or undo entry, the
# row itself as JSON (so the archive keeps every column whatever later migrations change), with the gc run and
# the session it belonged to. Nothing reads it on a hot path; it is there to be looked at, exported or restored.
archive = sa.Table(
    "undolog_archive",
    metadata,
    sa.Column("archive_id", SEQ, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("session_id", sa.String(200), nullable=False),
    sa.Column("ref", sa.String(64), nullable=False),
    sa.Column("row", sa.JSON, nullable=False),
    sa.Column("archived_at", UTCDateTime, nullable=False),
    sa.CheckConstraint("kind IN ('effect', 'undo')", name="ck_undolog_archive_kind"),
)
sa.Index("ix_undolog_archive_session", archive.c.session_id)

# The lists of the dashboard and the CLI, newest first, stay an index walk however large the store grows. (None
# on the sessions' state and updated_at for gc: the pre-write that carries a call count updates updated_at.)
sa.Index("ix_undolog_sessions_created", sessions.c.created_at, sessions.c.session_id)
sa.Index("ix_undolog_approval_state_created", approval_requests.c.state, approval_requests.c.created_at)
