"""The audit actor has room for UndoLog's own prefix: ``agent:<session id>`` with a session id at the one length
rule's limit (200, ``undolog_core.limits.MAX_ID_LENGTH``) did not fit PostgreSQL's ``VARCHAR(200)``.

SQLite does not enforce ``VARCHAR`` lengths, so only PostgreSQL changes (widening a varchar is a catalog change).

Revision ID: 0007_identity_widths
Revises: 0006_respond_decision
"""

from alembic import op

revision = "0007_identity_widths"
down_revision = "0006_respond_decision"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE undolog_approval_events ALTER COLUMN actor TYPE VARCHAR(300)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Refused by PostgreSQL if a longer actor is stored: such a database cannot go back without losing it.
        op.execute("ALTER TABLE undolog_approval_events ALTER COLUMN actor TYPE VARCHAR(200)")
