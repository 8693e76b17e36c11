"""``check_undo``: break a scenario after every COMPENSABLE step and check that the compensations put the world back.

How it works (the docs' "Checking a compensation with check_undo"):

1. A learning run finds the scenario's COMPENSABLE steps 1..n (an IRREVERSIBLE call ends the checked part: the
   harness stops the scenario before it).
2. For each k, a run that is stopped right after step k: the next gated call raises :class:`InjectedStop` before
   its pre-write (a ``BaseException``, which no framework swallows). The harness then rolls the sessions back
   itself, one compensation at a time (the saga's ``progress`` callback): after step k's own compensation the
   world must equal the snapshot taken just before step k ran (``StepReport.restored``), after the whole
   rollback it must equal the starting snapshot (``fault_points[k].restored``). Then step k's compensation runs
   a second time with the same ``undo-{id}`` key: the world must not change (``idempotent``).
3. For each k, a run stopped right after step k's pre-write, before the tool ran, with this process counted as
   dead for that call (what a crash there leaves): ``recover()`` compensates it and the world must equal the
   snapshot taken before step k (``tolerates_never_happened``).
4. With ``crash=True``, both again with real SIGKILLs: ``crash_checks`` below runs each in a child process
   (``python -m undolog_core.testing._crash``, started by name: this module never imports it), then
   ``recover()`` here.

During a check no session rolls back on its own (the call driver's ``failure_rollbacks`` is off: the sessions'
and adapters' ``on_failure`` policy, and a ``with`` block left by an exception), so every compensation that runs
is one the harness asked for.
"""

from __future__ import annotations

import enum
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _faults
from .. import _observe as obs
from .._faults import FaultPoint
from .._saga import CompensationContext, RollbackStep, run_coro_blocking
from ..errors import UndoLogError
from ..storage.schema import EffectState
from ._report import FaultPointReport, StepReport, UndoReport, diff

if TYPE_CHECKING:
    from .._undolog import UndoLog

ACTOR = "undolog:check-undo"
_ONE_AT_A_TIME = threading.Lock()  # the fault hook is per process: one check at a time


@contextmanager
def _simulated() -> Iterator[None]:
    """Recover the crashes this check simulated: their halts are logged at INFO, not as warnings (a real crash's
    are); the check reports what it found itself."""
    token = obs.SIMULATED_CRASHES.set(True)
    try:
        yield
    finally:
        obs.SIMULATED_CRASHES.reset(token)


class InjectedStop(BaseException):  # noqa: N818 - it is not an error: it is the harness stopping the scenario
    """Raised by the harness at a gated call to stop the scenario there.

    A ``BaseException``, as LangGraph's own control flow is, so that frameworks and ``except Exception`` blocks
    let it through. A scenario must not catch it.
    """


class ScenarioError(UndoLogError):
    """The scenario cannot be checked (it changes between runs, or a snapshot is not JSON-able).

    Fix:
        Make the scenario call the same COMPENSABLE tools in the same order on every run (use ``run.id`` in its
        session ids), and make ``snapshot()`` return JSON-able data; the message names the step or the function.
    """

    code = "undo_check_scenario"


class RunKind(enum.StrEnum):
    """Why the harness runs the scenario."""

    LEARN = "learn"  # find the COMPENSABLE steps
    RESTORE = "restore"  # stop after step k, roll back step by step
    NEVER_HAPPENED = "never_happened"  # stop after step k's pre-write, the tool not run; recover()


@dataclass(frozen=True)
class Run:
    """One run of the scenario. Put ``id`` into the thread or session ids the scenario makes, so that runs never
    replay each other's stored results.

    Example:
        >>> def scenario(undolog, run):
        ...     with undolog.session(session_id=f"refund-{run.id}") as s:
        ...         s.call_sync(send_refund_email, user_id="u1", amount=5)
    """

    id: str
    index: int
    kind: RunKind
    stop_after: int | None = None


@dataclass
class _Seen:
    session_id: str
    tool: str
    effect_id: str


@dataclass
class _Tracker:
    """The fault hook of one run: records the steps, takes the snapshot before step k, stops where asked."""

    kind: RunKind
    k: int
    expected: list[str] | None
    snapshot: Callable[[], Any]
    steps: list[_Seen] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    before: Any = None
    took_before: bool = False
    irreversible: str | None = None
    mismatch: str | None = None
    stopped: bool = False
    failure: Exception | None = None  # the snapshot failed inside the scenario: raised once the run is wound up

    def __call__(self, point: FaultPoint, session_id: str | None, tool: str | None, effect_id: str | None) -> None:
        if point is FaultPoint.BEFORE_PREWRITE:
            if self.kind is not RunKind.LEARN and len(self.steps) >= self.k:
                self._stop()
        elif point is FaultPoint.AFTER_PREWRITE:
            assert session_id is not None and tool is not None and effect_id is not None
            n = len(self.steps) + 1
            # Recorded first, even when refused below: the harness winds up every call it stopped.
            self.steps.append(_Seen(session_id, tool, effect_id))
            if session_id not in self.sessions:
                self.sessions.append(session_id)
            if self.expected is not None and (n > len(self.expected) or self.expected[n - 1] != tool):
                want = self.expected[n - 1] if n <= len(self.expected) else "no further COMPENSABLE call"
                self.mismatch = f"COMPENSABLE step {n} was {tool} in this run, {want} in the first run"
                self._stop()
            if n == self.k:
                # The tool has not run yet: this is the world just before step k. A snapshot that fails here
                # would end the scenario as if with an error of its own: keep it, stop, and raise it after.
                try:
                    self.before = _json_snapshot(self.snapshot, f"before step {n}")
                except Exception as exc:  # noqa: BLE001 - raised by the harness once the run is wound up
                    self.failure = exc
                    self._stop()
                self.took_before = True
                if self.kind is RunKind.NEVER_HAPPENED:
                    self._stop()
        elif point is FaultPoint.BEFORE_GATE:
            self.irreversible = self.irreversible or tool
            if self.kind is not RunKind.LEARN and len(self.steps) < self.k:
                self.mismatch = (f"the scenario reached IRREVERSIBLE {tool} after {len(self.steps)} COMPENSABLE "
                                 f"step(s) in this run, after {len(self.expected or [])} in the first run")
            self._stop()

    def _stop(self) -> None:
        self.stopped = True
        raise InjectedStop("undolog check-undo stopped the scenario here")


def _json_snapshot(snapshot: Callable[[], Any], when: str) -> Any:
    value = snapshot()
    if inspect.isawaitable(value):
        value = run_coro_blocking(value)
    try:
        # Through JSON, so the comparison is of what the user declared (tuples and lists compare alike).
        return json.loads(json.dumps(value, sort_keys=True, default=_refuse))
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"snapshot() taken {when} is not JSON-able: {exc}") from None


def _refuse(value: Any) -> Any:
    raise TypeError(f"a {type(value).__name__} ({value!r:.60})")


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        return run_coro_blocking(out)
    return out


def _wants_run(scenario: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(scenario).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _stopped_by_us(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, InjectedStop):
            return True
        if isinstance(cur, BaseExceptionGroup) and any(_stopped_by_us(e) for e in cur.exceptions):
            return True  # a task group (asyncio's, a framework's) gathered the stop with its siblings
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


@contextmanager
def checking(undolog: UndoLog, tracker: _Tracker) -> Iterator[None]:
    """While the scenario runs: the tracker is the fault hook and no session rolls back on its own."""
    driver = undolog.driver
    held = driver.failure_rollbacks
    driver.failure_rollbacks = False
    _faults.set_hook(tracker)
    try:
        yield
    finally:
        _faults.set_hook(None)
        driver.failure_rollbacks = held


def run_scenario(scenario: Callable[..., Any], undolog: UndoLog, run: Run, tracker: _Tracker) -> str | None:
    """Run the scenario once under ``tracker``; the error it ended with (other than the harness's stop), if any."""
    args = (undolog, run) if _wants_run(scenario) else (undolog,)
    with checking(undolog, tracker):
        try:
            _call(scenario, *args)
        except BaseException as exc:  # noqa: BLE001 - the scenario's end, whatever it is, is reported
            if _stopped_by_us(exc) or tracker.stopped and not isinstance(exc, Exception):
                return None
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return f"{type(exc).__name__}: {exc}"
    return None


# -- the check ---------------------------------------------------------------------------------------------------


def check_undo(
    scenario: Callable[..., Any],
    *,
    snapshot: Callable[[], Any],
    reset: Callable[[], Any],
    undolog: UndoLog,
    idempotency: bool = True,
    never_happened: bool = True,
    crash: bool = False,
    crash_paths: dict[str, str] | None = None,
) -> UndoReport:
    """Break ``scenario`` after every COMPENSABLE step and check that its compensations restore the world.

    Args:
        scenario: ``scenario(undolog)`` or ``scenario(undolog, run)``, sync or async: real work through the
            UndoLog it is given (a session, a LangGraph agent with the middleware, a crew with wrapped tools, a
            kernel with the filter). It must make the same COMPENSABLE calls in the same order on every run.
        snapshot: a JSON-able picture of the part of the world a correct compensation restores (leave out the
            traces a compensation leaves on purpose, such as a ``recalled`` status or an operation log).
        reset: puts the world back to the scenario's starting point (called before every run, and at the end).
        undolog: the UndoLog the scenario works through (its database keeps the harness's sessions).
        idempotency: also run each compensation a second time with the same key.
        never_happened: also "crash" each step after its pre-write and let ``recover()`` compensate it.
        crash: also do both with real SIGKILLs in a child process, then ``recover()`` here; needs
            ``crash_paths`` = ``{"scenario": "module:fn", "snapshot": ..., "reset": ..., "app": optional}``.

    Returns:
        An :class:`UndoReport`; ``report.ok`` when everything held, ``report.explain()`` for the table.

    Raises:
        ScenarioError: the scenario's COMPENSABLE steps differ between runs, or a snapshot is not JSON-able.

    Example:
        >>> report = check_undo(scenario, snapshot=world_snapshot, reset=world_reset, undolog=ul)
        >>> assert report.ok, report.explain()
    """
    with _ONE_AT_A_TIME:
        return _Checker(scenario, snapshot, reset, undolog).check(idempotency, never_happened, crash, crash_paths)


class _Checker:
    def __init__(self, scenario: Callable[..., Any], snapshot: Callable[[], Any], reset: Callable[[], Any],
                 undolog: UndoLog) -> None:
        self.scenario = scenario
        self.snapshot = snapshot
        self.reset = reset
        self.u = undolog
        self.token = uuid.uuid4().hex[:8]
        self.runs = 0
        self.report = UndoReport()

    def reset_world(self) -> None:
        """``reset()``, its failure told as such (it is the user's code, not the harness's)."""
        try:
            _call(self.reset)
        except Exception as exc:
            raise ScenarioError(f"reset() raised {type(exc).__name__}: {exc}") from exc

    def _run(self, kind: RunKind, k: int, expected: list[str] | None) -> tuple[_Tracker, Any, str | None]:
        self.runs += 1
        self.reset_world()
        start = _json_snapshot(self.snapshot, "at the start")
        tracker = _Tracker(kind, k, expected, self.snapshot)
        run = Run(f"chk-{self.token}-{self.runs}", self.runs, kind, k or None)
        error = run_scenario(self.scenario, self.u, run, tracker)
        refused: BaseException | None = tracker.failure
        if refused is None and tracker.mismatch:
            refused = ScenarioError(f"the scenario is not deterministic: {tracker.mismatch}; check_undo needs the "
                                    "same COMPENSABLE calls in the same order on every run")
        if refused is None and expected is not None and kind is not RunKind.LEARN and len(tracker.steps) < k:
            refused = ScenarioError(
                f"the scenario is not deterministic: it made {len(tracker.steps)} COMPENSABLE call(s) in run "
                f"{run.id}, {len(expected)} in the first run" + (f" (it ended with {error})" if error else "")
                + "; a scenario that reuses a session or thread id meets its earlier, rolled-back run: put run.id "
                "in it")
        if refused is not None:
            self.wind_up(tracker)
            raise refused
        return tracker, start, error

    def wind_up(self, tracker: _Tracker) -> None:
        """A run the check gives up on: nothing of it may stay pending in the store, where a later ``recover()``
        would compensate it against a world the harness has reset. A call stopped after its pre-write is let go
        as a crashed one and recovered; then the run's sessions are rolled back."""
        try:
            for seen in tracker.steps:
                self.u.leases.abandon(seen.effect_id)
            if tracker.sessions:
                with _simulated():
                    self.u.recover(sessions=tracker.sessions)
            self._rollback(tracker, None, None)
        except Exception:  # noqa: BLE001, S110 - the error the check raises says more than this one
            pass

    def check(self, idempotency: bool, never_happened: bool, crash: bool,
              crash_paths: dict[str, str] | None) -> UndoReport:
        report = self.report
        try:
            learn, _start, error = self._run(RunKind.LEARN, 0, None)
            report.scenario_error = error
            if learn.irreversible:
                report.stopped_before = f"IRREVERSIBLE {learn.irreversible} (a person must approve it)"
            tools = [s.tool for s in learn.steps]
            for i, tool in enumerate(tools, start=1):
                spec = self.u.registry.tools.get(tool)
                comp = spec.compensation.name if spec is not None and spec.compensation is not None else "?"
                report.steps.append(StepReport(i, tool, comp))
            # The learning run's own sessions are rolled back too, so its effects do not stay in the world.
            self._rollback(learn, None, None)
            for step in report.steps:
                self._restore(step, tools, idempotency)
                if never_happened:
                    self._never_happened(step, tools)
            if crash:
                crash_checks(self, tools, crash_paths)
        except BaseException:
            report.runs = self.runs
            try:
                self.reset_world()
            except ScenarioError:
                pass  # the error already on its way says more; the world may not be at its start
            raise
        report.runs = self.runs
        self.reset_world()
        return report

    # -- stopped after step k ---------------------------------------------------------------------------------

    def _restore(self, step: StepReport, tools: list[str], idempotency: bool) -> None:
        k = step.index
        tracker, start, _error = self._run(RunKind.RESTORE, k, tools)
        target = tracker.steps[k - 1]
        effect_row = self._effect_row(target)
        fp = FaultPointReport(k)
        self.report.fault_points[k] = fp
        outcomes = self._rollback(tracker, target.effect_id, lambda s: self._first(step, tracker, s), fp)
        fp.rollback_steps = [f"{s.compensation_name} of {s.tool_name}: {s.outcome}" for s in outcomes]
        if step.restored is None:
            # Its compensation never ran in the harness's walk: something rolled the session back before (or
            # refused the walk), so nothing proves the step can be undone.
            step.restored = False
            step.errors.append(f"the compensation of step {k} did not run in the harness's rollback"
                               + (f" ({'; '.join(fp.errors)})" if fp.errors else " (was the session rolled back "
                                  "already?)"))
        after = _json_snapshot(self.snapshot, f"after rolling back from step {k}")
        fp.diff = diff(start, after)
        fp.restored = not fp.diff and not fp.errors
        done = next((s for s in outcomes if s.effect_id == target.effect_id), None)
        if idempotency and done is not None and done.outcome == "compensated" and effect_row is not None:
            self._again(step, target, effect_row, after)

    def _first(self, step: StepReport, tracker: _Tracker, s: RollbackStep) -> None:
        target = tracker.steps[step.index - 1]
        if s.effect_id != target.effect_id:  # pragma: no cover - nothing after step k was written
            step.restored = False
            step.errors.append(f"the rollback began with {s.tool_name} ({s.effect_id}), not with step {step.index}")
            return
        if s.outcome != "compensated":
            step.restored = False
            step.errors.append(f"rollback: {step.compensation} {s.outcome}: {s.error}")
            return
        now = _json_snapshot(self.snapshot, f"after the compensation of step {step.index}")
        step.diff = diff(tracker.before, now)
        step.restored = not step.diff

    def _effect_row(self, seen: _Seen) -> dict[str, Any] | None:
        for row in self.u.sessions.effects(seen.session_id):
            if row["effect_id"] == seen.effect_id:
                return row
        return None

    def _rollback(self, tracker: _Tracker, first_effect: str | None, on_first: Callable[[RollbackStep], None] | None,
                  fp: FaultPointReport | None = None) -> list[RollbackStep]:
        """Roll back every session of the run, newest step first, watching each compensation as it is done."""
        last: dict[str, int] = {}
        for i, s in enumerate(tracker.steps):
            last[s.session_id] = i
        order = sorted(tracker.sessions, key=lambda sid: last.get(sid, -1), reverse=True)
        done: list[RollbackStep] = []
        first = [True]
        failed: list[Exception] = []

        def progress(_n: int, _total: int, s: RollbackStep) -> None:
            if first[0] and on_first is not None:
                first[0] = False
                try:
                    on_first(s)
                except Exception as exc:  # noqa: BLE001 - a snapshot that failed: raised after the walk
                    failed.append(exc)  # not into the saga, which would stop half-way through the rollback

        for sid in order:
            try:
                rep = self.u.rollback(sid, actor=ACTOR, progress=progress)
            except UndoLogError as exc:
                if fp is not None:
                    fp.errors.append(f"rollback of session {sid} refused: {exc.message}")
                continue
            done.extend(rep.steps)
            if not rep.complete and fp is not None:
                fp.errors.append(f"rollback of session {sid} stopped: {rep.halted_reason}")
        if failed:
            raise failed[0]
        return done

    def _again(self, step: StepReport, target: _Seen, row: dict[str, Any], before: Any) -> None:
        """Run step k's compensation a second time, with the same key: the world must not change."""
        name = row["compensation_name"]
        comp = self.u.registry.compensations.get(name)
        if comp is None:  # pragma: no cover - the rollback just ran it
            return
        fn, _version = comp
        committed = row["state"] == EffectState.COMMITTED
        ctx = CompensationContext(
            args=dict(row["args_snapshot"] or {}), result=row["result_snapshot"] if committed else None,
            idempotency_key=f"undo-{row['undo_id']}", attempt=int(row.get("undo_attempts") or 0) + 2,
            effect_id=target.effect_id, session_id=target.session_id, tool_name=target.tool, undo_id=row["undo_id"],
            effect_state=row["state"],
        )
        try:
            _call(fn, ctx)
        except Exception as exc:  # noqa: BLE001 - reported on the step
            step.idempotent = False
            step.errors.append(f"the second run of {name} (same key undo-{row['undo_id']}) raised "
                               f"{type(exc).__name__}: {exc}")
            return
        now = _json_snapshot(self.snapshot, f"after running {name} again")
        step.idempotency_diff = diff(before, now)
        step.idempotent = not step.idempotency_diff

    # -- crashed after step k's pre-write -----------------------------------------------------------------------

    def _never_happened(self, step: StepReport, tools: list[str]) -> None:
        k = step.index
        tracker, _start, _error = self._run(RunKind.NEVER_HAPPENED, k, tools)
        target = tracker.steps[k - 1]
        # What a crash right here leaves: the effect pending, its owner gone. This process stops counting it as
        # its own, so recovery treats it exactly as a dead process's call.
        self.u.leases.abandon(target.effect_id)
        with _simulated():
            rep = self.u.recover(sessions=tracker.sessions)
        outcome = next((r["outcome"] for r in rep.reconciled if r["effect_id"] == target.effect_id), None)
        now = _json_snapshot(self.snapshot, f"after recovering step {k}")
        step.never_happened_diff = diff(tracker.before, now)
        step.tolerates_never_happened = outcome == "compensated" and not step.never_happened_diff
        if outcome != "compensated":
            why = "; ".join(rep.errors) or f"outcome {outcome}"
            step.errors.append(f"never happened: recover() did not compensate it: {why}")
        # The rest of the run (steps before k) is rolled back too, so the world and the store end quiet.
        self._rollback(tracker, None, None)


# -- killed for real (crash=True): the child is ``_crash``, started as a process -------------------------------


def crash_checks(checker: _Checker, tools: list[str], paths: dict[str, str] | None) -> None:
    """For every step, one child killed right after it and one killed after its pre-write."""
    if not paths or not all(paths.get(k) for k in ("scenario", "snapshot", "reset")):
        raise ScenarioError("crash=True runs the scenario in a child process: give crash_paths="
                            "{'scenario': 'module:fn', 'snapshot': 'module:fn', 'reset': 'module:fn'}")
    checker.report.crash = True
    for step in checker.report.steps:
        for kind in (RunKind.RESTORE, RunKind.NEVER_HAPPENED):
            seen = _child(checker, kind, step.index, tools, paths)
            tracker = _Tracker(kind, step.index, tools, checker.snapshot)
            tracker.steps = [_Seen(**s) for s in seen["steps"]]
            tracker.sessions = list(seen["sessions"])
            tracker.before = seen["before"]
            target = tracker.steps[step.index - 1]
            with _simulated():
                rep = checker.u.recover(sessions=tracker.sessions)
            if kind is RunKind.RESTORE:
                result: dict[str, Any] = {}

                def first(s: Any, result: dict[str, Any] = result, tracker: _Tracker = tracker,
                          target: _Seen = target) -> None:
                    if s.effect_id == target.effect_id and s.outcome == "compensated":
                        result["diff"] = diff(tracker.before, _json_snapshot(checker.snapshot, "after a crash"))

                checker._rollback(tracker, target.effect_id, first)
                step.crash_restored = result.get("diff") == []
                if step.crash_restored is False:
                    step.errors.append(f"crash after the step: not restored: {result.get('diff') or 'rollback failed'}")
            else:
                outcome = next((r["outcome"] for r in rep.reconciled if r["effect_id"] == target.effect_id), None)
                now = _json_snapshot(checker.snapshot, "after recovering a crash")
                changed = diff(tracker.before, now)
                step.crash_tolerates_never_happened = outcome == "compensated" and not changed
                if not step.crash_tolerates_never_happened:
                    why = "; ".join(rep.errors) or f"outcome {outcome}; {[str(d) for d in changed]}"
                    step.errors.append(f"crash after the pre-write: {why}")
                checker._rollback(tracker, None, None)


def _child(checker: _Checker, kind: RunKind, k: int, tools: list[str], paths: dict[str, str]) -> dict[str, Any]:
    checker.runs += 1
    checker.reset_world()
    store = checker.u.store
    with tempfile.TemporaryDirectory(prefix="undolog-check-") as tmp:
        result = Path(tmp) / "seen.json"
        cfg = {"url": store.url, "schema": store.schema, "app": paths.get("app"), "scenario": paths["scenario"],
               "snapshot": paths["snapshot"], "kind": kind.value, "k": k, "expected": tools,
               "run_id": f"chk-{checker.token}-{checker.runs}-crash", "index": checker.runs, "out": str(result)}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path])
        proc = subprocess.run([sys.executable, "-m", "undolog_core.testing._crash", json.dumps(cfg)],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != -signal.SIGKILL or not result.exists():
            raise ScenarioError(f"the crash child for step {k} did not stop where asked (exit {proc.returncode}): "
                                f"{proc.stderr[-2000:]}")
        seen: dict[str, Any] = json.loads(result.read_text())
    refused = None
    if seen.get("mismatch"):
        refused = ScenarioError(f"the scenario is not deterministic: {seen['mismatch']}")
    elif len(seen["steps"]) < k:
        refused = ScenarioError(f"the scenario made {len(seen['steps'])} COMPENSABLE call(s) in the crash child, "
                                f"{len(tools)} in the first run")
    if refused is not None:
        # The dead child's sessions are recovered and rolled back here before the check stops: left as they
        # are, a later recover() would compensate them against a world the harness has reset.
        tracker = _Tracker(kind, k, tools, checker.snapshot)
        tracker.steps = [_Seen(**s) for s in seen["steps"]]
        tracker.sessions = list(seen["sessions"])
        checker.wind_up(tracker)
        raise refused
    return seen
