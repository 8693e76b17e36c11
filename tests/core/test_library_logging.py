"""A library's logging manners: a NullHandler on ``undolog``, and check_undo's own simulated crashes not warned about.

Before: an app that configured no logging got bare WARNING lines from UndoLog on stderr through Python's last-resort
handler, two "recovered after a crash" lines in every ``check_undo`` run, which are the check's own simulated crashes.
Real subprocesses: a fresh interpreter is the only place where no test framework has configured logging.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.storage


def test_the_undolog_logger_has_a_null_handler() -> None:
    import logging

    import undolog_core  # noqa: F401

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("undolog").handlers)


def test_check_undo_in_an_app_without_logging_config_writes_no_warning_to_stderr(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import os
        os.environ["UNDO_WORLD"] = {str(tmp_path / "world.json")!r}
        from tests.support import undo_world as w
        from undolog_core import UndoLog
        from undolog_core.testing import check_undo

        ul = UndoLog.open("sqlite:///{tmp_path}/u.db")
        w.reset()
        w.register(ul)
        report = check_undo(w.two_step_scenario, snapshot=w.snapshot, reset=w.reset, undolog=ul)
        print("ok" if report.ok else "not ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "recovered after a crash" not in done.stderr and "WARNING" not in done.stderr, done.stderr


def test_with_logging_configured_the_simulated_crashes_are_info_not_warnings(undolog, caplog, tmp_path,
                                                                            monkeypatch) -> None:
    import logging

    from tests.support import undo_world as w
    from undolog_core.testing import check_undo

    monkeypatch.setenv("UNDO_WORLD", str(tmp_path / "world.json"))
    w.reset()
    w.register(undolog)
    with caplog.at_level(logging.INFO, logger="undolog"):
        assert check_undo(w.two_step_scenario, snapshot=w.snapshot, reset=w.reset, undolog=undolog).ok
    crashes = [r for r in caplog.records if "recovered after a crash" in r.getMessage()]
    assert crashes and all(r.levelno == logging.INFO for r in crashes)
