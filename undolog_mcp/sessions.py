"""Which UndoLog session an MCP call is logged under: the config's ``session`` grouping, and sessions a client
names by the id the gateway gave it.

A client that opens one MCP session per tool call (``langchain-mcp-adapters``' default ``get_tools()``, the MCP
Inspector's ``--cli``) would otherwise get a new UndoLog session per call: an approval would never meet the call's
re-issue, and a "session" rollback would cover one call. The groupings:

- ``mcp``: one UndoLog session per MCP client session (for a client that holds one open for its whole run);
- ``process``: one per gateway process (per API key over HTTP, so that two keys never share one);
- ``key``: over HTTP, one per API key, ended after ``session_idle`` seconds without a call.

A client may name a session (``_meta`` ``dev.undolog/session``, or the ``X-UndoLog-Session`` header over HTTP),
but only one its own key created (over stdio and the local socket: one this gateway process created over them).
New sessions always get ids the gateway mints: a client never chooses the id of a session that does not exist.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from undolog_core import SessionState, UndoLog
from undolog_core.errors import InvalidSessionState, SessionNotFound, UndoLogError

from .config import SessionGrouping

log = logging.getLogger("undolog.mcp")

# Where a client names the UndoLog session of a call, and where every result tells it which one it was logged in.
SESSION_META = "dev.undolog/session"
# The same over HTTP, for a whole request.
SESSION_HEADER = "x-undolog-session"
# How many minted sessions this process remembers as its own (over stdio, the only proof a named one is ours).
_REMEMBERED = 100_000
_ID_MAX = 128


class SessionRefused(UndoLogError):
    """A client named a session it may not use (not created by its key, or unknown).

    Fix:
        Name only a session id the gateway gave this client (in a result's ``_meta``), or name none: a new session
        is started for you.
    """

    code = "session_not_yours"


@dataclass
class _Grouped:
    """The session a grouping key (an API key, or None over stdio) logs its calls under now."""

    session_id: str
    last_call: float


class SessionRouter:
    """Decides the UndoLog session of each call, by the config's grouping.

    Example:
        >>> router = SessionRouter(undolog, SessionGrouping.PROCESS, idle=1800)
        >>> sid = await router.session_for(mcp_session=object(), principal=None, named=None, label="mcp:cli/1")
        >>> sid == await router.session_for(mcp_session=object(), principal=None, named=None, label="mcp:cli/1")
        True
    """

    def __init__(self, undolog: UndoLog, grouping: SessionGrouping, idle: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.undolog = undolog
        self.grouping = grouping
        self.idle = idle
        self._clock = clock
        # MCP client session -> (its UndoLog session, the API key that opened it): weak keys, not id(), so that the
        # map does not grow with every client that ever connected, and a new client session never inherits a dead
        # one's UndoLog session through a reused id().
        self._by_mcp: weakref.WeakKeyDictionary[Any, tuple[str, str | None]] = weakref.WeakKeyDictionary()
        # process / key groupings: the grouping key's current session.
        self._grouped: dict[str | None, _Grouped] = {}
        # Sessions minted here -> the principal that created them (None: over stdio or the local socket).
        self._minted: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._lock = asyncio.Lock()  # two first calls at once must share the one session they start
        # Set when a session is minted or named here: the gateway's owner loop holds it at once (see gateway.py).
        self.changed = asyncio.Event()

    def served(self) -> set[str]:
        """Every session this process minted or was named (what it holds a lease on while it runs)."""
        return set(self._minted)

    def minted_here(self, session_id: str) -> bool:
        return session_id in self._minted

    async def session_for(self, *, mcp_session: Any, principal: str | None, named: Any, label: str) -> str:
        """The UndoLog session of one call.

        Raises:
            SessionRefused: ``named`` is not a session this client may use.
        """
        if named is not None:
            session_id = await self._check_named(named, principal)
            if self.grouping is SessionGrouping.MCP:
                self._by_mcp[mcp_session] = (session_id, principal)
            return session_id
        if self.grouping is SessionGrouping.MCP:
            found = self._by_mcp.get(mcp_session)
            if found is not None:
                if found[1] != principal:
                    # Over HTTP an MCP session belongs to the key that opened it.
                    raise SessionRefused("this MCP session was opened with another API key")
                return found[0]
            session_id = await self._mint(label, principal)
            self._by_mcp[mcp_session] = (session_id, principal)
            return session_id
        now = self._clock()
        async with self._lock:
            grouped = self._grouped.get(principal)
            if grouped is not None and self.grouping is SessionGrouping.KEY and now - grouped.last_call > self.idle:
                if await asyncio.to_thread(self._end, grouped.session_id):
                    grouped = None
            if grouped is None:
                grouped = self._grouped[principal] = _Grouped(await self._mint(label, principal), now)
            grouped.last_call = now
            return grouped.session_id

    def forget(self, session_id: str) -> bool:
        """The session ``session_id`` accepts no more calls (rolled back, completed): the grouping's next call
        starts a new one. Returns whether it was a grouping's session (an MCP session's, or a key's)."""
        gone = False
        for principal, grouped in list(self._grouped.items()):
            if grouped.session_id == session_id:
                del self._grouped[principal]
                gone = True
        for mcp_session, (sid, _) in list(self._by_mcp.items()):
            if sid == session_id:
                del self._by_mcp[mcp_session]
                gone = True
        return gone

    async def sweep(self) -> list[str]:
        """End the key grouping's sessions idle for longer than ``session_idle``; returns their ids."""
        if self.grouping is not SessionGrouping.KEY:
            return []
        ended = []
        now = self._clock()
        async with self._lock:
            for principal, grouped in list(self._grouped.items()):
                if now - grouped.last_call > self.idle:
                    if await asyncio.to_thread(self._end, grouped.session_id):
                        del self._grouped[principal]
                        ended.append(grouped.session_id)
                    else:
                        grouped.last_call = now  # asked again after another idle period, not on every sweep
        return ended

    # -- inside -------------------------------------------------------------------------------------

    async def _mint(self, label: str, principal: str | None) -> str:
        s = await asyncio.to_thread(self.undolog.session, agent_id=label, created_by=principal)
        self._minted[s.id] = principal
        self.changed.set()
        while len(self._minted) > _REMEMBERED:
            self._minted.popitem(last=False)
        log.info("MCP client %s is session %s (grouping %s)", label, s.id, self.grouping.value)
        return s.id

    async def _check_named(self, named: Any, principal: str | None) -> str:
        """``named`` if this client may log calls under it: created by the same API key (over HTTP), or by this
        gateway process over stdio or its local socket. An unknown id and another key's get the same answer."""
        refusal = SessionRefused(
            f"no session {str(named)[:_ID_MAX]!r} for this client: name only a session id the gateway gave you (in a "
            f"result's _meta {SESSION_META!r}); leave {SESSION_META!r} out to have a new session started")
        if not isinstance(named, str) or not named or len(named) > _ID_MAX:
            raise refusal
        if named in self._minted:
            if self._minted[named] != principal:
                raise refusal
            return named
        if principal is None:
            # Over stdio nothing proves who created a session but this process's own memory of minting it.
            raise refusal
        try:
            record = await asyncio.to_thread(self.undolog.sessions.get, named)
        except (SessionNotFound, UndoLogError):
            raise refusal from None
        if record.created_by != principal:
            raise refusal
        self._minted[named] = principal
        self.changed.set()
        return named

    def _end(self, session_id: str) -> bool:
        """End an idle key session: completed when it is active. Returns whether the key's next call starts a new
        one. A halted session is not ended and stays the key's: a reject halts it until a person resumes it or
        rolls it back, and waiting out ``session_idle`` must not get the agent a fresh one. One rolling back or
        awaiting an approval stays too; one already rolled back or completed is done with."""
        try:
            self.undolog.sessions.set_state(session_id, SessionState.COMPLETED, allowed=(SessionState.ACTIVE,))
        except SessionNotFound:
            return True
        except InvalidSessionState:
            state = self.undolog.sessions.get(session_id).state
            if state in (SessionState.ROLLED_BACK, SessionState.COMPLETED):
                return True
            log.info("idle session %s is %s: it stays this key's session", session_id, state)
            return False
        log.info("session %s ended after %g s without a call", session_id, self.idle)
        return True
