"""Core tables, the append-only audit triggers and the single policy row.

Revision ID: 0001_core
"""

import datetime as dt

from alembic import op

from undolog_core import _schema as s

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None

_CORE = [
    s.org_policy,
    s.sessions,
    s.effect_log,
    s.undo_stack,
    s.approval_requests,
    s.approval_events,
    s.audit_head,
    s.tool_registry,
    s.outbox,
]

GENESIS_HASH = "0" * 64


def upgrade() -> None:
    # This first revision builds the tables from _schema as it stood when 0001 was written;
    # every later schema change is a new revision with explicit operations.
    bind = op.get_bind()
    s.metadata.create_all(bind, tables=_CORE)
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
    s.metadata.drop_all(bind, tables=list(reversed(_CORE)))
