"""UndoLog for LangGraph and LangChain agents: a drop-in ``ToolNode`` and a ``create_agent`` middleware.

Every tool call the graph makes goes through UndoLog's engine first:

* SAFE tools run freely;
* COMPENSABLE tools run with an undo entry; if one fails, the session is rolled back per policy and
  the model is told what was undone;
* IRREVERSIBLE tools pause the graph with LangGraph's own ``interrupt()`` until a person decides,
  either in the resume value, in LangChain's human-in-the-loop vocabulary (``Command(resume={"type":
  "approve"})``; the pause is a ``ToolApprovalRequest`` or an ``HITLRequest``) or in UndoLog's own
  (``{"decision": "approve", "approver": "ana"}``), or elsewhere (CLI, REST, dashboard) followed by
  ``Command(resume=undolog_resume(graph, config))``.

The UndoLog session is the LangGraph thread (``thread_id``) and the tool call id is UndoLog's
``call_id``: LangGraph re-runs a whole interrupted node on resume, and UndoLog's call-id
de-duplication turns each re-run call into a replay of the stored result (or of the same pending
approval request), so nothing runs twice.

The package's modules: ``_sessions`` (thread -> session ids), ``_payload`` (interrupt payload and
resume values), ``_tools`` (LangChain tool/message plumbing), ``_guard`` (classification and the
decision for one call), ``_call`` (the call sequence, sync and async), ``_node``
(``UndoLogToolNode``), ``_middleware`` (``UndoLogMiddleware``), ``_resume`` (module-level helpers).

Example:
    >>> from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
    >>> builder.add_node("tools", UndoLogToolNode(tools, undolog=undolog))        # doctest: +SKIP
    >>> agent = create_agent(model, tools, middleware=[UndoLogMiddleware(undolog)],  # doctest: +SKIP
    ...                      checkpointer=saver)
"""

from __future__ import annotations

from undolog_adapters._common import UndoLogPolicy, missing_extra

try:
    import langchain_core.messages  # noqa: F401
    import langgraph.prebuilt  # noqa: F401
    import langgraph.types  # noqa: F401
except ImportError as exc:  # exercised by tests/adapters/test_common.py with LangGraph hidden
    raise ImportError(missing_extra("undolog_adapters.langgraph", "LangGraph and LangChain", "langgraph")) from exc

from ._middleware import UndoLogMiddleware
from ._node import UndoLogToolNode
from ._payload import (
    ALLOWED_DECISIONS,
    APPROVAL_INTERRUPT_TYPE,
    RESPONSE_SCHEMA,
    ApprovalDecision,
    ApprovalDecisions,
    HITLDecision,
)
from ._resume import (
    aresume_decided,
    arollback,
    aundolog_resume,
    new_session,
    resume_decided,
    rollback,
    session_for_thread,
    undolog_resume,
)

__all__ = [
    "ALLOWED_DECISIONS",
    "APPROVAL_INTERRUPT_TYPE",
    "RESPONSE_SCHEMA",
    "ApprovalDecision",
    "ApprovalDecisions",
    "HITLDecision",
    "UndoLogMiddleware",
    "UndoLogPolicy",
    "UndoLogToolNode",
    "arollback",
    "aresume_decided",
    "aundolog_resume",
    "new_session",
    "resume_decided",
    "rollback",
    "session_for_thread",
    "undolog_resume",
]
