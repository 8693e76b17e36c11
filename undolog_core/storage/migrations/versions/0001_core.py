"""Core tables, the append-only audit triggers and the single policy row.

Revision ID: 0001_core
"""

import datetime as dt

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None

# The effect log and the undo stack as 0001 made them; 0003 changes both, so they are frozen here.
_v1 = sa.MetaData()
s.sessions.to_metadata(_v1)  # only for the foreign key to resolve; created from storage/schema.py
_effect_log_v1 = sa.Table(
    "undolog_effect_log",
    _v1,
    sa.Column("effect_id", sa.String(64), primary_key=True),
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
    sa.Column("lease_until", s.UTCDateTime),
    sa.Column("recovery_attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("released_from", sa.String(32)),
    sa.Column("created_at", s.UTCDateTime, nullable=False),
    sa.Column("updated_at", s.UTCDateTime, nullable=False),
    sa.UniqueConstraint("session_id", "call_id", name="uq_undolog_effect_call"),
    sa.CheckConstraint(s._in("tier", s.TIERS), name="ck_undolog_effect_tier"),
    sa.CheckConstraint(s._in("state", s.EFFECT_STATES), name="ck_undolog_effect_state"),
    sqlite_with_rowid=False,
)
sa.Index(
    "ix_undolog_effect_in_flight",
    _effect_log_v1.c.state,
    sqlite_where=sa.text("state IN ('pending', 'running')"),
    postgresql_where=sa.text("state IN ('pending', 'running')"),
)
_undo_stack_v1 = sa.Table(
    "undolog_undo_stack",
    _v1,
    sa.Column("undo_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("effect_id", sa.String(64), sa.ForeignKey("undolog_effect_log.effect_id"), nullable=False, unique=True),
    sa.Column("session_id", sa.String(200), nullable=False),
    sa.Column("compensation_name", sa.String(200), nullable=False),
    sa.Column("compensation_version", sa.Integer, nullable=False),
    sa.Column("args_snapshot", sa.JSON, nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_until", s.UTCDateTime),
    sa.Column("created_at", s.UTCDateTime, nullable=False),
    sa.Column("updated_at", s.UTCDateTime, nullable=False),
    sa.CheckConstraint(s._in("state", s.UNDO_STATES), name="ck_undolog_undo_state"),
)
sa.Index("ix_undolog_undo_session", _undo_stack_v1.c.session_id, _undo_stack_v1.c.undo_id)

_BEFORE = [s.org_policy, s.sessions]
_FROZEN = [_effect_log_v1, _undo_stack_v1]
_AFTER = [s.approval_requests, s.approval_events, s.audit_head, s.tool_registry, s.outbox]

GENESIS_HASH = "0" * 64


def upgrade() -> None:
    # The tables that no later revision changed come from storage/schema.py; the ones a later revision changed are
    # frozen above as 0001 made them. Every schema change is a new revision with explicit operations.
    bind = op.get_bind()
    s.metadata.create_all(bind, tables=_BEFORE)
    _v1.create_all(bind, tables=_FROZEN)
    s.metadata.create_all(bind, tables=_AFTER)
    now = dt.datetime.now(dt.UTC)
    bind.execute(
        s.org_policy.insert().values(
            policy_id=1,
            approval_timeout_seconds=3600,
            auto_approve_on_timeout=False,
            context_calls=10,
            updated_at=now,
            updated_by="undolog:migration",
        )
    )
    bind.execute(s.audit_head.insert().values(head_id=1, last_event_id=0, last_hash=GENESIS_HASH))
    if bind.dialect.name == "postgresql":
        op.execute(
            """
            CREATE OR REPLACE FUNCTION undolog_refuse_audit_change() RETURNS trigger AS $$
            BEGIN
              RAISE EXCEPTION 'undolog_approval_events is append-only (% refused)', TG_OP
                USING ERRCODE = 'insufficient_privilege';
            END;
            $$ LANGUAGE plpgsql
            """
        )
        op.execute(
            "CREATE TRIGGER undolog_events_no_update BEFORE UPDATE OR DELETE ON undolog_approval_events "
            "FOR EACH ROW EXECUTE FUNCTION undolog_refuse_audit_change()"
        )
        op.execute(
            "CREATE TRIGGER undolog_events_no_truncate BEFORE TRUNCATE ON undolog_approval_events "
            "FOR EACH STATEMENT EXECUTE FUNCTION undolog_refuse_audit_change()"
        )
    else:
        op.execute(
            "CREATE TRIGGER undolog_events_no_update BEFORE UPDATE ON undolog_approval_events "
            "BEGIN SELECT RAISE(ABORT, 'undolog_approval_events is append-only (UPDATE refused)'); END"
        )
        op.execute(
            "CREATE TRIGGER undolog_events_no_delete BEFORE DELETE ON undolog_approval_events "
            "BEGIN SELECT RAISE(ABORT, 'undolog_approval_events is append-only (DELETE refused)'); END"
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS undolog_events_no_update ON undolog_approval_events")
        op.execute("DROP TRIGGER IF EXISTS undolog_events_no_truncate ON undolog_approval_events")
        op.execute("DROP FUNCTION IF EXISTS undolog_refuse_audit_change()")
    s.metadata.drop_all(bind, tables=list(reversed(_AFTER)))
    _v1.drop_all(bind, tables=list(reversed(_FROZEN)))
    s.metadata.drop_all(bind, tables=list(reversed(_BEFORE)))
