"""A session's owner is stored as the desk's principal reference ``key:<id>``: sessions the MCP gateway opened over
HTTP before this revision recorded ``"<name> (key <id>)"``, a form the desk's checks never compared, so a key
holding the agent and approver roles could approve its own IRREVERSIBLE requests. Those owners are rewritten here;
every other ``created_by`` (``key:<id>`` already, a free-text name from code) is left as it is.

Idempotent: a second run finds no owner in the old form. Downgrade keeps the rewritten owners (the old form held
the key's name, which the desk's own tables still hold; the old code reads ``key:<id>`` as an unknown principal,
which refuses nothing it should allow).

Revision ID: 0012_principal_refs
Revises: 0011_due_index
"""

import re

import sqlalchemy as sa
from alembic import op

revision = "0012_principal_refs"
down_revision = "0011_due_index"
branch_labels = None
depends_on = None

# The old gateway form: the key's name, then " (key <hex id>)". The name may hold anything, parentheses included;
# the id is the last "(key ...)". Kept here, not imported from undolog_server.identity: the core imports no server.
_OLD_OWNER = re.compile(r"^.* \(key ([0-9a-f]{1,64})\)$", re.DOTALL)
_CANDIDATES = sa.text("SELECT session_id, created_by FROM undolog_sessions WHERE created_by LIKE '% (key %)'")
_REWRITE = sa.text("UPDATE undolog_sessions SET created_by = :new WHERE session_id = :sid AND created_by = :old")


def upgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(_CANDIDATES).all()
    for session_id, owner in rows:
        m = _OLD_OWNER.match(owner or "")
        if m is None:
            continue
        bind.execute(_REWRITE, {"new": f"key:{m.group(1)}", "sid": session_id, "old": owner})


def downgrade() -> None:
    pass
