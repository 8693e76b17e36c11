"""Approved calls expire: the states ``expired`` (effect and request) and the policy's ``approved_ttl_seconds``.

An IRREVERSIBLE call approved but not re-issued within ``approved_ttl_seconds`` (default 24 h) lapses: its request
and effect become ``expired`` and re-issuing the call raises a new request. Only CHECK constraints widen (no row
changes) and one column is added, so this is idempotent: 0001 builds some tables from ``storage/schema.py``, which a
fresh database therefore already has in their newest form.

Revision ID: 0005_approval_ttl
Revises: 0004_rollback_intent
"""

import re

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0005_approval_ttl"
down_revision = "0004_rollback_intent"
branch_labels = None
depends_on = None

# The states this revision knows: later revisions' states (0006's "responded") are theirs to add and remove.
_LATER = ("responded",)
_OLD_EFFECT_STATES = tuple(v for v in s.EFFECT_STATES if v != "expired")
_OLD_REQUEST_STATES = tuple(v for v in s.REQUEST_STATES if v not in ("expired", *_LATER))
_REQUEST_STATES = tuple(v for v in s.REQUEST_STATES if v not in _LATER)
_CHECKS = (
    ("undolog_effect_log", "ck_undolog_effect_state"),
    ("undolog_approval_requests", "ck_undolog_approval_state"),
)


def upgrade() -> None:
    bind = op.get_bind()
    columns = {c["name"] for c in sa.inspect(bind).get_columns("undolog_org_policy")}
    if "approved_ttl_seconds" not in columns:
        op.add_column("undolog_org_policy", sa.Column("approved_ttl_seconds", sa.Integer, nullable=False,
                                                      server_default=str(24 * 3600)))
    _set_checks(bind, s.EFFECT_STATES, _REQUEST_STATES)


def downgrade() -> None:
    bind = op.get_bind()
    # The older layout has no expired state: such a call is cancelled (it never ran, and its approval lapsed).
    bind.execute(sa.text("UPDATE undolog_effect_log SET state = 'cancelled' WHERE state = 'expired'"))
    bind.execute(sa.text("UPDATE undolog_approval_requests SET state = 'cancelled' WHERE state = 'expired'"))
    _set_checks(bind, _OLD_EFFECT_STATES, _OLD_REQUEST_STATES)
    with op.batch_alter_table("undolog_org_policy") as batch:
        batch.drop_column("approved_ttl_seconds")


def _check(states: tuple[str, ...]) -> str:
    return f"state IN ({', '.join(repr(v) for v in states)})"


def _set_checks(bind: sa.engine.Connection, effect_states: tuple[str, ...], request_states: tuple[str, ...]) -> None:
    wanted = dict(zip((name for _, name in _CHECKS), (_check(effect_states), _check(request_states)), strict=True))
    if bind.dialect.name == "postgresql":
        for table, name in _CHECKS:
            op.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}")
            op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({wanted[name]})")
        return
    # SQLite cannot alter a CHECK, and rebuilding the effect log (its rowid order, trigger, indexes and the foreign
    # keys into it) to widen one IN list would rewrite every row. SQLite documents this narrower way for a change
    # that leaves every stored row valid (https://www.sqlite.org/lang_altertable.html#otheralter): edit the table's
    # SQL text in the schema and bump schema_version, inside the migration's transaction.
    version = int(bind.exec_driver_sql("PRAGMA schema_version").scalar_one())
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        for table, name in _CHECKS:
            sql = bind.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                                       (table,)).scalar_one()
            new, n = re.subn(rf"(CONSTRAINT {name} CHECK \()state IN \([^)]*\)(\))", rf"\g<1>{wanted[name]}\g<2>", sql)
            if n != 1:
                raise RuntimeError(f"{table}: cannot find the CHECK {name} to widen in {sql!r}")
            if new != sql:
                bind.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", (new, table))
        bind.exec_driver_sql(f"PRAGMA schema_version = {version + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema = OFF")
    if bind.exec_driver_sql("PRAGMA integrity_check").scalar_one() != "ok":
        raise RuntimeError("the schema edit left the database inconsistent")
