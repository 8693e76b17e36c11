"""The history checker (Jepsen style): concurrent clients on one database, faults from outside, and a checker of
what happened against what the log says.

A *run* starts 4 worker processes (``history_worker.py``) on one database (a PostgreSQL schema or one SQLite file);
each runs short histories (one session of 1-4 COMPENSABLE calls, some slow, some rolled back by their client) and
appends, from outside the product, every tool run, every compensation run and every answer its caller got. The
driver injects one fault plan per worker, derived from the run's seed: none; SIGKILL at a fault point (the worker is
started again for its remaining histories); or a stall, SIGSTOP past the 1 s lease while another process runs
``recover()``, then SIGCONT. Workers 2 and 3 look foreign (``UNDOLOG_HOST_ID``), so their stalls are taken over;
0 and 1 are local, so theirs must be left alone. Recoveries run in processes of their own (the code under test,
also when that code is a mutated copy). A checkpoint is signed mid-run and the trail verified against it at the end.

:func:`check` then asserts, per history and per effect:

* a COMPENSABLE effect whose tool ran ends ``committed``, or ``compensated`` by a compensation that ran after the
  tool ended, or ``unknown`` with its late finish recorded (the audit event ``effect.finished_late``);
* a call of a live local process (stopped, never killed) is never compensated behind its back;
* every caller's answer matches the log: no "done" for a call compensated without its client's rollback, no
  ``outcome_conflict`` for a call that is not ``unknown``;
* a compensation runs at most once per undo key, unless the process that ran it was killed before recording it;
* the audit trail verifies, against the checkpoint too.

A failing run prints its seed; ``UNDOLOG_HISTORY_SEED=<seed>`` replays that run.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
LEASE = 1.0
#: Where a worker may be killed: the points a COMPENSABLE call, a rollback and a recovery reach.
KILL_POINTS = ("after_prewrite", "after_tool", "rollback_requested", "during_rollback", "after_compensation",
               "between_compensations")


@dataclass
class Plan:
    """One worker's seeds and fault."""

    worker: int
    seeds: list[int]
    fault: str  # "none", "kill", "stall"
    point: str | None = None
    skip: int = 0

    @property
    def host(self) -> str | None:
        return f"elsewhere-{self.worker}" if self.worker >= 2 else None


@dataclass
class Run:
    seed: int
    plans: list[Plan]
    history: Path
    killed: set[int] = field(default_factory=set)
    stopped_local: set[int] = field(default_factory=set)
    stopped_foreign: set[int] = field(default_factory=set)


def plans_for(seed: int, histories: int, *, force: str | None = None) -> list[Plan]:
    """The run's fault plan: ``histories`` seeds dealt to the workers, one fault per worker. ``force``
    (``stall-local`` or ``stall-foreign``): only the local (0, 1) or only the foreign-looking (2, 3) workers stall,
    the others run without a fault (the mutation tests make sure the guard they remove is exercised)."""
    rng = random.Random(seed)
    plans = []
    for w in range(WORKERS):
        seeds = [seed * 1000 + w + WORKERS * i for i in range((histories + WORKERS - 1 - w) // WORKERS)]
        if force is not None:
            fault = "stall" if (w >= 2) == (force == "stall-foreign") else "none"
        else:
            fault = rng.choice(("none", "kill", "stall", "stall"))
        plans.append(Plan(w, seeds, fault, rng.choice(KILL_POINTS) if fault == "kill" else None, rng.randint(0, 2)))
    return plans


def _env(db_env: dict[str, str], history: Path, code_root: Path, plan: Plan | None, *, fault: bool,
         slow: bool = False) -> dict[str, str]:
    env = {**os.environ, **db_env, "HISTORY_FILE": str(history), "PYTHONPATH": f"{code_root}{os.pathsep}{ROOT}"}
    for k in ("UNDOLOG_FAULT", "UNDOLOG_FAULT_SKIP", "UNDOLOG_HOST_ID", "HISTORY_ALL_SLOW"):
        env.pop(k, None)
    if plan is not None and plan.host:
        env["UNDOLOG_HOST_ID"] = plan.host
    if plan is not None and plan.fault == "stall" and slow:
        env["HISTORY_ALL_SLOW"] = "1"
    if plan is not None and fault and plan.fault == "kill" and plan.point:
        env["UNDOLOG_FAULT"] = plan.point
        env["UNDOLOG_FAULT_SKIP"] = str(plan.skip)
    return env


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Started in the code's own root: ``-m`` puts the working directory first on sys.path, so a mutated copy's
    # ``undolog_core`` is the one imported (the tests come from PYTHONPATH).
    code_root = env["PYTHONPATH"].split(os.pathsep)[0]
    return subprocess.Popen([sys.executable, "-m", "tests.faults.history_worker", *args], env=env, cwd=code_root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def read(history: Path) -> list[dict[str, Any]]:
    if not history.exists():
        return []
    return [json.loads(x) for x in history.read_text().splitlines() if x.strip()]


def recover(db_env: dict[str, str], history: Path, code_root: Path) -> None:
    """Another process's recover() (the code under test, mutated or not)."""
    p = _spawn(["recover"], _env(db_env, history, code_root, None, fault=False))
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err.decode()


def drive(seed: int, histories: int, db_env: dict[str, str], workdir: Path, *, code_root: Path = ROOT,
          force: str | None = None, checkpoint: Any = None) -> Run:
    """Run the histories with their faults; returns what the checker needs."""
    history = workdir / f"history-{seed}.jsonl"
    run = Run(seed, plans_for(seed, histories, force=force), history)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for plan in run.plans:
        procs[plan.worker] = _spawn([str(plan.worker), *map(str, plan.seeds)],
                                    _env(db_env, history, code_root, plan, fault=True, slow=force is not None))
    stalled: set[int] = set()
    signed = False
    deadline = time.monotonic() + 600
    while procs:
        assert time.monotonic() < deadline, f"history run {seed} did not end"
        lines = read(history)
        if checkpoint is not None and not signed and len(lines) > 20:
            checkpoint()
            signed = True
        for w, p in list(procs.items()):
            plan = run.plans[w]
            if plan.fault == "stall" and w not in stalled and p.poll() is None and any(
                    x["kind"] == "run_start" and x["pid"] == p.pid and x["pause"] for x in lines):
                # Stopped inside a slow tool (its pre-write committed, no database lock held), as a VM freeze or a
                # laptop asleep would stop it.
                os.kill(p.pid, signal.SIGSTOP)
                stalled.add(w)
                (run.stopped_foreign if plan.host else run.stopped_local).add(p.pid)
                time.sleep(LEASE * 2.5)  # past its lease: its renewals are stopped too
                recover(db_env, history, code_root)
                os.kill(p.pid, signal.SIGCONT)
            code = p.poll()
            if code is None:
                continue
            del procs[w]
            if code == -signal.SIGKILL:
                run.killed.add(p.pid)
                done = {x["seed"] for x in read(history) if x["kind"] == "done"}
                left = [s for s in plan.seeds if s not in done]
                started = [x["seed"] for x in read(history) if x["kind"] == "history" and x["pid"] == p.pid]
                left = [s for s in left if not started or s != started[-1]]  # the killed history is not re-run
                if left:
                    procs[w] = _spawn([str(w), *map(str, left)], _env(db_env, history, code_root, plan, fault=False))
            else:
                assert code == 0, f"worker {w} of run {seed} failed: {p.stderr.read().decode() if p.stderr else ''}"
        time.sleep(0.05)
    time.sleep(LEASE * 1.5)  # every lease of the foreign-looking workers has run out
    recover(db_env, history, code_root)
    return run


def check(run: Run, store: Any, verify: Any) -> list[str]:
    """The checker: what the history says happened against what the log says. Returns the violations."""
    lines = read(run.history)
    problems: list[str] = []
    e, ev = sa.table("undolog_effect_log", sa.column("effect_id"), sa.column("session_id"), sa.column("call_id"),
                     sa.column("state"), sa.column("seq")), sa.table("undolog_approval_events", sa.column("subject"),
                                                                     sa.column("action"))
    with store.read() as c:
        effects = {r.effect_id: r for r in c.execute(sa.select(e.c.effect_id, e.c.session_id, e.c.call_id,
                                                               e.c.state, e.c.seq))}
        late = {r.subject.split(":", 1)[1] for r in c.execute(
            sa.select(ev.c.subject).where(ev.c.action == "effect.finished_late"))}
    by_call = {(r.session_id, r.call_id): r for r in effects.values()}
    index: dict[str, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    pid_of_start: dict[str, int] = {}
    for i, x in enumerate(lines):
        if x["kind"] in ("run_start", "run_end", "comp"):
            index[x["effect"]][x["kind"]].append(i)
        if x["kind"] == "run_start":
            pid_of_start[x["effect"]] = x["pid"]
    rollbacks = {x["session"]: i for i, x in enumerate(lines) if x["kind"] == "rollback"}
    for eid, seen in index.items():
        row = effects.get(eid)
        if row is None:
            problems.append(f"effect {eid}: its tool ran but the log has no such effect")
            continue
        if seen["run_end"]:
            if row.state == "compensated":
                if not seen["comp"] or max(seen["comp"]) < min(seen["run_end"]):
                    problems.append(f"effect {eid}: compensated, but its compensation ran before the tool ended "
                                    "(the side effect happened after its undo and the log says compensated)")
            elif row.state == "unknown":
                if eid not in late:
                    problems.append(f"effect {eid}: unknown without its late finish recorded")
            elif row.state != "committed":
                problems.append(f"effect {eid}: its tool ran, the log says {row.state}")
        pid = pid_of_start.get(eid)
        if (pid in run.stopped_local and pid not in run.killed and seen["comp"]
                and row.session_id not in rollbacks):
            problems.append(f"effect {eid}: a call of a live local process (stopped, not dead) was compensated "
                            "behind its back")
    for x in lines:
        if x["kind"] != "answer":
            continue
        row = by_call.get((x["session"], x["call"]))
        if row is None:
            problems.append(f"answer for {x['session']}/{x['call']}: no effect in the log")
            continue
        if x["ok"] and row.state not in ("committed",) and not (
                row.state == "compensated" and x["session"] in rollbacks):
            problems.append(f"effect {row.effect_id}: its caller was told done, the log says {row.state}")
        if not x["ok"] and x.get("code") == "outcome_conflict" and row.state != "unknown":
            problems.append(f"effect {row.effect_id}: its caller was told outcome_conflict, the log says {row.state}")
    comps = collections.Counter((x["key"], x["pid"]) for x in lines if x["kind"] == "comp")
    per_key: dict[str, list[int]] = collections.defaultdict(list)
    for (key, pid), n in comps.items():
        per_key[key] += [pid] * n
    for key, pids in per_key.items():
        if len(pids) > 1 and not any(p in run.killed for p in pids[:-1]):
            problems.append(f"compensation {key} ran {len(pids)} times with no crash between")
    report = verify()
    if not report.ok:
        problems.append(f"audit trail: {report.problem} (event {report.first_bad_event_id})")
    return problems
