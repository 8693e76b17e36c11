"""The audit chains' head rows fixed: chains 1..``AUDIT_CHAINS`` exist, and a trigger keeps them so; and the
effect log's ownership epoch (``epoch``), the fencing token a call's tool passes upstream.

A head row may only move forward: the trigger refuses an INSERT (a new chain: a chain 17 was a place to hide
backdated events), a DELETE, and an UPDATE that changes ``head_id`` or lowers ``last_event_id`` (a chain cut back).
That is defence in depth only: whoever can write the database can drop a trigger. The real check is
``verify --checkpoints`` (``_audit.verify``): every signed checkpoint names every chain, and an event at or below
a checkpoint's position outside its chain's signed range, or in a chain it does not name, is refused.

``undolog_effect_log.epoch`` (INTEGER NOT NULL DEFAULT 1): 1 at the pre-write, one more at every claim of the call
(an approved call claimed to run, a released call re-claimed, recovery taking it over). Added with a constant
default (a catalog change on both databases, no table copy); every call logged before it reads as epoch 1.

Idempotent: the missing head rows are created (0009 made them; a hand-made database may lack some), the trigger
is replaced if present, the column added only when missing. Both databases.

Revision ID: 0015_audit_heads
Revises: 0014_effect_kickoff
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0015_audit_heads"
down_revision = "0014_effect_kickoff"
branch_labels = None
depends_on = None

GENESIS_HASH = "0" * 64


def upgrade() -> None:
    bind = op.get_bind()
    # 0001 builds the effect log from storage/schema.py, so a new database has the column already.
    if "epoch" not in {c["name"] for c in sa.inspect(bind).get_columns("undolog_effect_log")}:
        op.add_column("undolog_effect_log", sa.Column("epoch", sa.Integer, nullable=False, server_default="1"))
    have = set(bind.execute(sa.select(s.audit_head.c.head_id)).scalars())
    missing = [{"head_id": i, "last_event_id": 0, "last_hash": GENESIS_HASH}
               for i in range(1, s.AUDIT_CHAINS + 1) if i not in have]
    if missing:
        bind.execute(s.audit_head.insert(), missing)
    if bind.dialect.name == "postgresql":
        op.execute(s.PG_AUDIT_HEAD_GUARD_FUNCTION)
        op.execute("DROP TRIGGER IF EXISTS undolog_audit_head_guard ON undolog_audit_head")
        op.execute(s.PG_AUDIT_HEAD_GUARD_TRIGGER)
    else:
        for name, sql in s.SQLITE_AUDIT_HEAD_GUARDS.items():
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
            op.execute(sql)


def downgrade() -> None:
    bind = op.get_bind()
    if "epoch" in {c["name"] for c in sa.inspect(bind).get_columns("undolog_effect_log")}:
        # A plain ALTER TABLE ... DROP COLUMN on both (SQLite >= 3.35), never a table copy.
        op.drop_column("undolog_effect_log", "epoch")
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS undolog_audit_head_guard ON undolog_audit_head")
        op.execute("DROP FUNCTION IF EXISTS undolog_audit_head_guard()")
    else:
        for name in s.SQLITE_AUDIT_HEAD_GUARDS:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
