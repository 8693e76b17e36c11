"""Prove the undo: break a scenario after every COMPENSABLE step and check that the world comes back.

Importable without pytest (the pytest fixture ``undo_check`` lives in ``undolog_core.testing.pytest_plugin``, which
pytest loads through the ``pytest11`` entry point).

Example:
    >>> from undolog_core.testing import check_undo
    >>> report = check_undo(scenario, snapshot=world_snapshot, reset=world_reset, undolog=ul)
    >>> assert report.ok, report.explain()
    >>> [(s.index, s.tool, s.restored, s.idempotent, s.tolerates_never_happened) for s in report.steps]
"""

from ._check import InjectedStop, Run, RunKind, ScenarioError, check_undo
from ._internals import Internals, internals
from ._report import Difference, FaultPointReport, StepReport, UndoReport, diff

__all__ = [
    "Difference",
    "FaultPointReport",
    "Internals",
    "InjectedStop",
    "Run",
    "RunKind",
    "ScenarioError",
    "StepReport",
    "UndoReport",
    "check_undo",
    "diff",
    "internals",
]
