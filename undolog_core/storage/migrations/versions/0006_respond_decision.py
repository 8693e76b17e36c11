"""A person may answer in the tool's place: the approval request state ``responded`` (decision ``respond``).

Only the CHECK on ``undolog_approval_requests.state`` changes. PostgreSQL swaps the constraint; SQLite cannot change
a CHECK in place, so the table is made anew with the same rows (foreign keys are off for the migration and checked
once it is done, see storage/migrate.py).

Revision ID: 0006_respond_decision
Revises: 0005_approval_ttl
"""

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0006_respond_decision"
down_revision = "0005_approval_ttl"
branch_labels = None
depends_on = None

_OLD_STATES = ("pending", "approved", "rejected", "timed_out", "auto_approved", "cancelled", "expired")
_CHECK = "ck_undolog_approval_state"


def upgrade() -> None:
    _set_states_check(op.get_bind(), s.REQUEST_STATES)


def downgrade() -> None:
    bind = op.get_bind()
    # The older layout has no responded: such a request reads as cancelled (its effect already is; the response
    # stays in the effect's result and in the audit trail).
    bind.execute(s.approval_requests.update().where(s.approval_requests.c.state == "responded")
                 .values(state="cancelled"))
    _set_states_check(bind, _OLD_STATES)


def _states_check(states: tuple[str, ...]) -> str:
    return f"state IN ({', '.join(repr(v) for v in states)})"


def _set_states_check(bind: sa.engine.Connection, states: tuple[str, ...]) -> None:
    if bind.dialect.name == "postgresql":
        op.execute(f"ALTER TABLE undolog_approval_requests DROP CONSTRAINT {_CHECK}")
        op.execute(f"ALTER TABLE undolog_approval_requests ADD CONSTRAINT {_CHECK} CHECK ({_states_check(states)})")
        return
    tmp = sa.MetaData()
    s.effect_log.to_metadata(tmp)  # the name the foreign key refers to
    s.sessions.to_metadata(tmp)
    new = s.approval_requests.to_metadata(tmp, name="undolog_approval_requests_new")
    new.indexes.clear()  # made on the final name below (copies would clash with the old table's index names)
    for c in list(new.constraints):
        if isinstance(c, sa.CheckConstraint) and c.name == _CHECK:
            new.constraints.discard(c)
    new.append_constraint(sa.CheckConstraint(_states_check(states), name=_CHECK))
    tmp.create_all(bind, tables=[new])
    cols = ", ".join(c.name for c in s.approval_requests.columns)
    op.execute(f"INSERT INTO undolog_approval_requests_new ({cols}) SELECT {cols} FROM undolog_approval_requests")
    op.execute("DROP TABLE undolog_approval_requests")
    op.execute("ALTER TABLE undolog_approval_requests_new RENAME TO undolog_approval_requests")
    for index in s.approval_requests.indexes:
        index.create(bind)
