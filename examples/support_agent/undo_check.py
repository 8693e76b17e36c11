"""``check_undo`` on the support agent: its refund emails, through the real LangGraph agent and UndoLog's middleware.

The outbox's clock is frozen, so a queued email is never delivered while the check runs (the recall never races
the delivery), and every run starts from the seeded world. From the repository root:

    undolog check-undo --app examples.support_agent.undo_check:app examples.support_agent.undo_check:refunds \\
        --snapshot examples.support_agent.undo_check:snapshot --reset examples.support_agent.undo_check:reset

``app`` is the check's app factory: the UndoLog it opens (``$UNDOLOG_DATABASE_URL``, else a SQLite file beside the
world) is the database the check uses, created and migrated on first use, so the command works on a fresh clone.

``refunds`` is ticket 2002 (three refund emails, the third refused by the outbox); ``refund_then_delete`` is
ticket 1042 (one refund, then the account deletion, which ends the checked part: it waits for a person).
The world is a SQLite file at ``$SUPPORT_WORLD`` (default: a temporary directory of this process).
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from .world import SupportWorld

FROZEN_NOW = 1_800_000_000.0  # the outbox's clock during the check: nothing is ever delivered


@cache
def world() -> SupportWorld:
    path = os.environ.get("SUPPORT_WORLD") or str(Path(tempfile.mkdtemp(prefix="undolog-check-")) / "world.sqlite")
    return SupportWorld(path, delivery_delay=5.0, clock=lambda: FROZEN_NOW)


def app() -> Any:
    """The app factory ``undolog check-undo --app`` loads: an UndoLog on ``$UNDOLOG_DATABASE_URL``, else on a SQLite
    file beside the world (opened and migrated here, as an app opens its own)."""
    from undolog_core import UndoLog

    url = os.environ.get("UNDOLOG_DATABASE_URL") or f"sqlite:///{Path(world().path).parent / 'undolog.db'}"
    return UndoLog.open(url)


def snapshot() -> dict[str, Any]:
    return world().snapshot()


def reset() -> None:
    world().reset()


def _ticket(undolog: Any, run: Any, text: str, thread: str) -> Any:
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from .demo import SCRIPTS, build_agent
    from .model import ScriptedChatModel
    from .tools import make_tools

    agent = build_agent(undolog, make_tools(world()), ScriptedChatModel(scripts=SCRIPTS), InMemorySaver())
    # run.id in the thread id: each run is a session of its own and never replays another's stored results.
    return agent.invoke({"messages": [HumanMessage(text)]}, {"configurable": {"thread_id": f"{thread}-{run.id}"}})


def refunds(undolog: Any, run: Any) -> Any:
    """Ticket 2002: refunds of orders B-7, B-8 and B-9 (the outbox refuses B-9: over the order's total)."""
    from .demo import SCENE_2

    return _ticket(undolog, run, SCENE_2, "ticket-2002")


def refund_then_delete(undolog: Any, run: Any) -> Any:
    """Ticket 1042: a search, one refund email, then the account deletion (IRREVERSIBLE: the check stops there)."""
    from .demo import SCENE_1

    return _ticket(undolog, run, SCENE_1, "ticket-1042")
