"""Global options typed after the command (``undolog approvals list --db URL``), and ``demo --demo-db``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from undolog_core import ApprovalPending, ToolTier, undolog_tool
from undolog_core.cli import app

runner = CliRunner()
CLEAN_ENV = {"UNDOLOG_APP": None, "UNDOLOG_ACTOR": None, "UNDOLOG_DATABASE_URL": None, "UNDOLOG_SCHEMA": None,
             "COLUMNS": None}


def _where(db: Any, *, joined: bool = False) -> list[str]:
    if joined:
        return [f"--db={db.url}"] + ([f"--schema={db.schema}"] if db.schema else [])
    return ["--db", db.url] + (["--schema", db.schema] if db.schema else [])


@pytest.fixture
def pending(undolog: Any) -> str:
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="erases the customer")
    def erase(user_id: str) -> None:
        return None

    undolog.register(erase)
    with undolog.session(session_id="cli-g") as s, pytest.raises(ApprovalPending) as p:
        s.call_sync(erase, user_id="u1")
    return str(p.value.approval_request_id)


@pytest.mark.parametrize("joined", [False, True], ids=["--db URL", "--db=URL"])
def test_global_options_after_the_command(db: Any, pending: str, joined: bool) -> None:
    result = runner.invoke(app, ["approvals", "list", *_where(db, joined=joined), "--json"], env=CLEAN_ENV)
    assert result.exit_code == 0, result.output
    assert [r["approval_request_id"] for r in json.loads(result.stdout)] == [pending]
    # In the middle of the command's own arguments too, and a decision through it lands in the database.
    decided = runner.invoke(app, ["approvals", "approve", pending, *_where(db), "--as", "ana"], env=CLEAN_ENV)
    assert decided.exit_code == 0, decided.output
    assert db.open().approvals.get(pending).state == "approved"


def test_before_and_after_mix(db: Any, pending: str) -> None:
    result = runner.invoke(app, ["--db", db.url, "approvals", "show", pending, *(
        ["--schema", db.schema] if db.schema else []), "--json"], env=CLEAN_ENV)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["approval_request_id"] == pending


def test_app_after_the_command_is_the_global_one(db: Any) -> None:
    result = runner.invoke(app, ["recover", *_where(db), "--app", "no_such_module_for_undolog:make"], env=CLEAN_ENV)
    assert result.exit_code == 2, result.output
    assert "No such option" not in result.output and "no_such_module_for_undolog" in result.stderr


def test_a_command_with_its_own_db_option_keeps_it(db: Any) -> None:
    db.open()
    result = runner.invoke(app, ["keys", "list", *_where(db)], env=CLEAN_ENV)
    assert result.exit_code == 0, result.output


def test_an_unknown_option_is_still_refused(db: Any) -> None:
    result = runner.invoke(app, ["approvals", "list", "--bogus"], env=CLEAN_ENV)
    assert result.exit_code == 2 and "No such option" in result.output


def _fake_langgraph_demo(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {}
    mod = types.ModuleType("examples.support_agent.demo")

    def main(reject: bool = False, interactive: bool = False, model: str | None = None,
             db_path: str | None = None) -> int:
        calls.update(reject=reject, db_path=db_path)
        return 0

    mod.main = main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "examples.support_agent.demo", mod)
    return calls


def test_demo_db_is_demo_db_and_the_old_spelling_still_works(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    calls = _fake_langgraph_demo(monkeypatch)
    result = runner.invoke(app, ["demo", "--demo-db", str(tmp_path / "d.db")], env=CLEAN_ENV)
    assert result.exit_code == 0, result.output
    assert calls["db_path"] == str(tmp_path / "d.db") and "deprecated" not in result.stderr

    old = runner.invoke(app, ["demo", "--db", str(tmp_path / "e.db")], env=CLEAN_ENV)
    assert old.exit_code == 0, old.output
    assert calls["db_path"] == str(tmp_path / "e.db") and "use `--demo-db PATH`" in old.stderr
