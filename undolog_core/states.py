"""The state machines of effects, undo entries, sessions and approval requests, written once as data.

Each machine is a table of named transitions: the states a row may be in for the transition to apply (its
sources) and the state it goes to. Storage statements take their guard from here: a statement that moves a row
writes ``WHERE state IN (<sources>)`` rendered by :meth:`Machine.where` (text SQL) or :meth:`Machine.guard`
(SQLAlchemy), inside the one statement it always was (no extra statement, no round trip), so a row in any other
state is left alone and the caller learns it from the row count. ``tests/core/test_states.py`` holds the
statements to this table, and the README's diagrams are :func:`mermaid` of it.

Example:
    >>> EFFECT.sources("commit")
    ('pending', 'running')
    >>> EFFECT.where("commit")
    "state IN ('pending', 'running')"
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .storage.schema import EffectState as E
from .storage.schema import RequestState as R
from .storage.schema import SessionState as S
from .storage.schema import UndoState as U


@dataclass(frozen=True)
class Transition:
    """One legal move: from any of ``sources`` to ``target``, named ``name`` (what the statement doing it does)."""

    name: str
    sources: tuple[str, ...]
    target: str


class Machine:
    """One entity's legal transitions.

    Example:
        >>> UNDO.target("claim")
        'compensating'
    """

    def __init__(self, entity: str, states: Iterable[str], transitions: Iterable[Transition]) -> None:
        self.entity = entity
        self.states = tuple(states)
        self.transitions = {t.name: t for t in transitions}
        for t in self.transitions.values():
            unknown = {*t.sources, t.target} - set(self.states)
            if unknown:
                raise ValueError(f"{entity} transition {t.name!r} names unknown states {sorted(unknown)}")

    def sources(self, name: str) -> tuple[str, ...]:
        """The states transition ``name`` may start from."""
        return self.transitions[name].sources

    def target(self, name: str) -> str:
        return self.transitions[name].target

    def where(self, name: str, column: str = "state") -> str:
        """The text guard of a statement doing transition ``name``: ``<column> IN ('a', 'b')``."""
        return f"{column} IN ({', '.join(repr(s) for s in self.sources(name))})"

    def guard(self, name: str, column: Any) -> Any:
        """The SQLAlchemy guard of a statement doing transition ``name`` (literal values: it renders the same in
        a statement compiled once for a raw driver connection, where an expanding IN would not)."""
        import sqlalchemy as sa

        return column.in_([sa.literal_column(f"'{s}'") for s in self.sources(name)])

    def guard_between(self, sources: Iterable[str], target: str, column: Any) -> Any:
        """The SQLAlchemy guard of a statement moving a row from any of ``sources`` to ``target`` (a caller's own
        narrower set, as ``SessionsSQL.set_session_state`` takes one), each move checked against the table first.

        Raises:
            ValueError: some move is not in the table.
        """
        import sqlalchemy as sa

        sources = tuple(sources)
        illegal = [s for s in sources if not self.legal(s, target)]
        if illegal or not sources:
            raise ValueError(f"{self.entity}: no transition goes from {illegal or 'nothing'} to {target!r}")
        return column.in_([sa.literal_column(f"'{s}'") for s in sources])

    def legal(self, before: str, after: str) -> bool:
        """Whether some transition goes from ``before`` to ``after``."""
        return any(before in t.sources and t.target == after for t in self.transitions.values())

    def edges(self) -> list[tuple[str, str, str]]:
        """Every (source, target, transition name), in table order."""
        return [(s, t.target, t.name) for t in self.transitions.values() for s in t.sources]


IN_FLIGHT = (E.PENDING.value, E.RUNNING.value)

EFFECT = Machine("effect", (s.value for s in E), [
    # The tool ran: its own process's commit mark, or recovery's probe that proved it happened.
    Transition("commit", IN_FLIGHT, E.COMMITTED.value),
    Transition("fail", IN_FLIGHT, E.FAILED.value),
    # A framework's control flow handed the call back mid-run; its re-issue claims it again.
    Transition("release", IN_FLIGHT, E.RELEASED.value),
    Transition("reclaim", (E.RELEASED.value,), E.PENDING.value),
    Transition("reclaim_approved", (E.RELEASED.value,), E.RUNNING.value),
    # IRREVERSIBLE: the gate.
    Transition("approve", (E.AWAITING_APPROVAL.value,), E.APPROVED.value),
    Transition("reject", (E.AWAITING_APPROVAL.value,), E.REJECTED.value),
    Transition("time_out", (E.AWAITING_APPROVAL.value,), E.TIMED_OUT.value),
    # Cancelled with its request (a halt, a rollback): a released call too, so its re-issue cannot run it.
    Transition("cancel", (E.AWAITING_APPROVAL.value, E.APPROVED.value, E.RELEASED.value), E.CANCELLED.value),
    # A person answered in the tool's place (LangChain's respond): the tool never runs.
    Transition("respond", (E.AWAITING_APPROVAL.value,), E.CANCELLED.value),
    Transition("claim_run", (E.APPROVED.value,), E.RUNNING.value),
    Transition("lapse", (E.APPROVED.value,), E.EXPIRED.value),
    # Recovery of a call whose owner is gone: compensated, settled unknown, or (an IRREVERSIBLE call its probe
    # says never ran) back to approved; dead-lettered after repeated failures.
    Transition("recover_compensated", IN_FLIGHT, E.COMPENSATED.value),
    Transition("recover_unknown", IN_FLIGHT, E.UNKNOWN.value),
    Transition("recover_not_run", (E.RUNNING.value,), E.APPROVED.value),
    Transition("dead_letter", IN_FLIGHT, E.DEAD_LETTER.value),
    # A rollback's compensation of a call that ran (or that was in flight with its owner gone, handed back by its
    # framework, or dead-lettered by recovery: a person's rollback runs its compensation once more).
    Transition("compensate", (E.COMMITTED.value, E.FAILED.value, E.UNKNOWN.value, *IN_FLIGHT, E.RELEASED.value,
                              E.DEAD_LETTER.value), E.COMPENSATED.value),
    # The call's own process finished it after another process took it over (issue 34): recorded, unknown.
    Transition("late_finish", (*IN_FLIGHT, E.COMPENSATED.value, E.UNKNOWN.value, E.APPROVED.value,
                               E.DEAD_LETTER.value), E.UNKNOWN.value),
    # A person settles an unknown call (``undolog effects resolve``): it happened and stands, it is undone, or it
    # never happened (recorded failed, nothing to undo, as recovery records a probe's "did not happen").
    Transition("resolve_committed", (E.UNKNOWN.value,), E.COMMITTED.value),
    Transition("resolve_compensated", (E.UNKNOWN.value,), E.COMPENSATED.value),
    Transition("resolve_not_happened", (E.UNKNOWN.value,), E.FAILED.value),
])

UNDO = Machine("undo entry", (s.value for s in U), [
    Transition("claim", (U.ARMED.value, U.COMPENSATING.value, U.COMPENSATION_FAILED.value), U.COMPENSATING.value),
    Transition("compensated", (U.COMPENSATING.value,), U.COMPENSATED.value),
    Transition("failed", (U.COMPENSATING.value,), U.COMPENSATION_FAILED.value),
    # A person resolved its effect as compensated (undone by hand, or by the compensation that already ran):
    # no rollback runs it again. One being run right now is left to its walk.
    Transition("resolve_compensated", (U.ARMED.value, U.COMPENSATION_FAILED.value), U.COMPENSATED.value),
])

SESSION = Machine("session", (s.value for s in S), [
    Transition("await_approval", (S.ACTIVE.value,), S.AWAITING_APPROVAL.value),
    Transition("approval_settled", (S.AWAITING_APPROVAL.value,), S.ACTIVE.value),
    # A halt stops a session for a person; an ended session (rolled back, completed) is not reopened by it.
    Transition("halt", (S.ACTIVE.value, S.AWAITING_APPROVAL.value, S.HALTED.value, S.ROLLING_BACK.value),
               S.HALTED.value),
    Transition("resume", (S.HALTED.value,), S.ACTIVE.value),
    Transition("request_rollback", (S.ACTIVE.value, S.AWAITING_APPROVAL.value, S.HALTED.value, S.ROLLING_BACK.value,
                                    S.COMPLETED.value), S.ROLLING_BACK.value),
    Transition("rolled_back", (S.ROLLING_BACK.value, S.ACTIVE.value, S.AWAITING_APPROVAL.value, S.HALTED.value,
                               S.COMPLETED.value), S.ROLLED_BACK.value),
    Transition("complete", (S.ACTIVE.value,), S.COMPLETED.value),
])
#: The session states that accept a call (the pre-write's guard).
WRITABLE = (S.ACTIVE.value, S.AWAITING_APPROVAL.value)

REQUEST = Machine("approval request", (s.value for s in R), [
    Transition("approve", (R.PENDING.value,), R.APPROVED.value),
    Transition("reject", (R.PENDING.value,), R.REJECTED.value),
    Transition("respond", (R.PENDING.value,), R.RESPONDED.value),
    Transition("time_out", (R.PENDING.value,), R.TIMED_OUT.value),
    Transition("auto_approve", (R.PENDING.value,), R.AUTO_APPROVED.value),
    Transition("cancel", (R.PENDING.value, R.APPROVED.value, R.AUTO_APPROVED.value), R.CANCELLED.value),
    # A pending request cancelled because another request of its session timed out (the session halts).
    Transition("withdraw", (R.PENDING.value,), R.CANCELLED.value),
    Transition("lapse", (R.APPROVED.value, R.AUTO_APPROVED.value), R.EXPIRED.value),
])

MACHINES = (EFFECT, UNDO, SESSION, REQUEST)


def mermaid(machine: Machine) -> str:
    """The machine as a Mermaid state diagram (what the README shows), one edge per source and transition."""
    lines = ["stateDiagram-v2"]
    lines += [f"    {a} --> {b}: {name}" for a, b, name in machine.edges()]
    return "\n".join(lines)


__all__ = ["EFFECT", "IN_FLIGHT", "MACHINES", "REQUEST", "SESSION", "UNDO", "WRITABLE", "Machine", "Transition",
           "mermaid"]
