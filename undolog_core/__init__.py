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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # What ``__all__`` names, for the type checker and the reference; at run time each is imported on first use
    # (``__getattr__``, below), so that a process using one light module of the package (``undolog_core.errors``,
    # ``undolog mcp connect``, which an MCP client starts per session) does not pay for the store's stack:
    # importing all of it takes about 0.4 CPU s, the light modules a few ms.
    from . import errors as errors
    from . import limits as limits
    from ._app import load_app as load_app
    from ._audit import AuditReport as AuditReport
    from ._decisions import CallContext as CallContext
    from ._decisions import current_call as current_call
    from ._recovery import ProbeContext as ProbeContext
    from ._recovery import RecoveryReport as RecoveryReport
    from ._saga import CompensationContext as CompensationContext
    from ._saga import RollbackReport as RollbackReport
    from ._session import Session as Session
    from ._tools import CompensationDescriptor as CompensationDescriptor
    from ._tools import RetryPolicy as RetryPolicy
    from ._tools import ToolTier as ToolTier
    from ._tools import compensation as compensation
    from ._tools import undolog_tool as undolog_tool
    from ._undolog import UndoLog as UndoLog
    from .errors import ApprovalPending as ApprovalPending
    from .errors import UndoLogError as UndoLogError
    from .storage.schema import EffectState as EffectState
    from .storage.schema import OnFailure as OnFailure
    from .storage.schema import RequestState as RequestState
    from .storage.schema import SessionState as SessionState
    from .storage.schema import UndoState as UndoState

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


#: Where each name of ``__all__`` lives (a module: the name is the module itself), imported on first use.
_LAZY = {
    "errors": "undolog_core.errors",
    "limits": "undolog_core.limits",
    "load_app": "undolog_core._app",
    "AuditReport": "undolog_core._audit",
    "CallContext": "undolog_core._decisions",
    "current_call": "undolog_core._decisions",
    "ProbeContext": "undolog_core._recovery",
    "RecoveryReport": "undolog_core._recovery",
    "CompensationContext": "undolog_core._saga",
    "RollbackReport": "undolog_core._saga",
    "Session": "undolog_core._session",
    "CompensationDescriptor": "undolog_core._tools",
    "RetryPolicy": "undolog_core._tools",
    "ToolTier": "undolog_core._tools",
    "compensation": "undolog_core._tools",
    "undolog_tool": "undolog_core._tools",
    "UndoLog": "undolog_core._undolog",
    "ApprovalPending": "undolog_core.errors",
    "UndoLogError": "undolog_core.errors",
    "EffectState": "undolog_core.storage.schema",
    "OnFailure": "undolog_core.storage.schema",
    "RequestState": "undolog_core.storage.schema",
    "SessionState": "undolog_core.storage.schema",
    "UndoState": "undolog_core.storage.schema",
}


def __getattr__(name: str) -> Any:
    """A name of ``__all__``, imported on first use (``_LAZY``), or one moved out of the top level.

    A moved name (``_MOVED``) is returned from its new module, with a DeprecationWarning.

    Example:
        >>> from undolog_core import SessionHalted  # doctest: +SKIP
        DeprecationWarning: undolog_core.SessionHalted moved: import it from undolog_core.errors ...
    """
    lazy = _LAZY.get(name)
    if lazy is not None:
        module = importlib.import_module(lazy)
        value = module if lazy == f"{__name__}.{name}" else getattr(module, name)
        globals()[name] = value  # kept: the next use is a plain attribute read
        return value
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'undolog_core' has no attribute {name!r}")
    import warnings

    warnings.warn(f"undolog_core.{name} moved: import it from {home} (the top-level name goes in the next release)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    """The module's names, those not imported yet included (``dir(undolog_core)`` lists ``__all__``)."""
    return sorted(set(globals()) | set(__all__))
