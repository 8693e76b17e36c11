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
On PostgreSQL 8 doubled the requests served (82/s to 153/s) and cut a decision's p50 from 684 to 114 ms.

A proxied call gives its slot back while it waits for its upstream (``given_back``): that wait is a thread blocked
on a socket, no database and no CPU work, so slow upstreams do not keep the rest of the agents' traffic waiting. It
takes a slot again once the upstream answers, to read the answer and record the outcome (the commit mark, or the
failure and the rollback); that wait has no time limit, since the upstream has already acted and its outcome must be
recorded, never answered 503. Those waits still hold a thread of the pool, so at most as many calls wait outside
the lanes as the pool has threads beyond both lanes (40 - 8 - 4 = 28 by default); past that a call keeps its slot
while it waits, as every request does. The cost that remains: 8 slow requests of other kinds (a rollback whose
compensations call a slow upstream, or more than 28 proxied calls waiting at once) keep the rest of the agents'
traffic waiting; decisions, which have their own lane, are not affected.

A request that cannot be admitted within ``queue_timeout`` seconds is answered **503** ``server_busy`` with
``Retry-After``, never left hanging. ``GET /v1/health`` and the dashboard's static files bypass the lanes, so a busy
desk still answers its liveness probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio.to_thread

from . import problems

#: Decision routes: ``POST /v1/approvals/{id}:approve|reject|modify|respond`` and the dashboard's decision forms.
_DECISION = re.compile(
    r"^(/v1/approvals/[^/]+:(approve|reject|modify|respond)|/ui/approvals/[^/]+/[a-z]+|/v1/slack/interactivity"
    r"|/ui/email/[^/]+/decide)$")

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

    def sem(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.size)
        return self._sem

    async def enter(self) -> None:
        sem = self.sem()
        try:
            # asyncio.timeout cancels this task's wait, which Semaphore.acquire undoes cleanly (a slot handed over
            # at that instant passes to the next waiter instead of leaking).
            async with asyncio.timeout(self.timeout):
                await sem.acquire()
        except TimeoutError:
            raise LaneTimeout(self) from None
        self.inside += 1

    def leave(self) -> None:
        assert self._sem is not None
        self.inside -= 1
        self._sem.release()


class Slot:
    """One admitted request's place in its lane, which the request's worker thread may give back for a while.

    The lane is the event loop's (an ``asyncio.Semaphore``): the thread hands each step to the loop.
    """

    def __init__(self, lanes: Lanes, lane: Lane, loop: asyncio.AbstractEventLoop) -> None:
        self.lanes = lanes
        self.lane = lane
        self.loop = loop
        self.held = True  # changed on the loop only
        self.closed = False  # the request is over: a slot taken now would never be given back

    def _give_back(self) -> None:
        self.held = False
        self.lane.leave()

    async def _take_again(self) -> None:
        if self.closed:
            return
        await self.lane.sem().acquire()  # no timeout: see given_back
        self.lane.inside += 1
        self.held = True

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """From the request's worker thread: the slot is free for others inside the block, taken again after it,
        waiting as long as that takes (never refused). Without room for one more wait outside the lanes, the slot
        is kept."""
        if not self.lanes.leave_for_a_wait():
            yield
            return
        try:
            self.loop.call_soon_threadsafe(self._give_back)
        except RuntimeError:  # the loop is closed: nothing to give back to
            self.lanes.back_from_a_wait()
            yield
            return
        try:
            yield
        finally:
            try:
                # Scheduled after _give_back (the loop runs them in order), so a slot is never taken twice.
                asyncio.run_coroutine_threadsafe(self._take_again(), self.loop).result()
            except BaseException:  # noqa: BLE001  # the loop is going away: record the outcome all the same
                _log.warning("a proxied call records its outcome without a slot: the event loop is gone")
            finally:
                self.lanes.back_from_a_wait()


#: Where a request's ``Slot`` is kept in its ASGI scope.
SLOT_KEY = "undolog.slot"


def given_back(scope: Any) -> contextlib.AbstractContextManager[None]:
    """From a request's worker thread: give its lane slot back while it waits on something else (an upstream tool),
    and take one again afterwards, however long that waits: what follows (recording the upstream's outcome) must
    never be refused once the upstream has acted. A no-op for requests outside the lanes.

    Example:
        >>> with given_back({}):  # a request that bypassed the lanes: nothing to give back
        ...     pass
    """
    slot = scope.get(SLOT_KEY)
    return slot.away() if isinstance(slot, Slot) else contextlib.nullcontext()


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
        # Requests waiting outside the lanes with their slot given back (Slot.away), and how many may: each holds
        # a thread of the pool, and the lanes' own requests must always find one (read on the first request).
        self._away = 0
        self._away_room: int | None = None
        self._away_lock = threading.Lock()

    def leave_for_a_wait(self) -> bool:
        """Count one more request waiting outside the lanes, if there is a thread to spare for it."""
        with self._away_lock:
            if self._away >= (self._away_room or 0):
                return False
            self._away += 1
            return True

    def back_from_a_wait(self) -> None:
        with self._away_lock:
            self._away -= 1

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
        if self._away_room is None:
            threads = int(anyio.to_thread.current_default_thread_limiter().total_tokens)
            self._away_room = max(0, threads - self.general.size - self.decisions.size)
        slot = Slot(self, lane, asyncio.get_running_loop())
        scope[SLOT_KEY] = slot
        try:
            await self.app(scope, receive, send)
        finally:
            slot.closed = True
            if slot.held:  # a request whose outcome was recorded without one gives none back
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
