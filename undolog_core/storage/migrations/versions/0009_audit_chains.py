"""The audit trail in several hash chains, so concurrent writers do not queue on one head row.

Every event so far stays in chain 1 with its hash unchanged (the hash formula is the same; a chain is the events
of one ``chain`` value in ``event_id`` order), so a database upgraded here verifies exactly as before, and signed
checkpoints of the single chain still apply to chain 1. Head rows 2..``AUDIT_CHAINS`` start empty. On PostgreSQL
event ids come from a sequence, taken while the chain's head row is locked, so ids still grow along every chain;
SQLite appends to chain 1 only (one writer at a time) and keeps taking ``last_event_id + 1``.

Revision ID: 0009_audit_chains
Revises: 0008_archive
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0009_audit_chains"
down_revision = "0008_archive"
branch_labels = None
depends_on = None

GENESIS_HASH = "0" * 64
SEQUENCE = "undolog_audit_event_id_seq"


def upgrade() -> None:
    bind = op.get_bind()
    insp = sa.inspect(bind)
    # 0001 builds the events table from storage/schema.py, so on a new database the column and index exist already.
    if "chain" not in {c["name"] for c in insp.get_columns("undolog_approval_events")}:
        # A catalog change on both databases (a constant default): the append-only triggers do not fire.
        op.add_column("undolog_approval_events",
                      sa.Column("chain", sa.SmallInteger, nullable=False, server_default="1"))
    if "ix_undolog_events_chain" not in {ix["name"] for ix in insp.get_indexes("undolog_approval_events")}:
        op.create_index("ix_undolog_events_chain", "undolog_approval_events", ["chain", "event_id"])
    have = set(bind.execute(sa.select(s.audit_head.c.head_id)).scalars())
    missing = [{"head_id": i, "last_event_id": 0, "last_hash": GENESIS_HASH}
               for i in range(1, s.AUDIT_CHAINS + 1) if i not in have]
    if missing:
        bind.execute(s.audit_head.insert(), missing)
    if bind.dialect.name == "postgresql":
        op.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}")
        # Past every id in use (single-chain ids were last_event_id + 1).
        op.execute(f"SELECT setval('{SEQUENCE}', (SELECT coalesce(max(event_id), 0) + 1 FROM undolog_approval_events), "
                   "false)")


def downgrade() -> None:
    bind = op.get_bind()
    used = bind.execute(sa.text("SELECT count(*) FROM undolog_approval_events WHERE chain <> 1")).scalar_one()
    if used:
        # Folding other chains back into one would rewrite hashes: an audit trail is never rewritten.
        raise RuntimeError(f"{used} audit events are in chains other than 1: this database cannot go back before "
                           "0009_audit_chains without rewriting its audit trail")
    if bind.dialect.name == "postgresql":
        op.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")
    bind.execute(s.audit_head.delete().where(s.audit_head.c.head_id > 1))
    op.drop_index("ix_undolog_events_chain", table_name="undolog_approval_events")
    # A plain ALTER TABLE ... DROP COLUMN on both (SQLite >= 3.35), never a table copy: a copy would drop the
    # append-only triggers with the old table.
    op.drop_column("undolog_approval_events", "chain")
