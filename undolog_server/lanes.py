"""Admission lanes: how many requests run inside the desk at once, and a lane of its own for decisions.

The desk is one Python process: its sync routes run on anyio's thread pool (40 threads), all of them sharing one
GIL and, on SQLite, one write lock. Without a bound, 50 busy clients took every thread, and a person's decision
waited for a thread behind the agents' traffic before it even started (then for the write lock, see
``undolog_core.storage.base.WriteLock``). So the desk admits at most ``max_concurrent_requests`` requests (32,
below the pool's 40 threads) and queues the rest, first come first served, on the event loop, where waiting
costs nothing; a person's decision (approve, reject, modify, respond; over the API or from the dashboard) never
queues behind them: it has a lane of its own (``decision_lane``), and so always finds a thread.

A request that cannot be admitted within ``queue_timeout`` seconds is answered **503** ``server_busy`` with
``Retry-After``, never left hanging. ``GET /v1/health`` and the dashboard's static files bypass the lanes, so a busy
desk still answers its liveness probe.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from . import problems

#: Decision routes: ``POST /v1/approvals/{id}:approve|reject|modify|respond`` and the dashboard's decision forms.
_DECISION = re.compile(r"^(/v1/approvals/[^/]+:(approve|reject|modify|respond)|/ui/approvals/[^/]+/[a-z]+)$")

_log = logging.getLogger("undolog.server")


def is_decision(method: str, path: str) -> bool:
    """Whether a request records a person's decision (and so takes the decision lane).

    Example:
        >>> is_decision("POST", "/v1/approvals/3f2c:approve"), is_decision("GET", "/v1/approvals/3f2c")
        (True, False)
    """
    return method == "POST" and _DECISION.match(path) is not None


def bypasses(path: str) -> bool:
    """Requests that never queue: the liveness probe and static files (no database, no thread of their own)."""
    return path == "/v1/health" or path.startswith("/ui/static/")


class Lane:
    """At most ``size`` requests inside at once; the others wait in arrival order, for ``timeout`` seconds at most.

    Example:
        >>> lane = Lane("general", 32, timeout=30)
        >>> async with lane.admitted():  # raises LaneTimeout after 30 s of waiting
        ...     ...
    """

    def __init__(self, name: str, size: int, *, timeout: float) -> None:
        self.name = name
        self.size = size
        self.timeout = timeout
        self.inside = 0
        # Created on first use, so the lane binds to the event loop that serves the requests.
        self._sem: asyncio.Semaphore | None = None

    async def enter(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.size)
        try:
            # asyncio.timeout cancels this task's wait, which Semaphore.acquire undoes cleanly (a slot handed over
            # at that instant passes to the next waiter instead of leaking).
            async with asyncio.timeout(self.timeout):
                await self._sem.acquire()
        except TimeoutError:
            raise LaneTimeout(self) from None
        self.inside += 1

    def leave(self) -> None:
        assert self._sem is not None
        self.inside -= 1
        self._sem.release()


class LaneTimeout(Exception):
    """A request waited ``queue_timeout`` seconds without being admitted."""

    def __init__(self, lane: Lane) -> None:
        super().__init__(f"no room in the {lane.name} lane after {lane.timeout:g} s")
        self.lane = lane


class Lanes:
    """The ASGI layer that admits each HTTP request through its lane (see the module's docstring)."""

    def __init__(self, app: Any, *, general: int, decisions: int, queue_timeout: float) -> None:
        self.app = app
        self.general = Lane("general", general, timeout=queue_timeout)
        self.decisions = Lane("decision", decisions, timeout=queue_timeout)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or bypasses(path):
            await self.app(scope, receive, send)
            return
        lane = self.decisions if is_decision(scope.get("method", ""), path) else self.general
        try:
            await lane.enter()
        except LaneTimeout as exc:
            _log.warning("%s %s answered 503: %s", scope.get("method"), path, exc)
            retry = "1"
            body = problems.problem_body(
                503, "server_busy", f"the server is busy: {exc}; retry after {retry} s", path, retry_after=int(retry))
            await problems.SafeJSONResponse(body, status_code=503, media_type=problems.PROBLEM_MEDIA_TYPE,
                                            headers={"Retry-After": retry})(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            lane.leave()
