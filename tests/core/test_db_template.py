"""The session's migrated template gives each test exactly the database a real migration makes.

``tests/support/db_template.py`` migrates once per session and copies (SQLite) or replays (PostgreSQL) the result
into each test's database. If the copy differed from a real ``UndoLog.open`` on an empty database (a table, an
index, a constraint, a trigger, a sequence or a seeded row missing or different), every test would silently run
against a schema nobody ships; this compares the two, object by object and row by row, for both flavours.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import UndoLog
from undolog_core.testing import internals
from undolog_server.storage import ServerStore

from ..conftest import PG_URL, TEST_DB, Db

# Volatile values a real migration stamps (when it ran); everything else must match exactly.
VOLATILE_COLUMNS = {"updated_at", "created_at", "registered_at"}

PG_CATALOG = {
    "columns": "SELECT table_name, column_name, data_type, character_maximum_length, is_nullable, column_default "
               "FROM information_schema.columns WHERE table_schema = :s",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = :s",
    "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
                   "WHERE connamespace = (SELECT oid FROM pg_namespace WHERE nspname = :s)",
    "triggers": "SELECT event_object_table, trigger_name, event_manipulation, action_statement "
                "FROM information_schema.triggers WHERE trigger_schema = :s",
    "functions": "SELECT proname, prosrc FROM pg_proc WHERE pronamespace = (SELECT oid FROM pg_namespace "
                 "WHERE nspname = :s)",
    "sequences": "SELECT sequencename, last_value, increment_by FROM pg_sequences WHERE schemaname = :s",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = :s",
}


def _rows(conn: Any, table: str) -> list[tuple[Any, ...]]:
    cols = [c for c in sa.inspect(conn).get_columns(table) if c["name"] not in VOLATILE_COLUMNS]
    names = ", ".join(f'"{c["name"]}"' for c in cols)
    return sorted(tuple(r) for r in conn.exec_driver_sql(f'SELECT {names} FROM "{table}"'))


def _snapshot(u: UndoLog, schema: str | None) -> dict[str, Any]:
    snap: dict[str, Any] = {}
    with internals(u).read() as conn:
        if internals(u).is_postgres:
            for what, sql in PG_CATALOG.items():
                rows = conn.execute(sa.text(sql), {"s": schema}).all()
                # The schema's own name appears in definitions (index, default, trigger): it is the one difference.
                snap[what] = sorted(tuple(str(v).replace(str(schema), "<schema>") for v in r) for r in rows)
        else:
            snap["objects"] = sorted(tuple(r) for r in conn.exec_driver_sql(
                "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
        tables = sorted(sa.inspect(conn).get_table_names())
        snap["rows"] = {t: _rows(conn, t) for t in tables}
    return snap


@pytest.mark.parametrize("flavour", ["core", "server"])
def test_a_copy_of_the_template_is_what_a_real_migration_makes(
    db: Db, tmp_path: Path, pg_admin: Any, flavour: str
) -> None:
    if TEST_DB == "postgres":
        real = Db("postgres", PG_URL, "t_" + uuid.uuid4().hex[:16])
    else:
        real = Db("sqlite", f"sqlite:///{tmp_path / 'real.db'}", None)
    db.flavour = flavour
    try:
        assert db.templates is not None
        copied = db.open()  # from the template
        assert db.materialize() is False  # a database is there now: never copied over
        migrated = real.open()  # the real migrations, on an empty database
        if flavour == "server":
            assert ServerStore(copied.store).migrate() is False  # the template has the desk's tables at head
            assert ServerStore(migrated.store).migrate() is True
        got, want = _snapshot(copied, db.schema), _snapshot(migrated, real.schema)
        assert got.keys() == want.keys()
        for what in want:
            assert got[what] == want[what], what
        assert want["rows"]["undolog_alembic_version"]  # the comparison saw the seeded rows
    finally:
        for u in real.opened:
            u.close()
        if real.schema:
            with pg_admin.connect() as c:
                c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{real.schema}" CASCADE')


def test_an_open_without_migrations_or_of_an_existing_database_is_not_served_from_the_template(db: Db) -> None:
    u = db.open(migrate=False)
    with internals(u).read() as conn:
        assert "undolog_sessions" not in sa.inspect(conn).get_table_names()  # still empty: nothing was copied


def test_templates_built_from_several_threads_at_once_serve_every_clone(tmp_path: Path, pg_admin: Any) -> None:
    """CI (PostgreSQL): after two recordings overlapped in one worker, each had recorded both migrations, and every
    later clone in that worker replayed the other template's statements unrenamed ("no schema has been selected to
    create in": 83 errors). Templates are now built by one thread at a time, and a recording keeps only its own
    thread's statements; threads then clone at once."""
    import threading

    from ..support.db_template import PostgresTemplates, SQLiteTemplates

    templates: Any = (PostgresTemplates(PG_URL, pg_admin) if TEST_DB == "postgres"
                      else SQLiteTemplates(tmp_path / "tpl"))
    if TEST_DB != "postgres":
        (tmp_path / "tpl").mkdir()
    targets = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(6)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def clone(i: int, target: str) -> None:
        try:
            start.wait()
            flavour = ("core", "server")[i % 2]
            if TEST_DB == "postgres":
                assert templates.clone_to(target, flavour)
            else:
                assert templates.copy_to(tmp_path / f"{target}.db", flavour)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=clone, args=(i, t)) for i, t in enumerate(targets)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors
        for i, target in enumerate(targets):
            if TEST_DB == "postgres":
                u = UndoLog.open(PG_URL, schema=target, migrate=False)
            else:
                u = UndoLog.open(f"sqlite:///{tmp_path / f'{target}.db'}", migrate=False)
            try:
                with internals(u).read() as conn:
                    tables = set(sa.inspect(conn).get_table_names())
                assert "undolog_effect_log" in tables
                assert ("undolog_server_alembic_version" in tables) == (i % 2 == 1), sorted(tables)
            finally:
                u.close()
    finally:
        if TEST_DB == "postgres":
            templates.dispose()
            with pg_admin.connect() as c:
                for target in targets:
                    c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{target}" CASCADE')
