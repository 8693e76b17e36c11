"""A continuation: a framework run started again after a pause (an approval, a crash) that replays what the run it
continues already did, instead of doing it twice.

A framework whose runs mint new call ids every time (a CrewAI kickoff, a Semantic Kernel turn) cannot match a
repeated call by its id, and a real model given the same task again repeats the whole task: the refund it already
sent would be sent again. So each effect records its run (``effect_log.kickoff_id``) and a continuation hands the
committed COMPENSABLE and IRREVERSIBLE effects of the run it continues back to the calls that repeat them, matched
by (tool, canonical arguments, n-th occurrence). A call that matches nothing runs, as any new call; the effects the
continuation logs are recorded under the same run, so a continuation of the continuation replays them too.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._json import canonical_text, json_safe, sha256_hex
from ._tools import ToolSpec
from .storage.base import new_id

if TYPE_CHECKING:
    from .storage import Storage


class _HasStore(Protocol):
    """An ``UndoLog`` as a continuation reads it (typed here so that this module imports no facade)."""

    @property
    def store(self) -> Storage: ...


@dataclass(frozen=True)
class ReplayedEffect:
    """A committed effect handed back to a call of a continuation that repeats it: the tool does not run again.

    Example:
        >>> hit = continuation.take(spec, {"user_id": "u1", "amount": 42.5})     # doctest: +SKIP
        >>> hit.result if hit else "run it"
    """

    effect_id: str
    tool_name: str
    result: Any
    kickoff_id: str | None  # None: a run known by its calls (a Semantic Kernel history), not by a kickoff id

    def note(self) -> str:
        """The text a model reads after the replayed result: the call was not run again, and why."""
        return (f"(UndoLog: `{self.tool_name}` already ran with these arguments in the run this one continues "
                f"(effect {self.effect_id}); this is its recorded result, replayed: it did not run again.)")


def args_digest(spec: ToolSpec, args: Mapping[str, Any]) -> str:
    """The digest the engine stores for these arguments of ``spec`` (validated, then canonical JSON).

    Example:
        >>> args_digest(undolog.tool_spec("send_refund_email"), {"user_id": "u1", "amount": 42.5})  # doctest: +SKIP
        '9b1f...'
    """
    snapshot = spec.snapshot(spec.validate(args))
    try:
        text = canonical_text(snapshot)
    except ValueError:  # a NaN or an infinity: stored as a string, as the engine stores it
        text = canonical_text(json_safe(snapshot))
    return sha256_hex(text)


class Continuation:
    """The committed effects of the run being continued, handed out by (tool, canonical arguments, n-th occurrence).

    Thread-safe: a framework may run a step's calls in parallel threads.

    Example:
        >>> cont = Continuation.load(undolog.store, "ticket-42")       # doctest: +SKIP
        >>> with kickoff_scope(cont.kickoff_id):                       # doctest: +SKIP
        ...     hit = cont.take(spec, args)                            # None: run the call
    """

    def __init__(self, session_id: str, kickoff_id: str | None, effects: list[Any]) -> None:
        self.session_id = session_id
        self.kickoff_id = kickoff_id
        self._lock = threading.Lock()
        # One queue per (tool, digest): the n-th repeat of a call takes the n-th effect. An effect whose approval
        # changed its arguments is found by the approved ones too (the model may repeat either); taken once.
        self._queues: dict[tuple[str, str], collections.deque[tuple[ReplayedEffect, set[str]]]] = {}
        for row in effects:
            hit = ReplayedEffect(str(row.effect_id), str(row.tool_name), row.result_snapshot, kickoff_id)
            digests = {str(row.args_digest)} | ({str(row.approved_digest)} if row.approved_digest else set())
            entry: tuple[ReplayedEffect, set[str]] = (hit, set())
            for digest in digests:
                self._queues.setdefault((hit.tool_name, digest), collections.deque()).append(entry)
        self.replayed: list[ReplayedEffect] = []

    @classmethod
    def load(cls, store: Storage, session_id: str) -> Continuation:
        """The continuation of the session's last run that raised an approval request (else its last run); with no
        recorded run, an empty one under a new run id (every call runs)."""
        kickoff_id = store.effects.kickoff_to_continue(session_id)
        if kickoff_id is None:
            return cls(session_id, new_id(), [])
        return cls(session_id, kickoff_id, store.effects.kickoff_effects(session_id, kickoff_id))

    @classmethod
    def of_session(cls, undolog: _HasStore, session_id: str) -> Continuation:
        """:meth:`load` on an ``UndoLog``: what an integration calls (its store is no part of the contract).

        Example:
            >>> cont = Continuation.of_session(undolog, "ticket-42")        # doctest: +SKIP
        """
        return cls.load(undolog.store, session_id)

    @classmethod
    def of_calls(cls, undolog: _HasStore, session_id: str, call_ids: list[str]) -> Continuation:
        """The committed effects of these calls of the session (a resumed conversation's history, whose calls keep
        their ids), as a continuation under no run of its own.

        Example:
            >>> cont = Continuation.of_calls(undolog, "chat-7", ["call_1", "call_2"])   # doctest: +SKIP
        """
        return cls(session_id, None, undolog.store.effects.effects_of_calls(session_id, call_ids))

    def __len__(self) -> int:
        """How many recorded effects are still to be replayed."""
        with self._lock:
            return len({id(entry) for q in self._queues.values() for entry in q if not entry[1]})

    def take(self, spec: ToolSpec, args: Mapping[str, Any]) -> ReplayedEffect | None:
        """The recorded effect this call repeats (taken: the next identical call gets the next one), or None."""
        if not self._queues:
            return None
        key = (spec.name, args_digest(spec, args))
        with self._lock:
            queue = self._queues.get(key)
            while queue:
                hit, taken = queue.popleft()
                if not taken:  # (an effect queued under two digests is taken through one of them only)
                    taken.add("taken")
                    self.replayed.append(hit)
                    return hit
        return None
