"""Sessions held by a live process: ``undolog_session_owners``.

The MCP gateway holds a lease on each session it serves; a rollback asked elsewhere (the CLI, the desk) is filed
there for the owner to run against its live upstream connections, and run by the requester only once the owner's
lease is gone. Idempotent: the table is made only where it is missing, dropped only where it exists.

(Revision id as assigned for issue #31 part A, whose client idempotency keys were to share this revision.)

Revision ID: 0013_client_idempotency
Revises: 0011_due_index
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0013_client_idempotency"
down_revision = "0011_due_index"
branch_labels = None
depends_on = None

_TABLE = "undolog_session_owners"


def upgrade() -> None:
    bind = op.get_bind()
    if _TABLE not in sa.inspect(bind).get_table_names(schema=s.session_owners.schema):
        s.session_owners.create(bind)


def downgrade() -> None:
    bind = op.get_bind()
    if _TABLE in sa.inspect(bind).get_table_names(schema=s.session_owners.schema):
        s.session_owners.drop(bind)
