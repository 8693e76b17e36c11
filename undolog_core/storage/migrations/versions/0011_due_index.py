"""The sweep's due index holds the pending requests only: ``ix_undolog_approval_due`` on ``timeout_at`` WHERE
``state = 'pending'`` replaces ``ix_undolog_approval_state_timeout`` on ``(state, timeout_at)``.

The sweep claims the oldest due pending requests (``store.approvals.due_claim``). The full index kept an entry for
every request in every state, and each state change (a timeout, a decision, a cancellation) added one more: an
index insertion per settled request that no query reads. The partial index takes an entry when a request is raised
and none when it is settled; the claim walks it in ``timeout_at`` order and stops at its batch. Both databases
(SQLite has partial indexes). Idempotent: 0001 builds the requests table from ``storage/schema.py``, so a new
database has the newest index already.

Revision ID: 0011_due_index
Revises: 0010_sqlite_prewrite
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0011_due_index"
down_revision = "0010_sqlite_prewrite"
branch_labels = None
depends_on = None

_TABLE = "undolog_approval_requests"
_NEW = "ix_undolog_approval_due"
_OLD = "ix_undolog_approval_state_timeout"


def _indexes() -> set[str]:
    return {ix["name"] for ix in sa.inspect(op.get_bind()).get_indexes(_TABLE) if ix["name"]}


def upgrade() -> None:
    have = _indexes()
    if _NEW not in have:
        where = sa.text(s.DUE_PREDICATE)
        op.create_index(_NEW, _TABLE, ["timeout_at"], sqlite_where=where, postgresql_where=where)
    if _OLD in have:
        op.drop_index(_OLD, table_name=_TABLE)


def downgrade() -> None:
    have = _indexes()
    if _OLD not in have:
        op.create_index(_OLD, _TABLE, ["state", "timeout_at"])
    if _NEW in have:
        op.drop_index(_NEW, table_name=_TABLE)
