"""Email approvals: approver addresses, per-group mail settings, link tokens and the mail outbox.

Revision ID: s0004_email_approvals
Revises: s0003_slack
"""

import sqlalchemy as sa
from alembic import op

from undolog_server.storage import UTCDateTime

revision = "s0004_email_approvals"
down_revision = "s0003_slack"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "undolog_email_approvers",
        sa.Column("address", sa.String(320), primary_key=True),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=True),
    )
    op.create_index("ix_undolog_email_approvers_key", "undolog_email_approvers", ["key_id"])
    op.create_table(
        "undolog_email_groups",
        sa.Column("group_name", sa.String(100), primary_key=True),
        sa.Column("include_arguments", sa.Boolean, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )
    op.create_table(
        "undolog_email_tokens",
        sa.Column("token_id", sa.String(40), primary_key=True),
        sa.Column("approval_request_id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("address", sa.String(320), nullable=False),
        sa.Column("action_digest", sa.String(128), nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("used_at", UTCDateTime, nullable=True),
        sa.Column("void_at", UTCDateTime, nullable=True),
        sa.Column("void_reason", sa.String(200), nullable=True),
        sa.Column("code_nonce", sa.String(40), nullable=True),
        sa.Column("code_expires_at", UTCDateTime, nullable=True),
        sa.Column("codes_sent", sa.Integer, nullable=False),
        sa.Column("code_attempts", sa.Integer, nullable=False),
        sa.Column("grant_hash", sa.String(64), nullable=True),
        sa.UniqueConstraint("approval_request_id", "address", name="uq_undolog_email_tokens_request_address"),
    )
    op.create_table(
        "undolog_email_outbox",
        sa.Column("message_id", sa.String(40), primary_key=True),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("dedupe", sa.String(200), nullable=False, unique=True),
        sa.Column("approval_request_id", sa.String(64), nullable=False),
        sa.Column("token_id", sa.String(40), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("locked_until", sa.Float, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("sent_at", UTCDateTime, nullable=True),
    )
    op.create_index("ix_undolog_email_outbox_due", "undolog_email_outbox", ["status", "next_attempt_at"])


def downgrade() -> None:
    for name in ("undolog_email_outbox", "undolog_email_tokens", "undolog_email_groups",
                 "undolog_email_approvers"):
        op.drop_table(name)
