"""What a framework integration needs beyond the public API.

The adapters and the MCP gateway import these from here, never from the core's private modules, so the core can
move its internals without breaking them.

- ``WouldBlock``: raised by the call driver, before anything is written, when a caller on an event loop asked not
  to wait (``wait=False``) and the decision would wait for a pool slot or SQLite's write lock; decide again in a
  worker thread.
- ``execute_now`` and ``SessionCache``: the decision of a SAFE call built without the outcome machinery, and what
  the process knows of a session (for adapters that keep a session per conversation).
- ``tool_name_of``: the name a tool is registered under (its declaration's name, a framework tool's ``name``, or
  the function's ``__name__``).
- ``jsonable``: a value as the store keeps it (JSON; NaN and infinities as strings, the same on both databases).
- ``run_coro_blocking``: a coroutine run to completion from sync code, in a thread of its own when this thread
  already runs an event loop (the caller's context variables travel with it).
- ``Continuation`` and ``KICKOFF``: a kickoff continued without repeating what it did (CrewAI, Semantic Kernel's
  ``resume()``), and the context variable naming the kickoff each effect is recorded under.
- ``metering``: counters for work that is SAFE by nature and not audited (the gateway's resource reads).
- ``WAKE_SIGNAL``: the signal a rollback requester on this host sends a session's owning process.
- ``IN_FLIGHT``: the effect states of a call still in flight.
- ``ApprovalRecord``: an approval request as read from the store.
- ``persist_session``: write a session this process started but has not written yet, now (for a reader in another
  process: the desk's HTTP agents).

Example:
    >>> from undolog_core.integration import jsonable, tool_name_of
    >>> def refund(user_id: str) -> None: ...
    >>> tool_name_of(refund), jsonable({"amount": float("nan")})
    ('refund', {'amount': 'NaN'})
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._continuation import Continuation
from ._engine import KICKOFF, execute_now
from ._json import jsonable
from ._observe import metering
from ._owners import WAKE_SIGNAL
from ._saga import run_coro_blocking
from ._sessions_table import SessionCache
from ._tools import tool_name_of
from .storage.pool import WouldBlock
from .storage.records import ApprovalRecord
from .storage.schema import IN_FLIGHT

if TYPE_CHECKING:
    from ._undolog import UndoLog

__all__ = ["IN_FLIGHT", "KICKOFF", "WAKE_SIGNAL", "ApprovalRecord", "Continuation", "SessionCache", "WouldBlock",
           "execute_now", "jsonable", "metering", "persist_session", "run_coro_blocking", "tool_name_of"]


def persist_session(undolog: UndoLog, session_id: str) -> None:
    """Write the session ``session_id`` now, if this process started it and has not written it yet.

    A minted id's row waits for its first logged call on PostgreSQL; another process that reads the store (the
    desk's next request, served elsewhere) then finds it.

    Example:
        >>> s = undolog.session(agent_id="support-bot")                  # doctest: +SKIP
        >>> persist_session(undolog, s.id)                               # doctest: +SKIP
    """
    undolog.engine.persist(session_id)
