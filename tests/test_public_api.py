"""The top-level ``undolog_core`` is what an app author needs (issue #35 part 1: "close the facade").

Its ``__all__`` is pinned here, so a name added to it or dropped from it is a decision made on purpose. A name moved
out of it keeps working for one release (``undolog_core.__getattr__``): the same object as in its new module, with a
DeprecationWarning that names that module.
"""

from __future__ import annotations

import importlib

import pytest

import undolog_core

APP_AUTHORS_API = [
    "ApprovalPending", "AuditReport", "CallContext", "CompensationContext", "CompensationDescriptor", "EffectState",
    "OnFailure", "ProbeContext", "RecoveryReport", "RequestState", "RetryPolicy", "RollbackReport", "Session",
    "SessionState", "ToolTier", "UndoLog", "UndoLogError", "UndoState", "compensation", "current_call", "errors",
    "limits", "load_app", "undolog_tool", "__version__",
]

# Each name the top level served until 0.1 and no longer lists, and its one home now.
MOVED = {
    "ApprovalRejected": "undolog_core.errors", "ApprovalTimedOut": "undolog_core.errors",
    "ArgumentsInvalid": "undolog_core.errors", "SessionHalted": "undolog_core.errors",
    "ToolNotClassified": "undolog_core.errors",
    "ApprovalEvent": "undolog_core.records", "ApprovalRecord": "undolog_core.records",
    "DecisionKind": "undolog_core.records", "OrgPolicy": "undolog_core.records", "OutboxEvent": "undolog_core.records",
    "RollbackStep": "undolog_core.records", "SessionRecord": "undolog_core.records",
    "AwaitingApproval": "undolog_core.integration", "CallDriver": "undolog_core.integration",
    "Completed": "undolog_core.integration", "Execute": "undolog_core.integration",
    "NothingHappened": "undolog_core.integration", "Outcome": "undolog_core.integration",
    "ToolSpec": "undolog_core.integration",
}


def test_the_top_level_lists_what_an_app_author_needs() -> None:
    assert sorted(undolog_core.__all__) == sorted(APP_AUTHORS_API)
    assert all(hasattr(undolog_core, name) for name in undolog_core.__all__)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_imports_with_a_warning_naming_its_new_home(name: str) -> None:
    home = importlib.import_module(MOVED[name])
    assert name in home.__all__ and name not in undolog_core.__all__
    with pytest.warns(DeprecationWarning, match=f"undolog_core.{name} moved: import it from {MOVED[name]}"):
        got = getattr(undolog_core, name)
    assert got is getattr(home, name)


def test_a_name_never_served_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        undolog_core.Engine  # noqa: B018 - the look-up is the test
    with pytest.raises(ImportError):
        from undolog_core import Engine  # noqa: F401
