"""UndoLog's one clock: what leases, approval deadlines and expiries read, never the system clock directly.

A clock that jumps (an NTP step, a VM resumed from a snapshot, a host whose time was set by hand) must not make a
live owner look dead or a dead one look alive in ways the lease rules do not expect. The fault harness proves that
by jumping this clock, forward and backward, inside one process (``tests/faults/histories.py``); changing the
system clock would move every process on the machine at once, the test runner's included.

``now()`` is epoch seconds (the hot path's unit), ``utcnow()`` the same instant as an aware UTC datetime; both are
the system clock plus an offset that is 0 unless a test moved it with :func:`jump`.

Example:
    >>> from undolog_core import _clock
    >>> before = _clock.now(); _clock.jump(5.0)
    >>> _clock.now() - before >= 5.0
    True
    >>> _clock.reset()
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable

#: Seconds added to the system clock. A module global (not a per-instance setting): every UndoLog of the process
#: reads the same time, as they would read the same jumped system clock.
_offset = 0.0


def _now_with_offset() -> float:
    return time.time() + _offset


#: Epoch seconds, as ``time.time()`` gives them, plus the offset. ``time.time`` itself while the offset is 0: the
#: pre-write reads it on the hot path, where a Python frame more is counted (the frame-count tests).
now: Callable[[], float] = time.time


def utcnow() -> dt.datetime:
    """The current instant as an aware UTC datetime, plus the offset."""
    if _offset:
        return dt.datetime.fromtimestamp(time.time() + _offset, dt.UTC)
    return dt.datetime.now(dt.UTC)


def jump(seconds: float) -> None:
    """Move this process's clock by ``seconds`` (negative: backward). For tests and fault injection only.

    Example:
        >>> jump(-3.0)  # leases taken from now on end 3 s earlier than the system clock says
    """
    global _offset, now
    _offset += seconds
    now = _now_with_offset if _offset else time.time


def reset() -> None:
    """Back to the system clock."""
    global _offset, now
    _offset = 0.0
    now = time.time
