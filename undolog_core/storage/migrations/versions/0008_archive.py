"""`undolog gc`'s archive table, and the indexes that keep the lists fast in a large store.

``undolog_archive`` holds the effects and undo entries gc moved out of the live tables (each row as JSON).
Indexes: sessions newest first (the sessions lists) and requests by state newest first (the approval queue).
None on the sessions' state and age for gc: the pre-write that carries a session's call count updates
``updated_at``, and an index on it would cost that hot statement an index update.

Revision ID: 0008_archive
Revises: 0007_identity_widths
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0008_archive"
down_revision = "0007_identity_widths"
branch_labels = None
depends_on = None

_INDEXES = (
    ("ix_undolog_sessions_created", "undolog_sessions", ["created_at", "session_id"]),
    ("ix_undolog_approval_state_created", "undolog_approval_requests", ["state", "created_at"]),
)


def upgrade() -> None:
    bind = op.get_bind()
    # 0001 builds the sessions and requests tables from storage/schema.py, so on a new database their indexes
    # exist already; on an older one they are made here.
    if not sa.inspect(bind).has_table("undolog_archive"):
        s.archive.create(bind)
    for name, table, cols in _INDEXES:
        if name not in {ix["name"] for ix in sa.inspect(bind).get_indexes(table)}:
            op.create_index(name, table, cols)


def downgrade() -> None:
    for name, table, _ in _INDEXES:
        op.drop_index(name, table_name=table)
    # The archive is dropped with what it holds: archived rows are not moved back into the live tables.
    op.drop_table("undolog_archive")
