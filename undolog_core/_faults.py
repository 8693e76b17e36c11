"""Named fault points for crash tests (the DBOS style): the process SIGKILLs itself when it reaches the armed one.

A point is armed by ``UNDOLOG_FAULT=<point>`` in the environment (read at import) or, in a forked test worker, by
:func:`arm` at run time. ``UNDOLOG_FAULT_SKIP=N`` (or ``arm(point, skip=N)``) lets the point pass N times first, so a
test can kill a walk between its second and third step. Unarmed, a fault point is one string comparison.
"""

from __future__ import annotations

import enum
import os
import signal


class FaultPoint(enum.StrEnum):
    """Every place a crash test can kill the process, in the order a call or a rollback reaches them."""

    BEFORE_PREWRITE = "before_prewrite"  # a COMPENSABLE call validated, nothing written yet
    AFTER_PREWRITE = "after_prewrite"  # effect pending + undo entry durable, the tool has not run
    AFTER_TOOL = "after_tool"  # the tool returned, its commit mark not written
    AFTER_MARK_QUEUED = "after_mark_queued"  # fast mode: the mark is queued in memory, not written
    AFTER_APPROVED_CLAIM = "after_approved_claim"  # an approved IRREVERSIBLE call is durably `running`
    ROLLBACK_REQUESTED = "rollback_requested"  # the rollback intent is durable, no compensation claimed yet
    DURING_ROLLBACK = "during_rollback"  # an undo entry is claimed (`compensating`), its compensation not called
    AFTER_COMPENSATION = "after_compensation"  # the compensation returned, its success not recorded
    BETWEEN_COMPENSATIONS = "between_compensations"  # one step recorded compensated, the next not claimed
    DURING_RECOVERY = "during_recovery"  # recovery claimed an in-doubt effect, has not settled it


_armed: str | None = os.environ.get("UNDOLOG_FAULT") or None
_skip: int = int(os.environ.get("UNDOLOG_FAULT_SKIP", "0") or 0)


def arm(point: FaultPoint | str | None, *, skip: int = 0) -> None:
    """Arm ``point`` in this process (None disarms); it lets ``skip`` passes through before it kills."""
    global _armed, _skip
    _armed = FaultPoint(point).value if point is not None else None
    _skip = skip


def fault(point: FaultPoint) -> None:
    """SIGKILL this process if ``point`` is the armed one (after its allowed passes)."""
    global _skip
    if _armed is None or _armed != point:
        return
    if _skip > 0:
        _skip -= 1
        return
    os.kill(os.getpid(), signal.SIGKILL)
