"""What the API's reads hand back: the records of approvals, sessions, the outbox and a rollback's steps.

An app author rarely names these types (a read returns them, their fields are documented here); they are public for
type annotations. They were importable from ``undolog_core`` itself until 0.1 (now with a ``DeprecationWarning``).

Example:
    >>> from undolog_core.records import ApprovalRecord, DecisionKind
    >>> DecisionKind.APPROVE.value
    'approve'
"""

from ._approvals import ApprovalEvent, ApprovalRecord
from ._outbox import OutboxEvent
from ._policy import OrgPolicy
from ._saga import RollbackStep
from ._session import SessionRecord
from .storage.schema import DecisionKind

__all__ = ["ApprovalEvent", "ApprovalRecord", "DecisionKind", "OrgPolicy", "OutboxEvent", "RollbackStep",
           "SessionRecord"]
