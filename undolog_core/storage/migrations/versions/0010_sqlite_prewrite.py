"""SQLite: the pre-write writes the effect and its undo entry through a view, with the compensation given.

Until now an ``AFTER INSERT`` trigger on the effect log looked the compensation up in the tool registry and then
checked that the undo entry exists; per pre-write that is three b-tree lookups and a trigger program, about a
seventh of SQLite's CPU for the statement. The caller already holds the compensation of the tool revision it
checked (revisions are immutable), as PostgreSQL's one-statement pre-write takes it, so the pre-write now inserts
into ``undolog_prewrite``, a view whose ``INSTEAD OF`` trigger writes both rows in the same statement: the effect
only while its session accepts writes, the undo entry only if the effect was written. Every other insert into the
effect log (the general path, tests, tools) writes its undo entry itself, as on PostgreSQL.

The view selects no table, so later changes to the effect log never have to rebuild it. PostgreSQL: nothing.

Revision ID: 0010_sqlite_prewrite
Revises: 0009_audit_chains
"""

from alembic import op

from undolog_core.storage import schema as s

revision = "0010_sqlite_prewrite"
down_revision = "0009_audit_chains"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    op.execute("DROP TRIGGER IF EXISTS undolog_effect_undo_entry")
    op.execute(s.SQLITE_PREWRITE_VIEW)
    op.execute(s.SQLITE_PREWRITE_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    op.execute("DROP TRIGGER IF EXISTS undolog_prewrite_insert")
    op.execute("DROP VIEW IF EXISTS undolog_prewrite")
    op.execute(s.SQLITE_UNDO_TRIGGER)
