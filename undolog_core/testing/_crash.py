"""``check_undo(crash=True)``: the same faults as real SIGKILLs of a child process, then ``recover()`` here.

The child (``python -m undolog_core.testing._crash CONFIG``) opens the same database, imports the scenario and
the snapshot by path, and runs the scenario under the same tracker as the in-process check; where that one raises
its stop, the child writes down what it saw (the steps, the sessions, the snapshot before step k) and kills
itself with SIGKILL. The parent then runs ``recover()`` over the child's sessions (what a restarted service
does) and checks the world:

* killed right after step k (before the next gated call's pre-write): the calls are committed, so recovery
  leaves them; the parent rolls back step by step and step k's own compensation must restore the snapshot taken
  before step k (``StepReport.crash_restored``);
* killed after step k's pre-write, before the tool ran: recovery compensates it and the world must equal the
  snapshot before step k (``StepReport.crash_tolerates_never_happened``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._check import RunKind, ScenarioError, _json_snapshot, _Seen, _Tracker, run_scenario
from ._report import diff

if TYPE_CHECKING:
    from ._check import _Checker


def _load(spec: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ScenarioError(f"crash=True needs module:function paths, got {spec!r}")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


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


class _DyingTracker(_Tracker):
    out: str = ""

    def _stop(self) -> None:
        Path(self.out).write_text(json.dumps({
            "steps": [s.__dict__ for s in self.steps], "sessions": self.sessions, "before": self.before,
            "mismatch": self.mismatch,
        }))
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    from .._app import load_app
    from .._undolog import UndoLog
    from ._check import Run

    cfg = json.loads(argv[1])
    # The parent's database is migrated already: the child only opens it (a kill must not land in a migration).
    u = load_app(cfg["app"]) if cfg.get("app") else UndoLog.open(cfg["url"], schema=cfg["schema"], migrate=False)
    tracker = _DyingTracker(RunKind(cfg["kind"]), cfg["k"], cfg["expected"], _load(cfg["snapshot"]))
    tracker.out = cfg["out"]
    run = Run(cfg["run_id"], cfg["index"], RunKind(cfg["kind"]), cfg["k"])
    run_scenario(_load(cfg["scenario"]), u, run, tracker)
    tracker._stop()  # the scenario ended after step k: the crash comes at its end


if __name__ == "__main__":
    main(sys.argv)
