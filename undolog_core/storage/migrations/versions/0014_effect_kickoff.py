"""Each effect records its kickoff: ``undolog_effect_log.kickoff_id`` (nullable).

A framework whose runs mint new call ids every time (a CrewAI kickoff, a Semantic Kernel turn) cannot match a
repeated call by its id; a continuation of a run (``UndoLogToolset.resume``, ``UndoLogFilter.resume``) replays the
committed effects of the run it continues, found by this column, instead of running them again. Effects logged
outside such a run keep it NULL. One nullable column, no row changes; idempotent (added only when missing).

Revision ID: 0014_effect_kickoff
Revises: 0013_client_idempotency
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_effect_kickoff"
down_revision = "0013_client_idempotency"
branch_labels = None
depends_on = None

_TABLE = "undolog_effect_log"
_COLUMN = "kickoff_id"


def _columns() -> set[str]:
    return {c["name"] for c in sa.inspect(op.get_bind()).get_columns(_TABLE)}


def upgrade() -> None:
    if _COLUMN not in _columns():
        op.add_column(_TABLE, sa.Column(_COLUMN, sa.String(200), nullable=True))


def downgrade() -> None:
    if _COLUMN in _columns():
        # A plain DROP COLUMN on both databases (SQLite >= 3.35): a batch rebuild of the effect log would have to
        # carry its references and triggers across for one nullable column.
        op.execute(f"ALTER TABLE {_TABLE} DROP COLUMN {_COLUMN}")
