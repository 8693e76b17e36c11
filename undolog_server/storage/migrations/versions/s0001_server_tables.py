"""The approval desk's tables: API keys, approver groups, webhooks, policies, deliveries, escalations, settings.

Until the server became its own package, the core's ``0002_server`` revision created these same tables. That
revision is now a frozen no-op in the core's chain, so a database migrated before the move already has them,
full of keys, targets and deliveries: each table is created here only when it does not exist yet, and an
existing one is left exactly as it is (nothing is dropped, copied or rewritten). Downgrading this revision
keeps the tables for the same reason: their data may predate it.

Revision ID: s0001_server_tables
Revises: (root of the server's branch)
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

from undolog_server.storage import UTCDateTime

revision = "s0001_server_tables"
down_revision = None
branch_labels = ("undolog_server",)
depends_on = None


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())

    def create(name: str, *columns: Any) -> bool:
        if name in existing:
            return False
        op.create_table(name, *columns)
        return True

    create(
        "undolog_api_keys",
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("roles", sa.JSON, nullable=False),
        sa.Column("groups", sa.JSON, nullable=False),
        # Only a hash of the secret is kept: the token is shown once at creation.
        sa.Column("secret_hash", sa.String(128), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=True),
        sa.Column("revoked_at", UTCDateTime, nullable=True),
        sa.Column("last_used_at", UTCDateTime, nullable=True),
    )
    create(
        "undolog_approver_groups",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("description", sa.Text, nullable=True),
        sa.Column("tools", sa.JSON, nullable=False),
        sa.Column("risk_tags", sa.JSON, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )
    create(
        "undolog_webhook_targets",
        sa.Column("target_id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("secret", sa.String(200), nullable=False),
        sa.Column("event_types", sa.JSON, nullable=False),
        sa.Column("active", sa.Boolean, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    create(
        "undolog_notification_policies",
        sa.Column("risk_tag", sa.String(100), primary_key=True),
        sa.Column("notify", sa.JSON, nullable=False),
        sa.Column("escalate_after_seconds", sa.Integer, nullable=True),
        sa.Column("escalate_to", sa.JSON, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )
    if create(
        "undolog_webhook_deliveries",
        sa.Column("delivery_id", sa.String(40), primary_key=True),
        sa.Column("event_id", sa.String(200), nullable=False),
        sa.Column("target_id", sa.String(40), nullable=False),
        sa.Column("event_type", sa.String(100), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("locked_until", sa.Float, nullable=True),
        sa.Column("last_status_code", sa.Integer, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("delivered_at", UTCDateTime, nullable=True),
        # One delivery per (event, target): fan-out by two servers cannot double-send.
        sa.UniqueConstraint("event_id", "target_id", name="uq_undolog_webhook_deliveries_event_target"),
    ):
        op.create_index(
            "ix_undolog_webhook_deliveries_due", "undolog_webhook_deliveries", ["status", "next_attempt_at"]
        )
    create(
        "undolog_escalations",
        sa.Column("approval_request_id", sa.String(64), primary_key=True),
        sa.Column("risk_tag", sa.String(100), primary_key=True),
        sa.Column("escalated_at", UTCDateTime, nullable=False),
    )
    create(
        "undolog_server_settings",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def downgrade() -> None:
    # Deliberately keeps the tables: they may hold data written before this branch existed (see above).
    pass
