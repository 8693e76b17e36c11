"""Server-side dashboard login sessions: the cookie names a row, so logout (or a revoked key) ends it for good.

Revision ID: s0002_dashboard_sessions
Revises: s0001_server_tables
"""

import sqlalchemy as sa
from alembic import op

from undolog_server.storage import UTCDateTime

revision = "s0002_dashboard_sessions"
down_revision = "s0001_server_tables"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "undolog_dashboard_sessions",
        # A hash of the cookie's random token: the database never holds a usable cookie.
        sa.Column("session_hash", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime, nullable=True),
    )
    op.create_index("ix_undolog_dashboard_sessions_expires", "undolog_dashboard_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_table("undolog_dashboard_sessions")
