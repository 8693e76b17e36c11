"""A requested rollback is durable: ``undolog_rollbacks`` and the session state ``rolling_back``.

Sessions that an older version left half rolled back (an undo entry ``compensating`` whose effect is settled, so it
was part of a session rollback, not recovery of one in-doubt call) get an intent with no owner, so the next
``recover()`` finishes their rollback.

Revision ID: 0004_rollback_intent
Revises: 0003_effect_seq
"""

import datetime as dt

import sqlalchemy as sa
from alembic import op

from undolog_core.storage import schema as s

revision = "0004_rollback_intent"
down_revision = "0003_effect_seq"
branch_labels = None
depends_on = None

_OLD_STATES = ("active", "awaiting_approval", "halted", "rolled_back", "completed")
_SESSION_COLS = (
    "session_id, agent_id, state, tool_calls_total, created_by, halted_reason, on_failure, pinned_revisions, "
    "created_at, updated_at"
)


def _states_check(states: tuple[str, ...]) -> str:
    return f"state IN ({', '.join(repr(v) for v in states)})"


def upgrade() -> None:
    bind = op.get_bind()
    _set_states_check(bind, s.SESSION_STATES)
    s.rollbacks.create(bind)
    now = dt.datetime.now(dt.UTC)
    interrupted = bind.execute(sa.text(
        "SELECT DISTINCT u.session_id FROM undolog_undo_stack u JOIN undolog_effect_log e ON e.seq = u.undo_id "
        "WHERE u.state = 'compensating' AND e.state NOT IN ('pending', 'running')"
    )).scalars().all()
    for session_id in interrupted:
        bind.execute(s.rollbacks.insert().values(
            session_id=session_id, actor="undolog:migration",
            reason="rollback interrupted before this version; finished by recovery", requested_at=now,
        ))
        bind.execute(s.sessions.update().where(s.sessions.c.session_id == session_id,
                                               s.sessions.c.state.notin_(("rolled_back", "completed")))
                     .values(state="rolling_back", updated_at=now))


def downgrade() -> None:
    bind = op.get_bind()
    now = dt.datetime.now(dt.UTC)
    # The older layout has no rolling_back: such a session is halted for a person (its intent is lost, its undo
    # entries are kept, so a later rollback resumes where it stopped).
    bind.execute(s.sessions.update().where(s.sessions.c.state == "rolling_back").values(
        state="halted", halted_reason="a rollback was in progress when the database was downgraded; roll back again",
        updated_at=now,
    ))
    s.rollbacks.drop(bind)
    _set_states_check(bind, _OLD_STATES)


def _set_states_check(bind: sa.engine.Connection, states: tuple[str, ...]) -> None:
    if bind.dialect.name == "postgresql":
        op.execute("ALTER TABLE undolog_sessions DROP CONSTRAINT ck_undolog_sessions_state")
        op.execute(f"ALTER TABLE undolog_sessions ADD CONSTRAINT ck_undolog_sessions_state CHECK ({_states_check(states)})")
        return
    # SQLite cannot change a CHECK in place: the table is made anew and put in place of the old one (foreign keys
    # are off for the migration and checked once it is done, see storage/migrate.py).
    tmp = sa.MetaData()
    new = s.sessions.to_metadata(tmp, name="undolog_sessions_new")
    for c in list(new.constraints):
        if isinstance(c, sa.CheckConstraint) and c.name == "ck_undolog_sessions_state":
            new.constraints.discard(c)
    new.append_constraint(sa.CheckConstraint(_states_check(states), name="ck_undolog_sessions_state"))
    # The table as it was at this revision: the sessions' indexes came later (0005 makes them), and names taken
    # by the old table's indexes would clash here.
    for ix in list(new.indexes):
        new.indexes.discard(ix)
    tmp.create_all(bind, tables=[new])
    op.execute(f"INSERT INTO undolog_sessions_new ({_SESSION_COLS}) SELECT {_SESSION_COLS} FROM undolog_sessions")
    op.execute("DROP TABLE undolog_sessions")
    op.execute("ALTER TABLE undolog_sessions_new RENAME TO undolog_sessions")
