"""The model-based fault harness: a small world, the operations on it, and the invariant checker.

One *sequence* is a list of :class:`Step` s (call, approve, reject, modify, release, rollback, recover, expire,
resume) over two sessions. Every step that reaches a fault point runs in a forked child process (``os.fork`` after
the imports: a few milliseconds, where a fresh interpreter costs half a second) with one :class:`FaultPoint` armed,
so the child may die by SIGKILL at that point; approvals, expiry and resumes run in the parent (they have no fault
point). The child opens its own UndoLog (its own connections, as a restarted process would) and takes the parent's
tool registrations rather than registering again (see :func:`_adopt`). After every step the checker compares the
store with the *ground truth*: a JSON-lines file that tools and compensations append to with one ``write(2)`` each
(O_APPEND), so a line written before a SIGKILL survives it.

Where a part's CPU goes (50 sequences, 114 forks; a 2-core machine, load about 2): on SQLite about 1.4 s in the
pytest process and 1.9 s in the children, on PostgreSQL 2.2 s and 2.5 s, plus about 2 s of the server's (half of it
starting a backend for each child's connection). A child costs about 17 ms: fork and copy-on-write faults of the
parent's heap, ``UndoLog.open`` (5 ms: its engines), the step with SQLAlchemy's statement cache cold. What was the
harness's own and is gone: each child's ``register`` (a pydantic model per tool and a contract read, 40% of a
child), the per-step snapshot's three statements rebuilt per step (now one statement, built once).

Why the tools observe the store themselves: "no IRREVERSIBLE tool runs without an approved, uncancelled request in
a session that is neither halted nor rolled back" is a statement about the moment the tool runs, and only the tool
body knows that moment. So every tool reads its session's state and its approval request from the store when it
runs and writes what it saw into the ground truth; the checker judges those lines.

Determinism: a sequence is generated from ``random.Random(seed)`` against the model's own view (call ids, not
random effect ids, pick what to act on), so the same seed gives the same steps; a failure prints the seed, the
steps with their outcomes and the violated invariant. ``shrink`` greedily drops steps while the same invariant
still fails (each attempt on a fresh database), to show the shortest sequence it can find.

Example:
    >>> h = Harness(url, schema=None, workdir=tmp)
    >>> result = h.run(seed=17)          # generates and runs one sequence
    >>> result.violation is None
    True
"""

from __future__ import annotations

import collections
import datetime as dt
import enum
import json
import os
import random
import signal
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from undolog_core import Execute, ToolTier, UndoLog, compensation, current_call, undolog_tool
from undolog_core._faults import FaultPoint, arm
from undolog_core.errors import UndoLogError
from undolog_core.storage import schema as t
from undolog_core.testing import internals

# -- the world: tools, compensations and probes that write down what really happened -----------------------

# Set in the parent before each fork (children inherit them): where the ground truth goes, the running process's
# UndoLog (tools read the store through it), and the sessions whose rollback the model has requested.
_GT_PATH: str | None = None
_TOOL_U: UndoLog | None = None
_ROLLBACK_REQUESTED: frozenset[str] = frozenset()


def gt_write(entry: dict[str, Any]) -> None:
    """Append one ground-truth line with a single write(2): it survives a SIGKILL right after it."""
    assert _GT_PATH is not None
    entry["pid"] = os.getpid()
    fd = os.open(_GT_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def gt_read(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _observe(tool: str, args: dict[str, Any]) -> None:
    """What a tool saw when it ran: its session's state and its approval request, read from the store."""
    cc = current_call()
    assert cc is not None and _TOOL_U is not None
    r = t.approval_requests
    with _TOOL_U.store.read() as c:
        state = c.execute(
            sa.select(t.sessions.c.state).where(t.sessions.c.session_id == cc.session_id)
        ).scalar()
        req = c.execute(
            sa.select(r.c.approval_request_id, r.c.state, r.c.approved_args).where(r.c.effect_id == cc.effect_id)
        ).first()
    gt_write({
        "kind": "tool", "tool": tool, "key": cc.idempotency_key, "effect_id": cc.effect_id,
        "session": cc.session_id, "args": args, "session_state": state,
        "request": req.approval_request_id if req else None, "req_state": req.state if req else None,
        "approved_args": req.approved_args if req else None,
        "rollback_requested": cc.session_id in _ROLLBACK_REQUESTED,
    })


def _probe(ctx: Any) -> Any:
    """An idempotent status check: did the call with this ``do-`` key happen? (the ground truth says)."""
    assert _GT_PATH is not None
    for e in gt_read(_GT_PATH):
        if e["kind"] == "tool" and e["key"] == ctx.idempotency_key:
            return {"probed": ctx.idempotency_key}
    return False


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="h_undo")
def h_send(user: str) -> dict[str, Any]:
    _observe("h_send", {"user": user})
    return {"sent": user}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="h_undo", probe=_probe)
def h_send_probed(user: str) -> dict[str, Any]:
    _observe("h_send_probed", {"user": user})
    return {"sent": user}


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="harness: gone for good")
def h_delete(user: str) -> dict[str, Any]:
    _observe("h_delete", {"user": user})
    return {"deleted": user}


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="harness: gone for good", probe=_probe)
def h_delete_probed(user: str) -> dict[str, Any]:
    _observe("h_delete_probed", {"user": user})
    return {"deleted": user}


@compensation("h_undo")
def h_undo(ctx: Any) -> None:
    # Tolerates "never happened" (recovery may compensate a call whose tool never ran): it only writes it down.
    gt_write({"kind": "comp", "key": ctx.idempotency_key, "effect_id": ctx.effect_id, "session": ctx.session_id,
              "tool": ctx.tool_name})


TOOLS: tuple[Any, ...] = (h_send, h_send_probed, h_delete, h_delete_probed, h_undo)
COMPENSABLE_TOOLS = ("h_send", "h_send_probed")
IRREVERSIBLE_TOOLS = ("h_delete", "h_delete_probed")
USERS = ("u1", "u2", "u3")
WRITABLE = ("active", "awaiting_approval")
STOPPED = ("halted", "rolled_back", "completed", "rolling_back")  # rolling_back: the durable rollback intent


# -- steps ----------------------------------------------------------------------------------------------------


class Op(enum.StrEnum):
    CALL = "call"          # a COMPENSABLE or IRREVERSIBLE call, new or re-issued with the same call_id
    APPROVE = "approve"
    REJECT = "reject"
    MODIFY = "modify"
    RELEASE = "release"    # intercept, then hand the Execute back (engine.release), as a framework interrupt does
    ROLLBACK = "rollback"  # a requested rollback
    RECOVER = "recover"
    EXPIRE = "expire"      # expire_due() at a time past every timeout (the policy timeout is an hour)
    RESUME = "resume"      # a person un-halts the session


class Invariant(enum.StrEnum):
    IRREVERSIBLE_GATED = "irreversible_gated"            # ran only with an approved, uncancelled request, once
    STOPPED_SESSION_RAN = "stopped_session_ran"          # a call ran in a halted / rolled-back / stopping session
    COMPENSATION_LOST = "compensation_lost"              # recorded compensated but never ran, or never run at all
    COMPENSATED_TWICE = "compensated_twice"              # an undo key ran more often than the documented retry
    ROLLBACK_UNFINISHED = "rollback_unfinished"          # a requested rollback not rolled_back/halted after recover
    ACTIVE_WITH_COMPENSATED = "active_with_compensated"  # a writable session with compensated effects
    UNREQUESTED_ROLLBACK = "unrequested_rollback"        # a session rolled back that nobody asked to roll back
    LEFT_IN_FLIGHT = "left_in_flight"                    # recover() left an effect pending/running (no live owner)
    UNEXPECTED_ERROR = "unexpected_error"                # a step raised something that is not an UndoLogError


@dataclass(frozen=True)
class Step:
    """One concrete operation. Steps name calls by the model's call ids, so a step list replays exactly."""

    op: Op
    session: int = 0                 # index into the sequence's sessions
    tool: str | None = None
    call_id: str | None = None
    user: str | None = None
    fault: FaultPoint | None = None
    skip: int = 0
    fast: bool = False               # open the child's UndoLog with fast_commit_mark=True
    run_tool: bool = False           # RELEASE: the tool half-ran before the interrupt

    def __str__(self) -> str:
        parts = [self.op.value] if self.op in (Op.RECOVER, Op.EXPIRE) else [self.op.value, f"s{self.session}"]
        if self.tool:
            parts.append(self.tool)
        if self.call_id:
            parts.append(f"call_id={self.call_id}")
        if self.user:
            parts.append(f"user={self.user}")
        if self.fast:
            parts.append("fast")
        if self.run_tool:
            parts.append("tool-ran")
        if self.fault:
            parts.append(f"kill@{self.fault.value}" + (f"+{self.skip}" if self.skip else ""))
        return " ".join(parts)


@dataclass
class Violation(Exception):
    invariant: Invariant
    message: str

    def __str__(self) -> str:
        return f"[{self.invariant.value}] {self.message}"


@dataclass
class Result:
    seed: int | None
    steps: list[Step]
    outcomes: list[str]
    violation: Violation | None = None
    failed_at: int | None = None     # index of the step after which the check failed (len(steps): the final check)
    sessions: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {len(self.steps)} steps" if self.seed is not None else f"{len(self.steps)} steps"]
        for i, (s, o) in enumerate(zip(self.steps, self.outcomes, strict=False)):
            mark = "  <-- fails here" if self.failed_at == i else ""
            lines.append(f"  {i:2d}. {s}  =>  {o}{mark}")
        if self.failed_at is not None and self.failed_at >= len(self.steps):
            lines.append("  final recover()  <-- fails here")
        if self.violation is not None:
            lines.append(f"  violated: {self.violation}")
        return "\n".join(lines)


# -- running a step in a forked child ---------------------------------------------------------------------------


@dataclass
class ChildOutcome:
    killed: bool
    text: str
    unexpected: str | None = None
    pid: int = 0


def run_in_child(body: Callable[[], str]) -> ChildOutcome:
    """Fork, run ``body`` in the child, report its outcome (or that it was SIGKILLed) to the parent."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest, whatever happens
        os.close(r)
        try:
            try:
                out: dict[str, Any] = {"text": body()}
            except UndoLogError as exc:
                out = {"text": f"raised {exc.code}"}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent as a finding
                out = {"text": f"raised {type(exc).__name__}", "unexpected": traceback.format_exc()}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return ChildOutcome(sig == signal.SIGKILL, f"killed by signal {sig}", pid=pid,
                            unexpected=None if sig == signal.SIGKILL else f"child died of signal {sig}")
    data = json.loads(b"".join(chunks) or b'{"text": "no answer"}')
    return ChildOutcome(False, data["text"], data.get("unexpected"), pid=pid)


# -- the harness ------------------------------------------------------------------------------------------------


@dataclass
class _Call:
    session: int
    tool: str
    user: str
    released: bool = False


@dataclass
class _Model:
    """The harness's own view of a sequence: what it asked for, and what it allowed a person to accept."""

    sessions: list[str]
    calls: dict[str, _Call] = field(default_factory=dict)
    rollback_requested: set[str] = field(default_factory=set)      # cleared when a person resumes the session
    ever_rollback_requested: set[str] = field(default_factory=set)
    acknowledged: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    kills: list[tuple[FaultPoint, int]] = field(default_factory=list)  # (point, pid) of every SIGKILLed child
    n: int = 0
    focus: str = "mixed"

    def new_call_id(self) -> str:
        self.n += 1
        return f"c{self.n}"


# Each sequence leans one way, so that 300 short sequences still reach deep into each area: the approval path
# (decide, release an approved call, re-issue it), the rollback path (several undo entries, walks killed midway,
# recoveries), or a mix.
FOCUS: dict[str, dict[str, int]] = {
    "mixed": {},
    "approvals": {"new_comp": 1, "new_irr": 2, "reissue": 2, "decide": 2, "release": 2, "rollback": 1},
    "rollbacks": {"new_comp": 2, "new_irr": 1, "release": 1, "rollback": 2, "recover": 2},
}


def _snapshot_query() -> Any:
    """The sequence's sessions (the ``sessions`` parameter), their effects and undo entries in one statement
    (``kind`` 0, 1, 2; each row has the columns of its own kind, the others NULL).

    The same three reads as three SELECTs (the same tables, the same ``session_id IN (...)``), in one round trip:
    the snapshot runs after every step, and on PostgreSQL each statement costs a round trip and its server CPU.
    Only the columns the checker, the generator and their messages read (``dump`` reads whole rows for a failure):
    the others (JSON snapshots of arguments and results, timestamps) cost a third of the snapshot's CPU to decode.
    The effects come first: a UNION's result types are its first SELECT's (``lease_until`` is a UTC timestamp).
    Built once (``_SNAPSHOT``): building it and its cache key per step cost twice what running it does.
    """
    e, u, s = t.effect_log, t.undo_stack, t.sessions
    sessions = sa.bindparam("sessions", expanding=True)

    def null(col: Any) -> Any:
        return sa.cast(sa.null(), col.type)

    effects = sa.select(sa.literal(1).label("kind"), e.c.seq.label("ord"), e.c.effect_id, e.c.session_id, e.c.state,
                        e.c.call_id, e.c.tool_name, e.c.owner, e.c.lease_until, null(s.c.halted_reason).label(
                            "halted_reason"), null(u.c.undo_id).label("undo_id")
                        ).where(e.c.session_id.in_(sessions))
    rows = sa.select(sa.literal(0), null(e.c.seq), null(e.c.effect_id), s.c.session_id, s.c.state, null(e.c.call_id),
                     null(e.c.tool_name), null(e.c.owner), null(e.c.lease_until), s.c.halted_reason, null(u.c.undo_id)
                     ).where(s.c.session_id.in_(sessions))
    undos = sa.select(sa.literal(2), u.c.undo_id, u.c.effect_id, u.c.session_id, u.c.state, null(e.c.call_id),
                      null(e.c.tool_name), null(e.c.owner), null(e.c.lease_until), null(s.c.halted_reason), u.c.undo_id
                      ).where(u.c.session_id.in_(sessions))
    return sa.union_all(effects, rows, undos).order_by(sa.literal_column("kind"), sa.literal_column("ord"))


_SNAPSHOT = _snapshot_query()


class Harness:
    """Runs sequences against one database (``u``: an UndoLog already open on it, else one is opened).

    Example:
        >>> h = Harness("sqlite:////dev/shm/h.db", schema=None, workdir=Path("/tmp/h"))
        >>> print(h.run(seed=7).describe())
    """

    def __init__(self, url: str, *, schema: str | None, workdir: Path, u: UndoLog | None = None) -> None:
        self.url = url
        self.schema = schema
        self.workdir = workdir
        self.u = u or UndoLog.open(url, schema=schema)
        self.u.register(*TOOLS)
        # An hour: timeouts happen only when the sequence says so (EXPIRE looks past every deadline).
        self.u.policy.set(actor="harness", approval_timeout_seconds=3600)
        self.counter = 0
        self._snap: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, {}, {})

    # -- generation --------------------------------------------------------------------------------------------

    def _gen_step(self, rng: random.Random, m: _Model) -> Step:
        pending = self._pending(m)
        approved = self._calls_in(m, ("approved",), IRREVERSIBLE_TOOLS)
        released = sorted(c for c, info in m.calls.items() if info.released)
        undoable = self._undoable(m)
        weights = {
            "new_comp": 5, "new_irr": 3, "reissue": 5 if (approved or released) else 1,
            "decide": 5 if pending else 0, "release": 3, "rollback": 4 if max(undoable) >= 2 else 1,
            "recover": 3, "expire": 1, "resume": 2,
        }
        for k, factor in FOCUS[m.focus].items():
            weights[k] *= factor
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]
        s = rng.randrange(len(m.sessions))
        if kind == "new_comp":
            tool = rng.choice(COMPENSABLE_TOOLS)
            fast = rng.random() < 0.25
            points = [FaultPoint.BEFORE_PREWRITE, FaultPoint.AFTER_PREWRITE, FaultPoint.AFTER_TOOL]
            if fast:
                points.append(FaultPoint.AFTER_MARK_QUEUED)
            return Step(Op.CALL, s, tool, m.new_call_id(), rng.choice(USERS),
                        fault=self._maybe(rng, points), fast=fast)
        if kind == "new_irr":
            return Step(Op.CALL, s, rng.choice(IRREVERSIBLE_TOOLS), m.new_call_id(), rng.choice(USERS))
        if kind == "reissue":
            pool = approved + released if (approved or released) else sorted(m.calls)
            if not pool:
                return Step(Op.RECOVER)
            cid = rng.choice(pool)
            info = m.calls[cid]
            # The points this re-issue can reach: an approved call is claimed, then runs; a released one re-runs;
            # anything else is a replay that reaches none (so it runs in the parent, no fork).
            points: list[FaultPoint] = []
            if cid in approved:
                points = [FaultPoint.AFTER_APPROVED_CLAIM, FaultPoint.AFTER_TOOL]
            elif cid in released:
                points = [FaultPoint.AFTER_TOOL]
            return Step(Op.CALL, info.session, info.tool, cid, info.user,
                        fault=self._maybe(rng, points) if points else None)
        if kind == "decide":
            cid = rng.choice(pending)
            info = m.calls[cid]
            op = rng.choice([Op.APPROVE, Op.APPROVE, Op.REJECT, Op.MODIFY])
            user = rng.choice([x for x in USERS if x != info.user]) if op is Op.MODIFY else None
            return Step(op, info.session, info.tool, cid, user)
        if kind == "release":
            if approved and rng.random() < 0.5:
                cid = rng.choice(approved)
                info = m.calls[cid]
                return Step(Op.RELEASE, info.session, info.tool, cid, info.user,
                            fault=self._maybe(rng, [FaultPoint.AFTER_APPROVED_CLAIM]))
            return Step(Op.RELEASE, s, rng.choice(COMPENSABLE_TOOLS), m.new_call_id(),
                        rng.choice(USERS), run_tool=rng.random() < 0.5,
                        fault=self._maybe(rng, [FaultPoint.BEFORE_PREWRITE, FaultPoint.AFTER_PREWRITE]))
        if kind == "rollback":
            s = max(range(len(m.sessions)), key=lambda i: (undoable[i], rng.random()))
            n = undoable[s]
            # Arm only points the walk reaches (a fork whose fault cannot fire is time spent on nothing).
            points = [FaultPoint.ROLLBACK_REQUESTED]
            if n >= 1:
                points += [FaultPoint.DURING_ROLLBACK, FaultPoint.AFTER_COMPENSATION]
            if n >= 2:
                points += [FaultPoint.BETWEEN_COMPENSATIONS] * 2
            point = self._maybe(rng, points, p=0.75)
            last = n - 2 if point is FaultPoint.BETWEEN_COMPENSATIONS else n - 1
            return Step(Op.ROLLBACK, s, fault=point, skip=rng.randint(0, max(0, last)))
        if kind == "recover":
            point = None
            if self._in_doubt():
                point = self._maybe(rng, [FaultPoint.DURING_RECOVERY, FaultPoint.DURING_ROLLBACK,
                                          FaultPoint.AFTER_COMPENSATION, FaultPoint.BETWEEN_COMPENSATIONS], p=0.5)
            return Step(Op.RECOVER, fault=point, skip=rng.choice([0, 0, 1]) if point else 0)
        if kind == "expire":
            return Step(Op.EXPIRE)
        return Step(Op.RESUME, s)

    @staticmethod
    def _maybe(rng: random.Random, points: list[FaultPoint], p: float = 0.6) -> FaultPoint | None:
        return rng.choice(points) if rng.random() < p else None

    def _undoable(self, m: _Model) -> list[int]:
        """How many undo entries each session has that a rollback would still compensate."""
        _, _, undos = self._snap
        return [sum(1 for ud in undos.values() if ud.session_id == sid and ud.state != "compensated")
                for sid in m.sessions]

    def _in_doubt(self) -> bool:
        """Whether recover() has anything to do in this sequence (else a fault armed in it could never fire)."""
        _, effects, undos = self._snap
        return any(ef.state in ("pending", "running") for ef in effects.values()) or any(
            ud.state == "compensating" for ud in undos.values())

    def _pending(self, m: _Model) -> list[str]:
        return self._calls_in(m, ("awaiting_approval",), IRREVERSIBLE_TOOLS)

    def _calls_in(self, m: _Model, states: tuple[str, ...], tools: tuple[str, ...]) -> list[str]:
        _, effects, _ = self._snap
        return sorted(ef.call_id for ef in effects.values()
                      if ef.tool_name in tools and ef.state in states and ef.call_id in m.calls)

    def _snapshot(self, m: _Model) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The sequence's sessions, effects and undo entries, as the store has them now (read once per step:
        the checker judges it, and the next step is generated from it)."""
        with internals(self.u).read() as c:
            rows = c.execute(_SNAPSHOT, {"sessions": m.sessions}).all()
        sessions = {row.session_id: row for row in rows if row.kind == 0}
        effects = {row.effect_id: row for row in rows if row.kind == 1}  # in log order (seq)
        undos = {row.effect_id: row for row in rows if row.kind == 2}
        self._snap = (sessions, effects, undos)
        return self._snap

    # -- running -----------------------------------------------------------------------------------------------

    def run(self, seed: int | None = None, steps: list[Step] | None = None, *, n_steps: int | None = None) -> Result:
        """Run one sequence: generated from ``seed``, or the given ``steps`` replayed exactly."""
        global _GT_PATH
        self.counter += 1
        tag = f"h{seed if seed is not None else 'r'}x{self.counter}"
        m = _Model(sessions=[f"{tag}-s0", f"{tag}-s1"])
        _GT_PATH = str(self.workdir / f"{tag}-{os.urandom(4).hex()}.jsonl")  # a replay must not see old lines
        rng = random.Random(seed)
        m.focus = rng.choice(sorted(FOCUS))
        if steps is None:
            total = n_steps or rng.randint(4, 10)
            generate = True
            plan: list[Step] = []
        else:
            total, generate, plan = len(steps), False, list(steps)
        for sid in m.sessions:
            self.u.session(session_id=sid)
        self._snapshot(m)
        done: list[Step] = []
        outcomes: list[str] = []
        res = Result(seed, done, outcomes, sessions=list(m.sessions))
        try:
            for i in range(total):
                step = self._gen_step(rng, m) if generate else plan[i]
                done.append(step)
                outcome, after_recover = self._do(step, m)
                outcomes.append(outcome)
                res.failed_at = i
                self.check(m, after_recover=after_recover)
            res.failed_at = len(done)
            rep = self.u.recover()
            outcomes.append(f"final recover: {_summary(rep.to_dict())}")
            self.check(m, after_recover=True)
            res.failed_at = None
        except Violation as v:
            res.violation = v
        return res

    def _do(self, step: Step, m: _Model) -> tuple[str, bool]:
        """Run one step; returns its outcome text and whether it was a recover() that finished."""
        global _ROLLBACK_REQUESTED
        sid = m.sessions[step.session]
        if step.op in (Op.APPROVE, Op.REJECT, Op.MODIFY, Op.EXPIRE, Op.RESUME):
            return self._in_parent(step, m, sid), False
        if step.op is Op.CALL and step.call_id and step.call_id not in m.calls:
            m.calls[step.call_id] = _Call(step.session, step.tool or "", step.user or "")
        if step.op is Op.RELEASE and step.call_id and step.call_id not in m.calls:
            m.calls[step.call_id] = _Call(step.session, step.tool or "", step.user or "")
        if step.op is Op.ROLLBACK:
            m.rollback_requested.add(sid)
            m.ever_rollback_requested.add(sid)
        _ROLLBACK_REQUESTED = frozenset(m.rollback_requested)
        if step.fault is None and not step.fast:
            # Nothing can kill it: the parent runs it (a fork and a fresh UndoLog cost more than most steps).
            out = self._here(step, sid)
        else:
            out = run_in_child(lambda: self._child(step, sid))
        if out.killed:
            assert step.fault is not None, f"{step} was killed with no fault armed"
            m.kills.append((step.fault, out.pid))
            return f"killed@{step.fault.value}", False
        if out.unexpected:
            raise Violation(Invariant.UNEXPECTED_ERROR, f"{step}: {out.unexpected}")
        if step.op is Op.RELEASE and out.text.startswith("released") and step.call_id:
            m.calls[step.call_id].released = True
        if step.op is Op.CALL and step.call_id in m.calls and out.text.startswith("ran"):
            m.calls[step.call_id].released = False
        return out.text, step.op is Op.RECOVER

    def _here(self, step: Step, sid: str) -> ChildOutcome:
        global _TOOL_U
        _TOOL_U = self.u
        try:
            return ChildOutcome(False, self._step(self.u, step, sid))
        except UndoLogError as exc:
            return ChildOutcome(False, f"raised {exc.code}")
        except Exception:  # noqa: BLE001 - reported as a finding
            return ChildOutcome(False, "raised", traceback.format_exc())

    def _child(self, step: Step, sid: str) -> str:
        """The body of a forked child: its own UndoLog (never the parent's pooled connections), one step."""
        global _TOOL_U
        u = UndoLog.open(self.url, schema=self.schema, migrate=False, fast_commit_mark=step.fast)
        _TOOL_U = u
        # Only what the step needs: a call its tool and the compensation, a rollback the compensation, recovery
        # everything (it reconciles any tool).
        if step.op in (Op.CALL, Op.RELEASE):
            _adopt(u, self.u, [step.tool or ""])
        elif step.op is Op.ROLLBACK:
            _adopt(u, self.u, [])
        else:
            _adopt(u, self.u, list(TOOL_FNS))
        if step.fault is not None:
            arm(step.fault, skip=step.skip)
        out = self._step(u, step, sid)
        arm(None)
        if step.fast:
            u.close()  # writes the queued commit marks; otherwise the child just exits (os._exit), as processes do
        return out

    def _step(self, u: UndoLog, step: Step, sid: str) -> str:
        if step.op is Op.CALL:
            s = u.session(session_id=sid)
            try:
                out = s.call_sync(step.tool, call_id=step.call_id, user=step.user)
            except UndoLogError as exc:
                return f"raised {exc.code}"
            return f"ran -> {json.dumps(out, sort_keys=True)}"
        if step.op is Op.RELEASE:
            d = u.engine.intercept(sid, step.tool or "", {"user": step.user}, call_id=step.call_id)
            if not isinstance(d, Execute) or d.effect_id is None:
                return f"not released: {type(d).__name__}"
            if step.run_tool:
                with u.engine.running(d, sid):
                    TOOL_FNS[step.tool or ""](**d.args)
            u.engine.release(d.effect_id)
            return "released"
        if step.op is Op.ROLLBACK:
            rep = u.rollback(sid)
            return f"rolled back: complete={rep.complete} steps={len(rep.steps)}"
        if step.op is Op.RECOVER:
            return f"recovered: {_summary(u.recover().to_dict())}"
        raise AssertionError(step.op)

    def _in_parent(self, step: Step, m: _Model, sid: str) -> str:
        try:
            if step.op is Op.EXPIRE:
                ids = self.u.approvals.expire_due(now=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
                mine = [i for i in ids if self._request_session(i) in m.sessions]
                return f"expired {len(mine)}"
            if step.op is Op.RESUME:
                self.u.sessions.resume(sid, actor="ana")
                m.rollback_requested.discard(sid)  # a person looked and let it go on
                m.acknowledged[sid] |= self._compensated_effects(sid)
                return "resumed"
            rid = self._request_for(m.sessions, step.call_id or "")
            if rid is None:
                return "no request"
            if step.op is Op.APPROVE:
                self.u.approvals.approve(rid, approver="ana")
            elif step.op is Op.REJECT:
                self.u.approvals.reject(rid, approver="ana", reason="harness says no")
            else:
                self.u.approvals.modify(rid, approver="ana", args={"user": step.user})
            return "decided"
        except UndoLogError as exc:
            return f"raised {exc.code}"
        except Exception as exc:  # noqa: BLE001 - a finding, reported with the sequence
            raise Violation(Invariant.UNEXPECTED_ERROR, f"{step}: {traceback.format_exc()}") from exc

    def _request_for(self, sessions: list[str], call_id: str) -> str | None:
        r = t.approval_requests
        with internals(self.u).read() as c:
            return c.execute(
                sa.select(r.c.approval_request_id).where(r.c.session_id.in_(sessions), r.c.call_id == call_id)
            ).scalar()

    def _request_session(self, rid: str) -> str | None:
        r = t.approval_requests
        with internals(self.u).read() as c:
            return c.execute(sa.select(r.c.session_id).where(r.c.approval_request_id == rid)).scalar()

    def _compensated_effects(self, sid: str) -> set[str]:
        e = t.effect_log
        with internals(self.u).read() as c:
            return set(c.execute(
                sa.select(e.c.effect_id).where(e.c.session_id == sid, e.c.state == "compensated")
            ).scalars())

    # -- the invariants ----------------------------------------------------------------------------------------

    def _open_transactions(self) -> str:
        """PostgreSQL: the other backends in a transaction now (a killed child's backend keeps its row locks until
        the server notices the child is gone), for a failure's message."""
        if not internals(self.u).is_postgres:
            return ""
        with internals(self.u).read() as c:
            rows = c.exec_driver_sql(
                "SELECT pid, state, application_name, now() - xact_start, left(query, 100) FROM pg_stat_activity "
                "WHERE datname = current_database() AND xact_start IS NOT NULL AND pid <> pg_backend_pid()").all()
        return "; other transactions open: " + ("none" if not rows else " | ".join(map(str, rows)))

    def check(self, m: _Model, *, after_recover: bool) -> None:
        """Raise :class:`Violation` for the first invariant the store and the ground truth break."""
        assert _GT_PATH is not None
        gt = gt_read(_GT_PATH)
        sessions, effects, undos = self._snapshot(m)

        # 1. No IRREVERSIBLE tool runs without an approved, uncancelled request (with the approved arguments), in a
        #    session that is neither halted nor rolled back (nor being rolled back), and none runs twice.
        runs = collections.Counter()
        for g in gt:
            if g["kind"] != "tool":
                continue
            where = f"{g['tool']} (effect {g['effect_id']}, session {g['session']})"
            if g["session_state"] in STOPPED or g["rollback_requested"]:
                raise Violation(Invariant.STOPPED_SESSION_RAN,
                                f"{where} ran while its session was {g['session_state']}"
                                + (" with a rollback requested" if g["rollback_requested"] else ""))
            if g["tool"] in IRREVERSIBLE_TOOLS:
                runs[g["key"]] += 1
                if g["req_state"] not in ("approved", "auto_approved"):
                    raise Violation(Invariant.IRREVERSIBLE_GATED,
                                    f"{where} ran with its approval request {g['request']} {g['req_state']}")
                if g["approved_args"] is not None and g["approved_args"] != g["args"]:
                    raise Violation(Invariant.IRREVERSIBLE_GATED,
                                    f"{where} ran with {g['args']}, approved were {g['approved_args']}")
                if runs[g["key"]] > 1:
                    raise Violation(Invariant.IRREVERSIBLE_GATED, f"{where} ran {runs[g['key']]} times")

        # 2. No compensation is lost: an undo entry recorded compensated really ran its compensation.
        comp_lines = [g for g in gt if g["kind"] == "comp"]
        ran_keys = collections.Counter(g["key"] for g in comp_lines)
        for eid, ud in undos.items():
            key = f"undo-{ud.undo_id}"
            if ud.state == "compensated" and not ran_keys[key]:
                raise Violation(Invariant.COMPENSATION_LOST,
                                f"undo entry {ud.undo_id} (effect {eid}) is compensated but {key} never ran")

        # 3. Each undo entry is compensated at most once, except the documented retry of the step in progress: a
        #    child killed after a compensation returned, before its success was recorded, may see it run again.
        allowed = collections.Counter()
        for point, pid in m.kills:
            if point is FaultPoint.AFTER_COMPENSATION:
                mine = [g["key"] for g in comp_lines if g["pid"] == pid]
                if mine:
                    allowed[mine[-1]] += 1
        for key, n in ran_keys.items():
            if n > 1 + allowed[key]:
                raise Violation(Invariant.COMPENSATED_TWICE,
                                f"{key} ran {n} times; kills after it ran allow {1 + allowed[key]}")

        # 6. A session is rolled back only when someone asked for it (our tools never fail, so no policy rollback).
        for sid, row in sessions.items():
            if row.state == "rolled_back" and sid not in m.ever_rollback_requested:
                raise Violation(Invariant.UNREQUESTED_ROLLBACK, f"session {sid} is rolled_back; nobody asked")

        if not after_recover:
            return

        # 7. recover() leaves nothing in flight: every child is dead, so no owner is alive.
        for eid, ef in effects.items():
            if ef.state in ("pending", "running"):
                raise Violation(Invariant.LEFT_IN_FLIGHT,
                                f"effect {eid} ({ef.tool_name}, call {ef.call_id}) still {ef.state} after recover() "
                                f"(owner {getattr(ef, 'owner', '?')}, lease {getattr(ef, 'lease_until', '?')})"
                                + self._open_transactions())

        # 4. A requested rollback ends rolled_back, or halted with a reason.
        for sid in sorted(m.rollback_requested):
            row = sessions[sid]
            if row.state == "rolled_back":
                continue
            if row.state == "halted" and (row.halted_reason or "").strip():
                continue
            raise Violation(Invariant.ROLLBACK_UNFINISHED,
                            f"session {sid}: rollback requested, after recover() it is {row.state}"
                            + (f" ({row.halted_reason})" if row.halted_reason else ""))

        # 2b. A rolled-back session has every undo entry compensated.
        for eid, ud in undos.items():
            if sessions[ud.session_id].state == "rolled_back" and ud.state != "compensated":
                raise Violation(Invariant.COMPENSATION_LOST,
                                f"session {ud.session_id} is rolled_back but undo entry {ud.undo_id} "
                                f"(effect {eid}, {effects[eid].tool_name}) is {ud.state}")

        # 5. No session is left writable with compensated effects a person has not seen (resume acknowledges).
        for eid, ef in effects.items():
            row = sessions[ef.session_id]
            if ef.state == "compensated" and row.state in WRITABLE and eid not in m.acknowledged[ef.session_id]:
                raise Violation(Invariant.ACTIVE_WITH_COMPENSATED,
                                f"session {ef.session_id} is {row.state} with effect {eid} ({ef.tool_name}, call "
                                f"{ef.call_id}) compensated")

    # -- reporting ---------------------------------------------------------------------------------------------

    def dump(self, m_sessions: Iterable[str]) -> str:
        """The store's rows for the given sessions, for a failure report."""
        e, u, s = t.effect_log, t.undo_stack, t.sessions
        out = []
        with internals(self.u).read() as c:
            for sid in m_sessions:
                row = c.execute(sa.select(s).where(s.c.session_id == sid)).first()
                out.append(f"session {sid}: {row.state if row else None} ({row.halted_reason if row else ''})")
                for ef in c.execute(sa.select(e).where(e.c.session_id == sid).order_by(e.c.seq)):
                    ud = c.execute(sa.select(u).where(u.c.effect_id == ef.effect_id)).first()
                    out.append(f"   {ef.call_id} {ef.tool_name} {ef.state}"
                               + (f" undo-{ud.undo_id}:{ud.state}" if ud else ""))
        return "\n".join(out)


TOOL_FNS: dict[str, Callable[..., Any]] = {
    "h_send": h_send, "h_send_probed": h_send_probed, "h_delete": h_delete, "h_delete_probed": h_delete_probed,
}


def _adopt(child: UndoLog, parent: UndoLog, tools: list[str]) -> None:
    """Give a forked child's own UndoLog the parent's registrations of ``tools`` and of the compensation.

    What ``child.register(...)`` would leave in its registry, without its cost (about 40% of a child's CPU: a
    pydantic argument model built per tool, and a transaction that reads each tool's newest contract revision): the
    parent registered the same functions on the same store (``Harness.__init__``), so a child's register would find
    every fingerprint stored already, write nothing and get the parent's revisions. The specs are the parent's
    objects, copied into the child by the fork; the child's connections stay its own.
    """
    src, dst = parent.registry, child.registry
    for name in tools:
        spec = src.tools[name]
        dst.tools[name] = spec
        if spec.fn is not None:
            dst.by_fn[spec.fn] = spec
    dst.compensations.update(src.compensations)


def _summary(report: dict[str, Any]) -> str:
    parts = []
    if report.get("reconciled"):
        parts.append("reconciled " + ",".join(str(x["outcome"]) for x in report["reconciled"]))
    if report.get("rollbacks_resumed"):
        parts.append(f"rollbacks resumed {len(report['rollbacks_resumed'])}")
    if report.get("dead_lettered"):
        parts.append(f"dead-lettered {len(report['dead_lettered'])}")
    if report.get("errors"):
        parts.append(f"errors {len(report['errors'])}")
    return "; ".join(parts) or "nothing to do"


def shrink(failing: Result, replay: Callable[[list[Step]], Result], budget: int = 40) -> Result:
    """Greedily simplify while the same invariant still fails (each replay on a fresh database): drop steps, then
    disarm faults and fast mode that the failure does not need."""
    assert failing.violation is not None
    best = failing
    target = failing.violation.invariant
    steps = list(failing.steps[: (failing.failed_at or len(failing.steps)) + 1])
    tries = 0

    def attempt(cand: list[Step]) -> bool:
        nonlocal best, steps, tries
        tries += 1
        res = replay(cand)
        if res.violation is None or res.violation.invariant is not target:
            return False
        steps = list(res.steps[: (res.failed_at or len(res.steps)) + 1])
        best = res
        return True

    changed = True
    while changed and tries < budget:
        changed = False
        i = 0
        while i < len(steps) and tries < budget:
            if attempt(steps[:i] + steps[i + 1:]):
                changed = True
            else:
                i += 1
    for i in range(len(steps)):
        if tries >= budget or i >= len(steps):
            break
        if steps[i].fault is not None or steps[i].fast:
            attempt(steps[:i] + [replace(steps[i], fault=None, skip=0, fast=False)] + steps[i + 1:])
    return best
