"""A database that will not open is an ``UndoLogError`` whose first line names the URL (password masked) and the fix.

Before: raw SQLAlchemy/driver errors came out of ``UndoLog.open``, with the URL nowhere and nothing to do.
Real databases: a file that is not a SQLite database, the PostgreSQL server here asked for a database it does not
have, and a port nothing listens on.
"""

from __future__ import annotations

import pytest

from undolog_core import UndoLog, errors

pytestmark = pytest.mark.storage


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0]


def test_a_sqlite_file_that_is_not_a_database(tmp_path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a database, but a long enough text to be read as a header " * 20)
    url = f"sqlite:///{path}"
    with pytest.raises(errors.DatabaseOpenFailed) as raised:
        UndoLog.open(url)
    first = _first_line(raised.value)
    assert url in first and f"check that {path} is a SQLite database" in first
    assert isinstance(raised.value, errors.UndoLogError) and raised.value.code == "database_open_failed"
    assert "the database said:" in str(raised.value) and "not a database" in str(raised.value)
    assert path.read_text().startswith("not a database")  # nothing written over it


def test_a_postgres_database_that_does_not_exist_names_the_url_without_its_password() -> None:
    url = "postgresql+psycopg://postgres:s3cret-pw@127.0.0.1:5432/undolog_no_such_db"
    with pytest.raises(errors.DatabaseOpenFailed) as raised:
        UndoLog.open(url)
    first = _first_line(raised.value)
    assert "s3cret-pw" not in str(raised.value) and "postgres:***@127.0.0.1:5432/undolog_no_such_db" in first
    assert "no such database" in first


def test_a_port_nothing_listens_on() -> None:
    with pytest.raises(errors.DatabaseOpenFailed) as raised:
        UndoLog.open("postgresql+psycopg://postgres:pw@127.0.0.1:1/test")
    first = _first_line(raised.value)
    assert "127.0.0.1:1/test" in first and "no database server answered there" in first and "pw@" not in first
