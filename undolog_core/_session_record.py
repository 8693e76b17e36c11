"""A session's record in this process (``SessionCache``: what only this process knows of it until a write carries
it to the store: SAFE call counts, logged calls' counts riding along, a deferred start, its recent calls) and the
ids' check (``check_id``). Kept by the session table (``_sessions_table.SessionTable``); no I/O here."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from .errors import ContractChanged, InvalidId
from .limits import MAX_ID_LENGTH, encodes

if TYPE_CHECKING:
    from ._tools import ToolSpec


@dataclass
class SessionCache:
    """What this process knows of a session; the database stays the authority for its state."""

    session_id: str
    state: str
    pins: dict[str, int]
    on_failure: str
    persisted: bool = True
    # (tool_name, tier, args, state) of recent calls, newest last; SAFE calls are known only here.
    # (A partial, not a lambda: no Python frame and no keyword parsing when a record is made, once a conversation.)
    recent: collections.deque[tuple[str, str, Any, str]] = field(default_factory=partial(collections.deque, (), 50))
    # next() on itertools.count is atomic under the GIL: lock-free counters for the hot paths. A count is taken by
    # swapping in a fresh counter and reading the old one's next value (it is not used again).
    # `counter` holds SAFE calls, which must reach the store with the session's next write (`dirty` says there are
    # some, so a pre-write with none to carry does not swap); `carried` holds logged calls, which ride along with
    # whatever write flushes next (so a run of COMPENSABLE calls does not rewrite the session row every time).
    counter: Iterator[int] = field(default_factory=itertools.count)
    carried: Iterator[int] = field(default_factory=itertools.count)
    dirty: bool = False
    # The agent a session not yet in the store is recorded under, whichever write creates it first (its first
    # logged call, or the flush of its SAFE calls' count).
    agent_id: str | None = None
    # A session this process minted and has not written yet (``SessionTable.defer_start``): the row's values, written by
    # its first logged call's own pre-write statement, or first by whatever else needs the row (``SessionTable.persist``).
    start: dict[str, Any] | None = None
    # Set while the engine evicts the record (``SessionTable.evict``): a caller that counted into it right then sees it
    # after counting and brings the record back (``SessionTable.come_back``), so that no count is lost to the eviction.
    gone: bool = False

    def unwritten(self) -> bool:
        """Whether the record holds something the store does not have yet: SAFE calls counted (``dirty``), logged
        calls carried (``carried``: read without taking it, from the counter's repr), or a deferred start."""
        return self.dirty or self.start is not None or repr(self.carried) != "count(0)"

    def count_safe(self) -> None:
        next(self.counter)
        self.dirty = True

    def take_safe(self) -> int:
        if not self.dirty:
            return 0  # nothing counted: the counter stays (a call counted meanwhile is still in it)
        self.dirty = False
        old, self.counter = self.counter, itertools.count()
        return next(old)

    def take_carried(self) -> int:
        old, self.carried = self.carried, itertools.count()
        return next(old)

    def take_flush(self) -> tuple[int, int]:
        """(SAFE calls, logged calls carried), both taken: what a pre-write that flushes carries to the session's row.

        For a record with SAFE calls counted (``dirty``); in one frame, as the COMPENSABLE hot path calls it."""
        self.dirty = False
        old, self.counter = self.counter, itertools.count()
        carried, self.carried = self.carried, itertools.count()
        return next(old), next(carried)

    def take_count(self) -> int:
        return self.take_safe() + self.take_carried()

    def give_back(self, n: int, carried: int = 0) -> None:
        if n:
            self.counter = itertools.count(self.take_safe() + n)
            self.dirty = True
        if carried:
            self.carried = itertools.count(self.take_carried() + carried)

    def check_pin(self, spec: ToolSpec) -> bool:
        """Whether ``spec`` is to be pinned in the session now (a tool registered since it began); the revision
        pinned already, False; another revision pinned, ``ContractChanged``."""
        pinned = self.pins.get(spec.name)
        if pinned is None:
            return True  # first use of a tool registered after the session began: pin it now
        if pinned != spec.revision:
            raise ContractChanged(self.session_id, spec.name, pinned, spec.revision)
        return False


def check_id(what: str, value: Any) -> None:
    """Ids are non-empty strings that fit their columns, checked before any I/O on both databases alike."""
    if (not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or value != value.strip()
            or "\x00" in value or not (value.isascii() or encodes(value))):
        raise InvalidId(what, value, MAX_ID_LENGTH)
