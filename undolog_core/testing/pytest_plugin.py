"""The pytest plugin (entry point ``pytest11: undolog = undolog_core.testing.pytest_plugin``): the ``undo_check``
fixture.

The fixture calls :func:`undolog_core.testing.check_undo` with the test's UndoLog (the ``undolog`` fixture when the
test session defines one, else the one passed in) and fails the test with the table when a step is not restored,
not idempotent or not tolerant of "never happened".

Example:
    >>> def test_refund_undo(undo_check, world):
    ...     report = undo_check(refund_scenario, snapshot=world.snapshot, reset=world.reset)
    ...     assert [s.tool for s in report.steps] == ["send_refund_email"]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ._check import check_undo
from ._report import UndoReport


@pytest.fixture
def undo_check(request: pytest.FixtureRequest) -> Callable[..., UndoReport]:
    """``undo_check(scenario, snapshot=..., reset=..., undolog=None, expect_ok=True, **options)``: runs the check;
    fails the test with ``report.explain()`` unless it is ok (``expect_ok=False`` returns the report as it is)."""

    def run(scenario: Callable[..., Any], *, snapshot: Callable[[], Any], reset: Callable[[], Any],
            undolog: Any = None, expect_ok: bool = True, **options: Any) -> UndoReport:
        ul = undolog if undolog is not None else request.getfixturevalue("undolog")
        report = check_undo(scenario, snapshot=snapshot, reset=reset, undolog=ul, **options)
        if expect_ok and not report.ok:
            pytest.fail("check_undo: a compensation does not undo its step\n" + report.explain(), pytrace=False)
        return report

    return run
