"""Frozen: the approval desk's tables, before the desk became its own package.

This revision used to create the server's tables (API keys, approver groups, webhooks, policies, deliveries,
escalations, settings). They now belong to the server's own migration branch
(``undolog_server/storage/migrations``, revision ``s0001_server_tables``), which creates each one only if it does not
exist. The revision keeps its id so every database already past it (and ``0003_effect_seq``, which revises
it) stays on one chain; it no longer does anything, in either direction: a database migrated before the move
keeps its server tables and their rows untouched, and a new one gets them when the server migrates.

Revision ID: 0002_server
Revises: 0001_core
"""

revision = "0002_server"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
