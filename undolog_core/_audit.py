"""The audit trail: verifying its hash chains. Their SQL (append, outbox, reads) is ``storage.audit``.

The chain alone catches edits made behind the triggers' back unless the editor recomputes the hashes;
signed heads held outside the database (``_checkpoints``) catch that too, up to the last one signed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._json import canonical_json, sha256_hex
from .storage.audit import GENESIS_HASH, event_hash

if TYPE_CHECKING:
    from .storage import Storage


@dataclass(frozen=True)
class SignedHead:
    """A chain head whose signature was already checked: event ``position`` of chain ``chain`` must have ``hash``.

    Attributes:
        position: Event id of the head (0: the chain was empty).
        hash: The hash that event had when the head was signed.
        source: Where it came from (a checkpoint file), named in reports.
        chain: Which chain (a checkpoint of the single-chain format pins chain 1, where those events still are).
    """

    position: int
    hash: str
    source: str
    chain: int = 1


@dataclass(frozen=True)
class AuditReport:
    """Result of ``undolog audit verify``.

    Attributes:
        ok: Every chain is intact (and matches every signed head given).
        events_checked: Events recomputed.
        first_bad_event_id: The event that broke it (for a rewrite caught by a signed head: the signed event,
            whose hash changed; the rewrite lies after the last signed head of its chain that still matched).
        problem: What is wrong, for a person.
        checkpoints_checked: Signed heads compared with the chains.
        head_position: The highest event id of all chain heads that were verified.
        head_hash: One hash over every chain's head (:func:`fold_heads`); the empty trail's is the genesis hash.
        heads: Every chain's verified head as (chain, last event id, last hash): what a checkpoint signs.
    """

    ok: bool
    events_checked: int
    first_bad_event_id: int | None = None
    problem: str | None = None
    checkpoints_checked: int = 0
    head_position: int = 0
    head_hash: str = GENESIS_HASH
    heads: tuple[tuple[int, int, str], ...] = ()


def fold_heads(heads: Sequence[tuple[int, int, str]]) -> str:
    """One hash over the chains' heads (chain, last event id, last hash), empty chains left out; the genesis hash
    when every chain is empty. A lone chain 1 folds to its own last hash, as the single-chain trail had."""
    used = sorted(h for h in heads if h[1] != 0)
    if not used:
        return GENESIS_HASH
    if len(used) == 1 and used[0][0] == 1:
        return used[0][2]
    return sha256_hex(canonical_json([list(h) for h in used]))


@dataclass(frozen=True)
class _Gap:
    """Event ids ``(low, high]`` of chain ``chain`` that checkpoint ``source`` proves did not exist when it was
    signed: above the chain's signed head and at or below the checkpoint's position."""

    low: int
    high: int
    source: str


class _Coverage:
    """What the checkpoints say about events they do not pin one by one.

    A checkpoint signs every chain's head at one moment when no append was half done (``locked_heads``), so
    every event id at or below its position (its highest head) that exists was in the chain signed below that
    head; an event at or below the position above its chain's signed head, or in a chain the checkpoint does not
    name, was inserted afterwards with a backdated id (a sequence gap, a chain empty at signing, a new chain).
    The heads of one checkpoint are the signed heads sharing a ``source``. A single-chain checkpoint (format
    ``/1``) pins chain 1; the other chains did not exist then: they are read as signed empty.
    """

    def __init__(self, checkpoints: Sequence[SignedHead]) -> None:
        by_source: dict[str, dict[int, int]] = {}
        for c in checkpoints:
            by_source.setdefault(c.source, {})[c.chain] = c.position
        self._named = list(by_source.items())
        # The chains every checkpoint names: the common case, checked without a walk over the checkpoints.
        self._everywhere = set.intersection(*(set(h) for _, h in self._named)) if self._named else set()
        gaps: dict[int, list[_Gap]] = {}
        for source, heads in self._named:
            top = max(heads.values(), default=0)
            for chain, position in heads.items():
                if position < top:
                    gaps.setdefault(chain, []).append(_Gap(position, top, source))
        # Per chain: the gaps by their low end, and the running widest high end (for one bisect per event).
        self._lows: dict[int, list[int]] = {}
        self._widest: dict[int, list[_Gap]] = {}
        for chain, found in gaps.items():
            found.sort(key=lambda g: g.low)
            self._lows[chain] = [g.low for g in found]
            widest: list[_Gap] = []
            for g in found:
                widest.append(g if not widest or g.high > widest[-1].high else widest[-1])
            self._widest[chain] = widest

    def problem(self, chain: int, event_id: int) -> str | None:
        """Why event ``event_id`` of ``chain`` cannot have existed when a checkpoint was signed (None: it could)."""
        for source, heads in self._named if chain not in self._everywhere else ():
            if chain not in heads:
                return f"event {event_id} is in chain {chain}, which {source} does not name (a chain added after it)"
        lows = self._lows.get(chain)
        if not lows:
            return None
        k = bisect.bisect_left(lows, event_id)  # gaps whose low end is below the event
        if k == 0:
            return None
        g = self._widest[chain][k - 1]
        if g.high < event_id:
            return None
        return (f"event {event_id} of chain {chain} is at or below position {g.high} signed in {g.source}, where "
                f"chain {chain} was signed at {g.low}: it was inserted after that checkpoint (a backdated event)")


def verify(storage: Storage, checkpoints: Sequence[SignedHead] = ()) -> AuditReport:
    """Recompute every chain; any edit, deletion or reordering behind the triggers' back shows up here.

    Args:
        storage: The store.
        checkpoints: Signed heads (signatures already checked): the event at each signed position of a chain
            must have the signed hash, which catches a rewrite whose hashes were recomputed. The heads sharing a
            ``source`` are one checkpoint, which names every chain: an event at or below its position above its
            chain's signed head, or in a chain it does not name, is refused (a backdated insertion).

    Example:
        >>> verify(undolog.store).ok
        True
    """
    by_position: dict[tuple[int, int], list[SignedHead]] = {}
    for c in checkpoints:
        by_position.setdefault((c.chain, c.position), []).append(c)
    matched: dict[int, int] = {}  # per chain, the highest signed position that matched so far
    last: dict[int, tuple[int, str]] = {}  # per chain, (last event id, its hash) as found
    coverage = _Coverage(checkpoints)
    count = 0
    with storage.audit.chain() as chain:
        for n, r in chain.events():
            count += 1
            backdated = coverage.problem(n, r.event_id) if checkpoints else None
            if backdated is not None:
                return AuditReport(False, count, r.event_id, backdated)
            last_id, prev = last.get(n, (0, GENESIS_HASH))
            if r.event_id <= last_id:
                return AuditReport(False, count, r.event_id, f"event {r.event_id} is out of order in chain {n}")
            if r.prev_hash != prev:
                return AuditReport(False, count, r.event_id, "prev_hash does not match the previous event's hash "
                                                             f"in chain {n} (an event before it was removed or "
                                                             "edited)")
            h = event_hash(
                event_id=r.event_id,
                approval_request_id=r.approval_request_id,
                subject=r.subject,
                action=r.action,
                actor=r.actor,
                payload=r.payload,
                created_at=r.created_at,
                prev_hash=r.prev_hash,
            )
            if h != r.hash:
                return AuditReport(False, count, r.event_id, "the event's content does not match its hash")
            for c in by_position.get((n, r.event_id), ()):
                if c.hash != r.hash:
                    return AuditReport(
                        False,
                        count,
                        r.event_id,
                        f"event {r.event_id} does not have the hash signed in {c.source}: chain {n} was "
                        f"rewritten (hashes recomputed) at an event after {matched.get(n, 0)} and up to "
                        f"{r.event_id}",
                    )
                matched[n] = r.event_id
            last[n] = (r.event_id, r.hash)
        heads = chain.heads()
    head_of = {h.chain: h for h in heads}
    for n, (last_id, _) in last.items():
        if n not in head_of:
            return AuditReport(False, count, last_id, f"chain {n} has events but no head row")
    for head in heads:
        last_id, last_hash = last.get(head.chain, (0, GENESIS_HASH))
        if head.last_event_id != last_id or head.last_hash != last_hash:
            return AuditReport(False, count, head.last_event_id,
                               f"events after the last one found in chain {head.chain} were removed")
    for n, position in sorted(by_position):
        c = by_position[(n, position)][0]
        last_id = last.get(n, (0, GENESIS_HASH))[0]
        if position > last_id:
            return AuditReport(
                False, count, last_id + 1,
                f"event {position} of chain {n}, signed in {c.source}, is gone: the chain was cut back to {last_id}",
            )
        if position == 0 and any(x.hash != GENESIS_HASH for x in by_position[(n, 0)]):
            return AuditReport(False, count, None, "a checkpoint of an empty chain carries a hash")
    verified = tuple((x.chain, x.last_event_id, x.last_hash) for x in heads)
    return AuditReport(True, count, checkpoints_checked=len(checkpoints),
                       head_position=max((x[1] for x in verified), default=0), head_hash=fold_heads(verified),
                       heads=verified)


__all__ = ["GENESIS_HASH", "AuditReport", "SignedHead", "event_hash", "fold_heads", "verify"]
