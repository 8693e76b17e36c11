"""The SIGKILL child of ``check_undo(crash=True)``: the same faults as real SIGKILLs of a child process.

The child (``python -m undolog_core.testing._crash CONFIG``) opens the same database, imports the scenario and
the snapshot by path, and runs the scenario under the same tracker as the in-process check; where that one raises
its stop, the child writes down what it saw (the steps, the sessions, the snapshot before step k) and kills
itself with SIGKILL. The parent (``crash_checks`` in ``_check``, which starts this module by name and never
imports it) then runs ``recover()`` over the child's sessions (what a restarted service does) and checks the world:

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
import sys
from pathlib import Path
from typing import Any

from ._check import Run, RunKind, ScenarioError, _Tracker, run_scenario


def _load(spec: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ScenarioError(f"crash=True needs module:function paths, got {spec!r}")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


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
