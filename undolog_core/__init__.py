"""UndoLog: a safety layer for LLM-agent tool calls.

Every tool is classified at registration as SAFE (runs at once), COMPENSABLE (logged durably with its undo
before it runs) or IRREVERSIBLE (waits for a person). The docs site's "Guarantees and their limits" says what holds.

Example:
    >>> from undolog_core import UndoLog, undolog_tool, ToolTier
    >>> @undolog_tool(tier=ToolTier.SAFE)
    ... def search(query: str) -> list[str]: return []
    >>> undolog = UndoLog.open("sqlite:///undolog.db")
    >>> undolog.register(search)
"""

from typing import TYPE_CHECKING, Any

from . import errors, limits
from ._app import load_app
from ._audit import AuditReport
from ._decisions import CallContext, current_call
from ._recovery import ProbeContext, RecoveryReport
from ._saga import CompensationContext, RollbackReport
from ._session import Session
from ._tools import CompensationDescriptor, RetryPolicy, ToolTier, compensation, undolog_tool
from ._undolog import UndoLog
from .errors import ApprovalPending, UndoLogError
from .storage.schema import EffectState, OnFailure, RequestState, SessionState, UndoState

if TYPE_CHECKING:
    # The moved names (``_MOVED``), for the type checker only (``as``: re-exported, so mypy --strict takes them);
    # at run time ``__getattr__`` serves them, with a warning.
    from .errors import ApprovalRejected as ApprovalRejected
    from .errors import ApprovalTimedOut as ApprovalTimedOut
    from .errors import ArgumentsInvalid as ArgumentsInvalid
    from .errors import SessionHalted as SessionHalted
    from .errors import ToolNotClassified as ToolNotClassified
    from .integration import AwaitingApproval as AwaitingApproval
    from .integration import CallDriver as CallDriver
    from .integration import Completed as Completed
    from .integration import Execute as Execute
    from .integration import NothingHappened as NothingHappened
    from .integration import Outcome as Outcome
    from .integration import ToolSpec as ToolSpec
    from .records import ApprovalEvent as ApprovalEvent
    from .records import ApprovalRecord as ApprovalRecord
    from .records import DecisionKind as DecisionKind
    from .records import OrgPolicy as OrgPolicy
    from .records import OutboxEvent as OutboxEvent
    from .records import RollbackStep as RollbackStep
    from .records import SessionRecord as SessionRecord

__version__ = "0.1.0"

# What an app author needs: open an UndoLog, declare tools and their undo, run sessions, read what happened, catch
# its errors. Everything else has one home in a submodule: the errors in ``errors``, the records the reads return in
# ``records``, what a framework integration needs in ``integration`` (tests/test_public_api.py pins this list).
__all__ = [
    "ApprovalPending",
    "AuditReport",
    "CallContext",
    "CompensationContext",
    "CompensationDescriptor",
    "EffectState",
    "OnFailure",
    "ProbeContext",
    "RecoveryReport",
    "RequestState",
    "RetryPolicy",
    "RollbackReport",
    "Session",
    "SessionState",
    "ToolTier",
    "UndoLog",
    "UndoLogError",
    "UndoState",
    "compensation",
    "current_call",
    "errors",
    "limits",
    "load_app",
    "undolog_tool",
    "__version__",
]

# Names importable from here until 0.1, and the public module each now lives in. Served for one more release by
# ``__getattr__`` with a DeprecationWarning (then removed), so that code written against 0.1 keeps running.
_MOVED = {
    "ApprovalRejected": "undolog_core.errors",
    "ApprovalTimedOut": "undolog_core.errors",
    "ArgumentsInvalid": "undolog_core.errors",
    "SessionHalted": "undolog_core.errors",
    "ToolNotClassified": "undolog_core.errors",
    "ApprovalEvent": "undolog_core.records",
    "ApprovalRecord": "undolog_core.records",
    "DecisionKind": "undolog_core.records",
    "OrgPolicy": "undolog_core.records",
    "OutboxEvent": "undolog_core.records",
    "RollbackStep": "undolog_core.records",
    "SessionRecord": "undolog_core.records",
    "AwaitingApproval": "undolog_core.integration",
    "CallDriver": "undolog_core.integration",
    "Completed": "undolog_core.integration",
    "Execute": "undolog_core.integration",
    "NothingHappened": "undolog_core.integration",
    "Outcome": "undolog_core.integration",
    "ToolSpec": "undolog_core.integration",
}


def __getattr__(name: str) -> Any:
    """A name moved out of the top level (``_MOVED``): returned from its new module, with a DeprecationWarning.

    Example:
        >>> from undolog_core import SessionHalted  # doctest: +SKIP
        DeprecationWarning: undolog_core.SessionHalted moved: import it from undolog_core.errors ...
    """
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'undolog_core' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"undolog_core.{name} moved: import it from {home} (the top-level name goes in the next release)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
