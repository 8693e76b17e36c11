"""Sessions held by a live process (``undolog_session_owners``), and client idempotency keys unique beyond a
session (``ux_undolog_effect_client_key``: a partial unique index on the effect log's ``call_id`` for ids
``ck:...``, enforced by the pre-write's own insert).

The MCP gateway holds a lease on each session it serves; a rollback asked elsewhere (the CLI, the desk) is filed
there for the owner to run against its live upstream connections, and run by the requester only once the owner's
lease is gone. Idempotent: the table is made only where it is missing, dropped only where it exists.

Revision ID: 0013_client_idempotency
Revises: 0012_principal_refs
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0013_client_idempotency"
down_revision = "0012_principal_refs"
branch_labels = None
depends_on = None

_TABLE = "undolog_session_owners"
_INDEX = "ux_undolog_effect_client_key"
_EFFECTS = "undolog_effect_log"


def _indexes() -> set[str]:
    return {ix["name"] for ix in sa.inspect(op.get_bind()).get_indexes(_EFFECTS) if ix["name"]}


def upgrade() -> None:
    bind = op.get_bind()
    if _TABLE not in sa.inspect(bind).get_table_names(schema=s.session_owners.schema):
        s.session_owners.create(bind)
    if _INDEX not in _indexes():
        where = sa.text(s.CLIENT_KEY_PREDICATE)
        op.create_index(_INDEX, _EFFECTS, ["call_id"], unique=True, sqlite_where=where, postgresql_where=where)


def downgrade() -> None:
    bind = op.get_bind()
    if _INDEX in _indexes():
        op.drop_index(_INDEX, table_name=_EFFECTS)
    if _TABLE in sa.inspect(bind).get_table_names(schema=s.session_owners.schema):
        s.session_owners.drop(bind)
