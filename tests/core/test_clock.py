"""UndoLog's clock seam (``undolog_core/_clock.py``): leases, lease checks and approval deadlines read the one
clock, so a test (or the history checker, ``tests/faults/histories.py``) can jump it forward or backward inside one
process without touching the system clock. These tests fail if a lease or a lease check reads the system clock
directly."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from undolog_core import ToolTier, _clock, current_call, undolog_tool
from undolog_core._leases import owner_alive
from undolog_core.storage.base import utcnow


@pytest.fixture(autouse=True)
def _system_clock() -> Iterator[None]:
    yield
    _clock.reset()


def test_a_jump_moves_now_and_utcnow_together_and_reset_undoes_it() -> None:
    before = dt.datetime.now(dt.UTC)
    _clock.jump(3600.0)
    assert utcnow() - before >= dt.timedelta(seconds=3600)
    assert _clock.now() - before.timestamp() >= 3600
    _clock.jump(-7200.0)
    assert utcnow() < before
    _clock.reset()
    assert abs((utcnow() - dt.datetime.now(dt.UTC)).total_seconds()) < 60


def test_a_foreign_lease_is_judged_on_undologs_clock() -> None:
    # Another host: the lease decides, read on UndoLog's clock.
    owner = "another-host|4242|1|abc"
    lease = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
    assert owner_alive(owner, lease)
    _clock.jump(31.0)
    assert not owner_alive(owner, lease)
    _clock.jump(-62.0)
    assert owner_alive(owner, lease)


@pytest.mark.storage
def test_a_pre_write_and_its_renewals_take_their_lease_from_undologs_clock(db: Any) -> None:
    seen: dict[str, Any] = {}
    go = threading.Event()

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="clock_undo")
    def clock_call(n: int) -> int:
        call = current_call()
        assert call is not None
        seen["lease"] = {r.effect_id: r.lease_until for r in u.store.effects.in_flight().effects}[call.effect_id]
        go.wait(5)
        return n

    from undolog_core import compensation

    @compensation("clock_undo")
    def clock_undo(ctx: Any) -> None:
        pass

    u = db.open(lease_seconds=30)
    try:
        u.register(clock_call, clock_undo)
        _clock.jump(-3600.0)  # an hour back: the pre-write's lease ends about an hour before the system's now
        go.set()
        u.session(session_id="clock-1").call_sync("clock_call", n=1, call_id="c1")
        lease = seen["lease"]
        lease = lease if lease.tzinfo else lease.replace(tzinfo=dt.UTC)
        assert lease < dt.datetime.now(dt.UTC) - dt.timedelta(minutes=50)
        assert u.leases.until() < dt.datetime.now(dt.UTC) - dt.timedelta(minutes=50)
    finally:
        u.close()
