"""The server's error-code→HTTP status map covers every core error code."""

from __future__ import annotations

from undolog_core import errors
from undolog_core.cli import CliInputError
from undolog_server.problems import ERROR_STATUS, status_for


def _codes() -> set[str]:
    seen: set[str] = set()
    todo: list[type[errors.UndoLogError]] = [errors.UndoLogError]
    while todo:
        cls = todo.pop()
        seen.add(cls.code)
        todo += cls.__subclasses__()
    return seen


def test_every_core_error_code_has_a_status() -> None:
    assert CliInputError.code in _codes()
    missing = _codes() - set(ERROR_STATUS)
    assert not missing, f"add these codes to undolog_server.problems.ERROR_STATUS: {sorted(missing)}"


def test_statuses() -> None:
    assert status_for("database_unavailable") == 503
    assert status_for("approval_not_found") == 404
    assert status_for("arguments_invalid") == 422
    assert status_for("approval_already_decided") == 409
    assert status_for("a_code_from_the_future") == 400
