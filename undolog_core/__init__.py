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

from . import errors, limits
from ._app import load_app
from ._approvals import ApprovalEvent, ApprovalRecord
from ._audit import AuditReport
from ._driver import CallDriver, NothingHappened, Outcome
from ._engine import AwaitingApproval, CallContext, Completed, Execute, current_call
from ._outbox import OutboxEvent
from ._policy import OrgPolicy
from ._recovery import ProbeContext, RecoveryReport
from ._saga import CompensationContext, RollbackReport, RollbackStep
from ._session import Session, SessionRecord
from ._tools import CompensationDescriptor, RetryPolicy, ToolSpec, ToolTier, compensation, undolog_tool
from ._undolog import UndoLog
from .errors import (
    ApprovalPending,
    ApprovalRejected,
    ApprovalTimedOut,
    ArgumentsInvalid,
    SessionHalted,
    ToolNotClassified,
    UndoLogError,
)
from .storage.schema import DecisionKind, EffectState, OnFailure, RequestState, SessionState, UndoState

__version__ = "0.1.0"

__all__ = [
    "ApprovalEvent",
    "ApprovalPending",
    "ApprovalRecord",
    "ApprovalRejected",
    "ApprovalTimedOut",
    "ArgumentsInvalid",
    "AuditReport",
    "AwaitingApproval",
    "CallDriver",
    "CallContext",
    "CompensationContext",
    "CompensationDescriptor",
    "Completed",
    "DecisionKind",
    "EffectState",
    "Execute",
    "OnFailure",
    "OrgPolicy",
    "NothingHappened",
    "Outcome",
    "OutboxEvent",
    "ProbeContext",
    "RecoveryReport",
    "RequestState",
    "RetryPolicy",
    "RollbackReport",
    "RollbackStep",
    "Session",
    "SessionHalted",
    "SessionRecord",
    "SessionState",
    "ToolNotClassified",
    "ToolSpec",
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
