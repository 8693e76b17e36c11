"""Admission lanes: how many requests run inside the desk at once, and a lane of its own for decisions.

The desk is one Python process: its sync routes run on anyio's thread pool (40 threads), all of them sharing one
GIL and, on SQLite, one write lock. Without a bound, 50 busy clients took every thread, and a person's decision
waited for a thread behind the agents' traffic before it even started (then for the write lock, see
``undolog_core.storage.base.WriteLock``). So the desk admits at most ``max_concurrent_requests`` requests (8)
and queues the rest, first come first served, on the event loop, where waiting costs nothing; a person's
decision (approve, reject, modify, respond; over the API or from the dashboard) never queues behind them: it has a
lane of its own (``decision_lane``), and so always finds a thread.

Why 8 and not more: every admitted request is a thread competing for the one GIL, and a decision gives the GIL up
and takes it back at each statement, each time behind the admitted threads; the holder of SQLite's write lock
(whom a decision waits for) is slowed the same way. More threads inside do not add throughput (one GIL, one
writer). Under the load test (10 s runs, interleaved, on a loaded 2-core machine) 32 admitted gave a decision p50
of 134-172 ms and p99 of 415-470 ms in the server; 8 gave 74-86 ms and 160-250 ms, with as many requests served.
On PostgreSQL 8 doubled the requests served (82/s to 153/s) and cut a decision's p50 from 684 to 114 ms. The cost:
8 slow requests (proxied calls to a slow upstream hold their slot until it answers or times out) keep the rest of
the agents' traffic waiting; decisions, which have their own lane, are not affected. Raise
``--max-concurrent-requests`` where upstreams are slow.

A request that cannot be admitted within ``queue_timeout`` seconds is answered **503** ``server_busy`` with
``Retry-After``, never left hanging. ``GET /v1/health`` and the dashboard's static files bypass the lanes, so a busy
desk still answers its liveness probe.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
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
        >>> lane = Lane("general", 8, timeout=30)
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
        start = time.perf_counter()
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
        waited = time.perf_counter() - start
        if lane is self.decisions:
            send = _timed(send, waited, time.perf_counter())
        try:
            await self.app(scope, receive, send)
        finally:
            lane.leave()


def _timed(send: Any, waited: float, admitted: float) -> Any:
    """``send`` with a ``Server-Timing`` header: ``queue`` (the wait for a lane) and ``app`` (admission to the
    response's start), in milliseconds. On decisions: it tells the desk's share of a slow decision from the
    client's and the network's (the load test prints both)."""

    async def send_timed(message: Any) -> None:
        if message["type"] == "http.response.start":
            app_ms = (time.perf_counter() - admitted) * 1000
            value = f"queue;dur={waited * 1000:.1f}, app;dur={app_ms:.1f}".encode()
            message = {**message, "headers": [*message.get("headers", []), (b"server-timing", value)]}
        await send(message)

    return send_timed
