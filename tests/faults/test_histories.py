"""The history checker in CI (issue 34): 4 client processes on one database (a PostgreSQL schema, or one SQLite
file) and a helper (recoveries, the scripted approver), faults injected from outside (SIGKILL at fault points,
SIGSTOP past a 1 s lease with the owner local or made to look foreign, UndoLog clock jumps forward and backward,
``pg_terminate_backend`` on PostgreSQL), every run checked by ``histories.check``; and the checker's own tests:
copies of the code with a guard removed must be reported as violations, and the same forced runs on the code as
it is must not.

CI: ``HISTORY_RUNS`` runs of ``HISTORIES_PER_RUN`` histories each (at least 100 histories per database);
``pytest --long`` runs ``LONG_RUNS`` more. A failing run names its seed; ``UNDOLOG_HISTORY_SEED=<seed>`` replays
only that run (``UNDOLOG_HISTORY_RUNS`` changes how many run).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .histories import FORCED, ROOT, check, close_zygote, drive

pytestmark = pytest.mark.storage

HISTORY_RUNS = 4
HISTORIES_PER_RUN = 25
LONG_RUNS = 40
#: Histories of a forced run (a mutation test or its control): enough for the removed guard to be reached twice.
FORCED_HISTORIES = 4

#: The approved call's claim, with the guard that refuses it in a session that stopped taking calls.
_GUARD_LINE = "                self.table.guard(conn, sc, count, pin=None)\n"
_CLAIM_GUARD = (_GUARD_LINE + "                epoch = self.store.effects.claim_effect_in(\n"
                "                    conn, row.effect_id, from_state=EffectState.APPROVED.value,")


def _runs(default: int) -> list[int]:
    if os.environ.get("UNDOLOG_HISTORY_SEED"):
        return [int(os.environ["UNDOLOG_HISTORY_SEED"])]
    n = int(os.environ.get("UNDOLOG_HISTORY_RUNS", default))
    return list(range(1, n + 1))


def _one(db: Any, tmp_path: Path, seed: int, *, code_root: Path = ROOT, force: str | None = None,
         histories: int = HISTORIES_PER_RUN) -> list[str]:
    from undolog_core._checkpoints import generate_keypair

    u = db.open()  # the schema made, and the reader of the log
    work = tmp_path / f"run-{seed}"
    work.mkdir()
    key, pub = generate_keypair(work / "audit.key")
    out = work / "checkpoints"

    def checkpoint() -> None:
        u.checkpoint_audit(key=key, out=out)

    def verify() -> Any:
        if not out.exists():
            checkpoint()
        return u.verify_audit(checkpoints=out, public_key=pub)

    try:
        run = drive(seed, histories, db.env, work, code_root=code_root, force=force, checkpoint=checkpoint)
    finally:
        if code_root != ROOT:
            close_zygote(code_root)  # a mutated copy serves one test
    return check(run, u.store, verify)


@pytest.mark.parametrize("seed", _runs(HISTORY_RUNS))
def test_histories_hold_under_kills_and_stalls(db: Any, tmp_path: Path, seed: int) -> None:
    problems = _one(db, tmp_path, seed)
    assert not problems, f"history run {seed} (replay: UNDOLOG_HISTORY_SEED={seed}):\n" + "\n".join(problems)


@pytest.mark.long
@pytest.mark.parametrize("seed", range(1000, 1000 + LONG_RUNS))
def test_histories_hold_long(db: Any, tmp_path: Path, seed: int) -> None:
    problems = _one(db, tmp_path, seed)
    assert not problems, f"history run {seed} (replay: UNDOLOG_HISTORY_SEED={seed}):\n" + "\n".join(problems)


def _mutant(tmp_path: Path, path: str, old: str, new: str) -> Path:
    """A copy of ``undolog_core`` with ``old`` replaced by ``new`` in ``path`` (which must contain it)."""
    root = tmp_path / "mutant"
    shutil.copytree(ROOT / "undolog_core", root / "undolog_core", ignore=shutil.ignore_patterns("__pycache__"))
    target = root / "undolog_core" / path
    text = target.read_text()
    assert old in text, f"the mutation no longer applies to {path}: the checker's test must follow the code"
    target.write_text(text.replace(old, new))
    return root


MUTATIONS: dict[str, tuple[str, str, str, str, Callable[[str], bool]]] = {
    # The stall rule: a live local owner is taken over once its lease ran out.
    "stall rule": ("_leases.py", "    if Owner.is_alive_locally(process):\n        return True\n", "", "stall-local",
                   lambda p: "live local process" in p),
    # The late finish: a call finishing after its take-over is not recorded (its caller gets the old error).
    "late finish record": ("_mark_queue.py", "            if state in LATE_FINISH_STATES:\n",
                           "            if False and state in LATE_FINISH_STATES:\n", "stall-foreign",
                           lambda p: "compensation ran before the tool ended" in p),
    # The released-after-halt check: an approved call is claimed to run without asking whether its session still
    # takes calls (a reject of its sibling halted it meanwhile).
    "released-after-halt check": ("_gate.py", _CLAIM_GUARD, _CLAIM_GUARD.replace(_GUARD_LINE, ""), "wires",
                                  lambda p: "asked for after the session stopped" in p),
    # The compensation dedupe: an undo entry is claimed whatever state and owner its walker saw (the compare-and-swap
    # gone), so a rollback stopped past its lease and taken over runs a compensation the recovery already ran.
    "compensation dedupe": ("storage/undo.py",
                            '_U.c.undo_id == undo_id, _U.c.state == seen_state, UNDO.guard("claim", _U.c.state), owner_is',
                            "_U.c.undo_id == undo_id", "stall-comp",
                            lambda p: p.startswith("compensation ") and "ran" in p),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_checker_reports_a_removed_guard(db: Any, tmp_path: Path, name: str) -> None:
    path, old, new, force, reported = MUTATIONS[name]
    root = _mutant(tmp_path, path, old, new)
    problems = _one(db, tmp_path, 7, code_root=root, force=force, histories=FORCED_HISTORIES)
    assert any(reported(p) for p in problems), f"the checker missed the removed {name}: {problems}"


@pytest.mark.parametrize("force", sorted(FORCED))
def test_the_mutation_tests_runs_hold_on_the_real_code(db: Any, tmp_path: Path, force: str) -> None:
    """The control of the mutation tests: the same forced runs against the code as it is give no violation."""
    problems = _one(db, tmp_path, 7, force=force, histories=FORCED_HISTORIES)
    assert not problems, problems
