"""Growth: ``undolog gc`` moves the effects and undo entries of settled sessions into the archive table."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError
from .storage.base import new_id, utcnow

if TYPE_CHECKING:
    from .storage import Storage

#: Sessions per gc transaction: each transaction archives them, deletes their rows and appends one audit event.
GC_BATCH = 200

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")


def parse_age(text: str) -> dt.timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s`` as a timedelta.

    Example:
        >>> parse_age("30d")
        datetime.timedelta(days=30)

    Raises:
        ConfigurationError: not a whole number followed by one of s, m, h, d, w.
    """
    m = _DURATION.match(text)
    if not m:
        raise ConfigurationError(f"--older-than {text!r}: give a whole number and a unit, e.g. 30d, 12h, 90m, 2w")
    return dt.timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class GcReport:
    """What one ``gc`` run archived (``dry_run``: what it would archive)."""

    run_id: str
    idle_before: str
    dry_run: bool = False
    sessions: int = 0
    closed: list[str] = field(default_factory=list)
    effects: int = 0
    undo_entries: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def collect(storage: Storage, older_than: dt.timedelta, *, actor: str, dry_run: bool = False,
            now: dt.datetime | None = None, progress: Callable[[int], None] | None = None) -> GcReport:
    """Archive the effects and undo entries of every session settled and idle for ``older_than``.

    Settled: completed or rolled back, or active with nothing in flight, awaiting approval or being
    compensated (such a session is closed, ``completed``, as it is archived: its call ids could no longer be
    recognised). Each batch of ``GC_BATCH`` sessions is one transaction with one audit event (``gc.archive``);
    audit events themselves are never archived or deleted. Safe to run from several processes at once.

    Example:
        >>> collect(undolog.store, parse_age("30d"), actor="ana").effects
        12873
    """
    now = now or utcnow()
    cutoff = now - older_than
    report = GcReport(run_id=new_id(), idle_before=cutoff.isoformat(), dry_run=dry_run)
    after: str | None = None
    while True:
        ids = storage.archive.settled_sessions(cutoff, limit=GC_BATCH, after=after)
        if not ids:
            return report
        after = ids[-1]
        if dry_run:
            report.sessions += len(ids)
            continue
        batch = storage.archive.archive_sessions(ids, cutoff, run_id=report.run_id, actor=actor, now=now)
        report.sessions += len(batch.sessions)
        report.closed += batch.closed
        report.effects += batch.effects
        report.undo_entries += batch.undo_entries
        if progress:
            progress(report.sessions)
