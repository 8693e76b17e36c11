"""Named fault points for crash tests (the DBOS style): the process SIGKILLs itself when it reaches the armed one.

A point is armed by ``UNDOLOG_FAULT=<point>`` in the environment (read at import) or, in a forked test worker, by
:func:`arm` at run time. ``UNDOLOG_FAULT_SKIP=N`` (or ``arm(point, skip=N)``) lets the point pass N times first, so a
test can kill a walk between its second and third step. Unarmed, a fault point is one string comparison.
"""

from __future__ import annotations

import enum
import os
import signal
from collections.abc import Callable


class FaultPoint(enum.StrEnum):
    """Every place a crash test can kill the process, in the order a call or a rollback reaches them."""

    BEFORE_PREWRITE = "before_prewrite"  # a COMPENSABLE call validated, nothing written yet
    BEFORE_GATE = "before_gate"  # an IRREVERSIBLE call validated, nothing written yet
    AFTER_PREWRITE = "after_prewrite"  # effect pending + undo entry durable, the tool has not run
    AFTER_TOOL = "after_tool"  # the tool returned, its commit mark not written
    AFTER_MARK_QUEUED = "after_mark_queued"  # fast mode: the mark is queued in memory, not written
    AFTER_FAILURE_RECORDED = "after_failure_recorded"  # a call's failure is durable, its policy's rollback not run
    AFTER_APPROVED_CLAIM = "after_approved_claim"  # an approved IRREVERSIBLE call is durably `running`
    ROLLBACK_REQUESTED = "rollback_requested"  # the rollback intent is durable, no compensation claimed yet
    DURING_ROLLBACK = "during_rollback"  # an undo entry is claimed (`compensating`), its compensation not called
    AFTER_COMPENSATION = "after_compensation"  # the compensation returned, its success not recorded
    BETWEEN_COMPENSATIONS = "between_compensations"  # one step recorded compensated, the next not claimed
    DURING_RECOVERY = "during_recovery"  # recovery claimed an in-doubt effect, has not settled it


_armed: str | None = os.environ.get("UNDOLOG_FAULT") or None
_skip: int = int(os.environ.get("UNDOLOG_FAULT_SKIP", "0") or 0)

# What a hook is handed at a point: the point, and for the gated calls' points the session, the tool and (after
# the pre-write) the effect.
FaultHook = Callable[[FaultPoint, "str | None", "str | None", "str | None"], None]
_HOOKED = "*hook*"  # `_armed` while a hook is set: the unarmed fast path stays one comparison
_hook: FaultHook | None = None
_armed_before_hook: str | None = None


def arm(point: FaultPoint | str | None, *, skip: int = 0) -> None:
    """Arm ``point`` in this process (None disarms); it lets ``skip`` passes through before it kills."""
    global _armed, _skip
    _armed = FaultPoint(point).value if point is not None else None
    _skip = skip


def set_hook(hook: FaultHook | None) -> None:
    """Call ``hook(point, session_id, tool, effect_id)`` at every fault point instead of killing (None removes it).

    This is how ``undolog_core.testing.check_undo`` stops a scenario right after a step, or right after a
    pre-write, in its own process: the hook raises a ``BaseException`` that frameworks do not swallow. While a
    hook is set, an armed point does not kill; removing the hook re-arms it.

    Example:
        >>> def stop_before_writes(point, session_id, tool, effect_id):
        ...     if point is FaultPoint.BEFORE_PREWRITE:
        ...         raise KeyboardInterrupt(f"stopped before {tool}")
        >>> set_hook(stop_before_writes); ...; set_hook(None)
    """
    global _armed, _hook, _armed_before_hook
    if hook is not None:
        if _hook is None:
            _armed_before_hook = _armed
        _hook, _armed = hook, _HOOKED
    elif _hook is not None:
        _hook, _armed = None, _armed_before_hook


def fault(point: FaultPoint, session_id: str | None = None, tool: str | None = None,
          effect_id: str | None = None) -> None:
    """SIGKILL this process if ``point`` is the armed one (after its allowed passes); with a hook set, call it."""
    global _skip
    if _armed is None:
        return
    if _hook is not None:
        _hook(point, session_id, tool, effect_id)
        return
    if _armed != point:
        return
    if _skip > 0:
        _skip -= 1
        return
    os.kill(os.getpid(), signal.SIGKILL)
