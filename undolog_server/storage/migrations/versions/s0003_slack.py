"""Approvals in Slack: channels per approver group, Slack users mapped to API keys, posts and the replay window.

Revision ID: s0003_slack
Revises: s0002_dashboard_sessions
"""

import sqlalchemy as sa
from alembic import op

from undolog_server.storage import UTCDateTime

revision = "s0003_slack"
down_revision = "s0002_dashboard_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "undolog_slack_channels",
        sa.Column("group_name", sa.String(100), primary_key=True),
        sa.Column("channel", sa.String(100), nullable=False),
        sa.Column("escalation_channel", sa.String(100), nullable=True),
        sa.Column("escalate_after_seconds", sa.Integer, nullable=True),
        sa.Column("sensitive", sa.JSON, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )
    op.create_table(
        "undolog_slack_users",
        # Slack's immutable ids: a display name or an email can change hands, these cannot.
        sa.Column("team_id", sa.String(32), primary_key=True),
        sa.Column("user_id", sa.String(32), primary_key=True),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=True),
    )
    op.create_table(
        "undolog_slack_posts",
        sa.Column("post_id", sa.String(40), primary_key=True),
        sa.Column("approval_request_id", sa.String(64), nullable=False),
        sa.Column("channel", sa.String(100), nullable=False),
        sa.Column("purpose", sa.String(20), nullable=False),
        sa.Column("ts", sa.JSON, nullable=False),
        sa.Column("shown_state", sa.String(20), nullable=True),
        sa.Column("dirty", sa.Boolean, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("locked_until", sa.Float, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        # One post per request and channel: a fan-out done twice (two servers, a retry) posts once.
        sa.UniqueConstraint("approval_request_id", "channel", name="uq_undolog_slack_posts_request_channel"),
    )
    op.create_index("ix_undolog_slack_posts_due", "undolog_slack_posts", ["next_attempt_at"])
    op.create_table(
        "undolog_slack_seen",
        sa.Column("signature_hash", sa.String(64), primary_key=True),
        sa.Column("seen_at", sa.Float, nullable=False),
    )
    op.create_index("ix_undolog_slack_seen_at", "undolog_slack_seen", ["seen_at"])


def downgrade() -> None:
    for name in ("undolog_slack_seen", "undolog_slack_posts", "undolog_slack_users", "undolog_slack_channels"):
        op.drop_table(name)
