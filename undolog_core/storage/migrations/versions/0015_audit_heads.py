"""The audit chains' head rows fixed: chains 1..``AUDIT_CHAINS`` exist, and a trigger keeps them so.

A head row may only move forward: the trigger refuses an INSERT (a new chain: a chain 17 was a place to hide
backdated events), a DELETE, and an UPDATE that changes ``head_id`` or lowers ``last_event_id`` (a chain cut back).
That is defence in depth only: whoever can write the database can drop a trigger. The real check is
``verify --checkpoints`` (``_audit.verify``): every signed checkpoint names every chain, and an event at or below
a checkpoint's position outside its chain's signed range, or in a chain it does not name, is refused.

Idempotent: the missing head rows are created (0009 made them; a hand-made database may lack some), the trigger
is replaced if present. Both databases.

Revision ID: 0015_audit_heads
Revises: 0011_due_index
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0015_audit_heads"
down_revision = "0011_due_index"
branch_labels = None
depends_on = None

GENESIS_HASH = "0" * 64


def upgrade() -> None:
    bind = op.get_bind()
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
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS undolog_audit_head_guard ON undolog_audit_head")
        op.execute("DROP FUNCTION IF EXISTS undolog_audit_head_guard()")
    else:
        for name in s.SQLITE_AUDIT_HEAD_GUARDS:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
