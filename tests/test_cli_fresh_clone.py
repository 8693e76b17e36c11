"""The README's shell paths on a fresh clone: ``undolog check-undo`` with its app factory, and the refusal of a
missing database naming the URL and the flag.

Before: the README's ``undolog check-undo ...`` failed on a fresh clone with "no UndoLog database" until
``undolog db upgrade`` and ``--db``. Real subprocesses of the installed ``undolog`` command, with an environment that
names no database, from a directory holding no ``undolog.db``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNDOLOG = str(Path(sys.executable).with_name("undolog"))

# SQLite run only (reads_store): both tests follow the README on SQLite whatever UNDOLOG_TEST_DB says (_env drops
# every UNDOLOG_ variable), so a PostgreSQL run repeated the SQLite run.
pytestmark = pytest.mark.reads_store


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNDOLOG_")}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"), SUPPORT_WORLD=str(tmp_path / "world.sqlite"))
    return env


def test_the_readme_check_undo_command_runs_on_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "examples", clone / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    env = _env(tmp_path)
    env.pop("PYTHONPATH")  # the clone's own examples, found from its directory as the README's command is run
    spec = "examples.support_agent.undo_check"
    done = subprocess.run(
        [UNDOLOG, "check-undo", "--app", f"{spec}:app", f"{spec}:refunds", "--snapshot", f"{spec}:snapshot",
         "--reset", f"{spec}:reset"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK:" in done.stdout and not (clone / "undolog.db").exists()
    assert (tmp_path / "undolog.db").exists()  # the database the app factory opened, beside the world


def test_other_commands_refuse_a_missing_database_naming_the_url_and_the_flag(tmp_path: Path) -> None:
    done = subprocess.run([UNDOLOG, "sessions", "list"], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and not (tmp_path / "undolog.db").exists()
    text = done.stdout + done.stderr
    assert "sqlite:///undolog.db" in text and "pass --db URL" in text
