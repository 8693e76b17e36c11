"""Effects clustered in write order; undo entries keyed by their effect; recovery cursor on SQLite.

- ``undolog_effect_log`` gets ``seq``, its primary key (the rowid on SQLite); ``effect_id`` stays unique.
- An undo entry's ``undo_id`` is its effect's ``seq``. Existing undo ids are kept as they are (compensations
  already called with ``Idempotency-Key: undo-{undo_id}`` must see the same key on a retry): an effect with an
  undo entry takes that entry's id as its seq, the others are numbered after the highest undo id.
- The undo stack loses its effect_id and session indexes (reached through the effect log instead) and gains
  a partial index of entries being compensated.
- The in-flight index stays on PostgreSQL only; SQLite gets ``undolog_recovery_cursor`` (see ``storage/schema.py``).
- SQLite: a trigger writes a COMPENSABLE effect's undo entry, so the pre-write is one statement (see ``storage/schema.py``).

Revision ID: 0003_effect_seq
Revises: 0002_server
"""

from typing import Any

import sqlalchemy as sa
from alembic import context, op
from alembic.script import ScriptDirectory

from undolog_core.storage import schema as s

revision = "0003_effect_seq"
down_revision = "0002_server"
branch_labels = None
depends_on = None

_EFFECT_COLS = (
    "effect_id, session_id, call_id, tool_name, tool_revision, tier, state, args_snapshot, args_digest, "
    "result_snapshot, error, owner, lease_until, recovery_attempts, released_from, created_at, updated_at"
)
_UNDO_COLS = (
    "undo_id, effect_id, session_id, compensation_name, compensation_version, args_snapshot, state, attempts, "
    "last_error, owner, lease_until, created_at, updated_at"
)
# seq for every existing effect: its undo entry's id, or a number after the highest undo id, in write order.
_SEQ_OF = """
SELECT e.effect_id AS effect_id,
       COALESCE(u.undo_id,
                (SELECT COALESCE(MAX(undo_id), 0) FROM undolog_undo_stack)
                + ROW_NUMBER() OVER (PARTITION BY u.undo_id IS NULL ORDER BY e.created_at, e.effect_id)) AS seq
FROM undolog_effect_log e LEFT JOIN undolog_undo_stack u ON u.effect_id = e.effect_id
"""
_IN_FLIGHT_INDEX_V1 = (
    "CREATE INDEX ix_undolog_effect_in_flight ON undolog_effect_log (state) WHERE state IN ('pending', 'running')"
)
_UNDO_SESSION_INDEX_V1 = "CREATE INDEX ix_undolog_undo_session ON undolog_undo_stack (session_id, undo_id)"
_COMPENSATING_INDEX = (
    "CREATE INDEX ix_undolog_undo_compensating ON undolog_undo_stack (state) WHERE state = 'compensating'"
)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        _upgrade_postgresql(bind)
    else:
        _upgrade_sqlite(bind)
    s.recovery_cursor.create(bind)
    bind.execute(s.recovery_cursor.insert().values(cursor_id=1, effect_seq=0, version=0))


def _upgrade_sqlite(bind: sa.engine.Connection) -> None:
    _rebuild_sqlite(
        bind, s.effect_log, s.undo_stack,
        effect_rows=(
            f"(seq, {_EFFECT_COLS}) SELECT n.seq, {', '.join('e.' + c.strip() for c in _EFFECT_COLS.split(','))} "
            f"FROM undolog_effect_log e JOIN ({_SEQ_OF}) n ON n.effect_id = e.effect_id"
        ),
        after=(_COMPENSATING_INDEX, s.SQLITE_UNDO_TRIGGER),
    )


def _rebuild_sqlite(
    bind: sa.engine.Connection, effect_log: sa.Table, undo_stack: sa.Table, *, effect_rows: str, after: tuple[str, ...]
) -> None:
    """SQLite cannot change a primary key in place: both tables are made anew with the given layout, filled, and
    put in place of the old ones (foreign keys are off for the migration and checked once it is done, see
    _migrate). The old effect log's trigger goes with it."""
    tmp = sa.MetaData()
    s.sessions.to_metadata(tmp)
    effect_log.to_metadata(tmp)  # the name the new undo stack's foreign key refers to
    effects = effect_log.to_metadata(tmp, name="undolog_effect_log_new")
    undo = undo_stack.to_metadata(tmp, name="undolog_undo_stack_new")
    for table in (effects, undo):
        table.indexes.clear()  # made on the final names (copies would clash with the old tables' names)
    tmp.create_all(bind, tables=[effects, undo])
    op.execute(f"INSERT INTO undolog_effect_log_new {effect_rows}")
    op.execute(f"INSERT INTO undolog_undo_stack_new ({_UNDO_COLS}) SELECT {_UNDO_COLS} FROM undolog_undo_stack")
    op.execute("DROP TABLE undolog_undo_stack")
    op.execute("DROP TABLE undolog_effect_log")
    op.execute("ALTER TABLE undolog_effect_log_new RENAME TO undolog_effect_log")
    op.execute("ALTER TABLE undolog_undo_stack_new RENAME TO undolog_undo_stack")
    for statement in after:
        op.execute(statement)


def _upgrade_postgresql(bind: sa.engine.Connection) -> None:
    referencing = _referencing(bind)
    for table, fk in referencing:
        op.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{fk["name"]}"')
    op.execute("ALTER TABLE undolog_effect_log ADD COLUMN seq BIGINT")
    op.execute(f"UPDATE undolog_effect_log e SET seq = n.seq FROM ({_SEQ_OF}) n WHERE n.effect_id = e.effect_id")
    op.execute("ALTER TABLE undolog_effect_log ALTER COLUMN seq SET NOT NULL")
    op.execute("ALTER TABLE undolog_effect_log DROP CONSTRAINT undolog_effect_log_pkey")
    op.execute("ALTER TABLE undolog_effect_log ADD CONSTRAINT undolog_effect_log_pkey PRIMARY KEY (seq)")
    op.execute("ALTER TABLE undolog_effect_log ADD CONSTRAINT undolog_effect_log_effect_id_key UNIQUE (effect_id)")
    op.execute("CREATE SEQUENCE undolog_effect_log_seq_seq OWNED BY undolog_effect_log.seq")
    op.execute(
        "SELECT setval('undolog_effect_log_seq_seq', COALESCE((SELECT MAX(seq) FROM undolog_effect_log), 1), "
        "(SELECT COUNT(*) > 0 FROM undolog_effect_log))"
    )
    op.execute("ALTER TABLE undolog_effect_log ALTER COLUMN seq SET DEFAULT nextval('undolog_effect_log_seq_seq')")
    _add_foreign_keys(referencing)
    op.execute("ALTER TABLE undolog_undo_stack DROP CONSTRAINT undolog_undo_stack_effect_id_key")
    op.execute("DROP INDEX ix_undolog_undo_session")
    op.execute("ALTER TABLE undolog_undo_stack ALTER COLUMN undo_id DROP DEFAULT")
    op.execute("DROP SEQUENCE IF EXISTS undolog_undo_stack_undo_id_seq")
    op.execute("ALTER TABLE undolog_undo_stack ALTER COLUMN undo_id TYPE BIGINT")
    op.execute(_COMPENSATING_INDEX)


def downgrade() -> None:
    # Back to 0001's layout, every effect id and undo id kept; the write order (seq) is dropped.
    bind = op.get_bind()
    s.recovery_cursor.drop(bind)
    if bind.dialect.name == "postgresql":
        _downgrade_postgresql(bind)
    else:
        _downgrade_sqlite(bind)


def _downgrade_sqlite(bind: sa.engine.Connection) -> None:
    v1 = ScriptDirectory.from_config(context.config).get_revision("0001_core").module
    _rebuild_sqlite(
        bind, v1._effect_log_v1, v1._undo_stack_v1,
        effect_rows=f"({_EFFECT_COLS}) SELECT {_EFFECT_COLS} FROM undolog_effect_log",
        after=(_IN_FLIGHT_INDEX_V1, _UNDO_SESSION_INDEX_V1),
    )


def _downgrade_postgresql(bind: sa.engine.Connection) -> None:
    referencing = _referencing(bind)
    for table, fk in referencing:
        op.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{fk["name"]}"')
    op.execute("ALTER TABLE undolog_effect_log DROP CONSTRAINT undolog_effect_log_pkey")
    op.execute("ALTER TABLE undolog_effect_log DROP CONSTRAINT undolog_effect_log_effect_id_key")
    op.execute("ALTER TABLE undolog_effect_log ADD CONSTRAINT undolog_effect_log_pkey PRIMARY KEY (effect_id)")
    op.execute("ALTER TABLE undolog_effect_log DROP COLUMN seq")  # and the sequence it owns
    _add_foreign_keys(referencing)
    op.execute("DROP INDEX ix_undolog_undo_compensating")
    op.execute("ALTER TABLE undolog_undo_stack ALTER COLUMN undo_id TYPE INTEGER")
    op.execute("CREATE SEQUENCE undolog_undo_stack_undo_id_seq AS INTEGER OWNED BY undolog_undo_stack.undo_id")
    op.execute(
        "SELECT setval('undolog_undo_stack_undo_id_seq', COALESCE((SELECT MAX(undo_id) FROM undolog_undo_stack), 1), "
        "(SELECT COUNT(*) > 0 FROM undolog_undo_stack))"
    )
    op.execute(
        "ALTER TABLE undolog_undo_stack ALTER COLUMN undo_id SET DEFAULT nextval('undolog_undo_stack_undo_id_seq')"
    )
    op.execute("ALTER TABLE undolog_undo_stack ADD CONSTRAINT undolog_undo_stack_effect_id_key UNIQUE (effect_id)")
    op.execute(_UNDO_SESSION_INDEX_V1)


def _referencing(bind: sa.engine.Connection) -> list[tuple[str, Any]]:
    """Foreign keys to effect_log(effect_id): they hang on its key's index, so they are dropped and made again."""
    inspector = sa.inspect(bind)
    return [
        (table, fk)
        for table in inspector.get_table_names()
        for fk in inspector.get_foreign_keys(table)
        if fk["referred_table"] == "undolog_effect_log"
    ]


def _add_foreign_keys(referencing: list[tuple[str, Any]]) -> None:
    for table, fk in referencing:
        cols = ", ".join(fk["constrained_columns"])
        refs = ", ".join(fk["referred_columns"])
        op.execute(
            f'ALTER TABLE {table} ADD CONSTRAINT "{fk["name"]}" FOREIGN KEY ({cols}) '
            f"REFERENCES undolog_effect_log ({refs})"
        )
