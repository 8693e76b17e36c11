"""The history checker (Jepsen style): concurrent clients on one database, faults from outside, and a checker of
what happened against what the log says.

A *run* starts 4 worker processes (``history_worker.py``) on one database (a PostgreSQL schema or one SQLite file)
and one helper process (recoveries on the driver's demand, and the scripted approver: a person outside the product
who decides every IRREVERSIBLE request as its call's script says). Each worker runs short histories (one session of
1-4 COMPENSABLE calls, some slow, some with IRREVERSIBLE calls waiting for approval, some rolled back by their
client, some asking again after their session stopped) and appends, from outside the product, every ask, tool run,
compensation run and answer. The driver injects one fault plan per worker, derived from the run's seed:

* ``kill``: SIGKILL at a fault point (the worker is started again for its remaining histories);
* ``stall``: SIGSTOP inside a slow tool, then a recovery by the helper, then SIGCONT. Past the 1 s lease either
  for real (the driver sleeps) or by the helper's clock jumped forward past the lease;
* ``clock``: the worker jumps its own UndoLog clock (``undolog_core._clock``) forward or backward past the lease,
  and the helper recovers, its clock jumped too, while the worker's slow tool runs;
* ``terminate`` (PostgreSQL): the worker's connections are ended with ``pg_terminate_backend`` at random moments.

Workers 2 and 3 look foreign (``UNDOLOG_HOST_ID``), so their calls are taken over once their lease looks expired;
0 and 1 are local, so theirs must be left alone. A checkpoint is signed mid-run and the trail verified at the end.

:func:`check` then asserts, per history and per effect:

* a COMPENSABLE effect whose tool ran ends ``committed``, or ``compensated`` by a compensation that ran after the
  tool ended, or ``unknown`` with its late finish recorded (the audit event ``effect.finished_late``);
* a call of a live local process (stopped, never killed) is never compensated behind its back;
* an IRREVERSIBLE call runs at most once, and only after the scripted approver's approval, which the audit trail
  holds too;
* nothing runs in a session that was asked for after the session's halt or rollback committed (a reject, a
  client's rollback, a refusal its client got, or a recovery that saw it stopped);
* every caller's answer matches the log: no "done" for a call compensated without its client's rollback, no
  failure for a committed call, no ``outcome_conflict`` for a call that is not ``unknown``;
* a compensation runs at most once per undo key, unless a process that ran it before was killed, taken over, or
  had its connection cut before recording it;
* the audit trail verifies, against the checkpoint too.

A failing run prints its seed; ``UNDOLOG_HISTORY_SEED=<seed>`` replays that run.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import random
import select
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
#: Where a worker may be killed: the points a COMPENSABLE call, an approved IRREVERSIBLE call, a rollback and a
#: recovery reach.
KILL_POINTS = ("after_prewrite", "after_tool", "rollback_requested", "during_rollback", "after_compensation",
               "between_compensations", "after_approved_claim")
#: Forced runs (the mutation tests and their controls): only the workers a removed guard matters for get histories,
#: and their fault is the one that exercises it.
FORCED = {
    "stall-local": ("stall", (0, 1)),  # a live local owner stopped past its lease: the stall rule
    "stall-foreign": ("stall", (2, 3)),  # a foreign owner taken over, its late finish recorded
    "stall-comp": ("stall", (2, 3)),  # a foreign rollback stopped inside a compensation: the dedupe
    "wires": ("none", (0, 2)),  # an approved call re-asked after a reject halted its session
}


@dataclass
class Plan:
    """One worker's seeds and fault."""

    worker: int
    seeds: list[int]
    fault: str  # "none", "kill", "stall", "clock", "terminate"
    point: str | None = None
    skip: int = 0
    real: bool = False  # a stall waits out the lease for real (else the helper's clock jumps past it)
    jump: float = 0.0  # a clock fault: the worker's own jump
    helper_jump: float = 0.0  # ... and the helper's, for the recovery during the worker's slow tool

    @property
    def host(self) -> str | None:
        return f"elsewhere-{self.worker}" if self.worker >= 2 else None


@dataclass
class Run:
    seed: int
    plans: list[Plan]
    history: Path
    force: str | None = None
    killed: set[int] = field(default_factory=set)
    stopped_local: set[int] = field(default_factory=set)
    #: pids whose compensations may run once more: their calls may be taken over while they run (foreign-looking),
    #: or the record of a compensation met a cut connection (``terminate``).
    taken_over: set[int] = field(default_factory=set)
    #: pid -> worker
    workers: dict[int, int] = field(default_factory=dict)


def plans_for(seed: int, histories: int, *, force: str | None = None, postgres: bool = False) -> list[Plan]:
    """The run's fault plan: ``histories`` seeds dealt to the workers, one fault per worker. ``force``: one of
    :data:`FORCED` (the mutation tests make sure the guard they remove is exercised)."""
    rng = random.Random(seed)
    faults = ("none", "kill", "kill", "stall", "stall", "clock", "clock") + (("terminate",) * 2 if postgres else ())
    active = FORCED[force][1] if force else tuple(range(WORKERS))
    plans = []
    for w in range(WORKERS):
        if w in active:
            k = active.index(w)
            seeds = [seed * 1000 + w + WORKERS * i for i in range((histories + len(active) - 1 - k) // len(active))]
        else:
            seeds = []
        fault = FORCED[force][0] if force else rng.choice(faults)
        plan = Plan(w, seeds, fault, rng.choice(KILL_POINTS) if fault == "kill" else None, rng.randint(0, 2),
                    real=force is None and rng.random() < 0.3)
        if fault == "clock":
            plan.jump = rng.choice((3.0, -3.0)) * LEASE
            plan.helper_jump = rng.choice((2.5, -2.5, 10.0)) * LEASE
            plan.skip = rng.randint(0, max(0, len(seeds) - 1))
        plans.append(plan)
    return plans


def _env(db_env: dict[str, str], history: Path, plan: Plan | None, *, fault: bool,
         force: str | None = None, seed: int = 0) -> dict[str, str]:
    env = {**os.environ, **db_env, "HISTORY_FILE": str(history)}
    for k in ("UNDOLOG_FAULT", "UNDOLOG_FAULT_SKIP", "UNDOLOG_HOST_ID", "HISTORY_ALL_SLOW", "HISTORY_COMP_PAUSE",
              "HISTORY_CLOCK", "HISTORY_FORCE", "HISTORY_STALL_GATE"):
        env.pop(k, None)
    if plan is None:
        return env
    env["HISTORY_COMP_PAUSE"] = "1"
    if plan.host:
        env["UNDOLOG_HOST_ID"] = plan.host
    if force is not None:
        env["HISTORY_FORCE"] = {"stall-comp": "comp", "wires": "wires"}.get(force, "slow")
        if force != "wires":
            env["HISTORY_ALL_SLOW"] = "1"
    if plan.fault == "clock":
        env["HISTORY_CLOCK"] = f"{plan.jump}@{plan.skip}"
    if plan.fault == "stall":
        env["HISTORY_STALL_GATE"] = str(_stall_gate(history, plan))
    if fault and plan.fault == "kill" and plan.point:
        env["UNDOLOG_FAULT"] = plan.point
        env["UNDOLOG_FAULT_SKIP"] = str(plan.skip)
    if env["UNDOLOG_DATABASE_URL"].startswith("postgresql"):
        # Named, so the driver can end this worker's connections and no one else's.
        url = env["UNDOLOG_DATABASE_URL"]
        env["UNDOLOG_DATABASE_URL"] = f"{url}{'&' if '?' in url else '?'}application_name={_app_name(seed, plan)}"
    return env


def _stall_gate(history: Path, plan: Plan) -> Path:
    """The file the driver creates once it has stopped a stall worker and recovered behind it: the worker's stalled
    pause lasts until then (``history_worker._pause``), so the stop always lands inside it."""
    return history.parent / f"{history.stem}-stall-gate-w{plan.worker}"


def _app_name(seed: int, plan: Plan) -> str:
    return f"hist-{os.getpid()}-{seed}-w{plan.worker}"


class Zygote:
    """A process that imported the code under test once and forks the run's workers, recoveries and approver
    (``history_worker.zygote``). Starting a fresh interpreter per process cost 5-20 s of a run on a loaded machine;
    a fork costs milliseconds. One per code root (the code as it is, or a mutated copy): :func:`zygote_for`."""

    def __init__(self, code_root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{code_root}{os.pathsep}{ROOT}"}
        for k in ("UNDOLOG_FAULT", "UNDOLOG_FAULT_SKIP", "UNDOLOG_HOST_ID"):
            env.pop(k, None)
        # Started in the code's own root: ``-m`` puts the working directory first on sys.path, so a mutated copy's
        # ``undolog_core`` is the one imported (the tests come from PYTHONPATH).
        self.p = subprocess.Popen([sys.executable, "-m", "tests.faults.history_worker", "zygote"], env=env,
                                  cwd=code_root, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.exited: dict[int, int] = {}
        self._buf = b""
        self._spawned: list[int] = []
        assert self._next(300.0) == "ready", "the history zygote did not start"

    def _next(self, timeout: float) -> str | None:
        """The zygote's next line that is not an exit report (those are kept in ``exited``), or None."""
        assert self.p.stdout is not None
        end = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                line = raw.decode()
                if line.startswith("exit "):
                    _, pid, code = line.split()
                    self.exited[int(pid)] = int(code)
                else:
                    return line
            ready, _, _ = select.select([self.p.stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.p.stdout.fileno(), 1 << 16)
            assert chunk, f"the history zygote ended (exit {self.p.poll()})"
            self._buf += chunk

    def spawn(self, args: list[str], env: dict[str, str], err: Path) -> int:
        assert self.p.stdin is not None
        self.p.stdin.write(b"spawn " + json.dumps({"args": args, "env": env, "err": str(err)}).encode() + b"\n")
        self.p.stdin.flush()
        line = self._next(60.0)
        assert line is not None and line.startswith("pid "), f"the history zygote did not fork: {line!r}"
        pid = int(line.split()[1])
        self._spawned.append(pid)
        return pid

    def poll(self, pid: int) -> int | None:
        self._next(0.0)
        return self.exited.get(pid)

    def wait(self, pid: int, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while pid not in self.exited and time.monotonic() < end:
            self._next(min(0.05, max(0.0, end - time.monotonic())))
        return self.exited.get(pid)

    def kill_all(self) -> None:
        """Every process this zygote forked that has not ended (a failed run leaves none behind)."""
        self._next(0.0)
        for pid in self._spawned:
            if pid not in self.exited:
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._spawned = [p for p in self._spawned if p not in self.exited]

    def close(self) -> None:
        self.kill_all()
        if self.p.poll() is None:
            assert self.p.stdin is not None
            try:
                self.p.stdin.write(b"quit\n")
                self.p.stdin.flush()
                self.p.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.p.kill()


_ZYGOTES: dict[Path, Zygote] = {}


def zygote_for(code_root: Path) -> Zygote:
    z = _ZYGOTES.get(code_root)
    if z is None or z.p.poll() is not None:
        z = _ZYGOTES[code_root] = Zygote(code_root)
    return z


def close_zygote(code_root: Path) -> None:
    z = _ZYGOTES.pop(code_root, None)
    if z is not None:
        z.close()


atexit.register(lambda: [close_zygote(r) for r in list(_ZYGOTES)])


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig``; False when the process has ended (and was reaped) meanwhile."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def read(history: Path, *, live: bool = False) -> list[dict[str, Any]]:
    """The history's lines. ``live``: read while workers still write, so a last line without its newline is a line
    being written (a read(2) of a regular file is not atomic against another process's write(2): the driver once
    saw half of a worker's line) and is left for the next read; every other line, and every line of a finished
    history, must parse."""
    if not history.exists():
        return []
    text = history.read_text()
    if live and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return [json.loads(x) for x in text.splitlines() if x.strip()]


class Helper:
    """Another process's recover() (the code under test, mutated or not), forked on demand with its UndoLog clock
    moved ``offset`` seconds; and the scripted approver, a process of its own for the whole run."""

    def __init__(self, z: Zygote, db_env: dict[str, str], history: Path, workdir: Path) -> None:
        self.z, self.workdir = z, workdir
        self.env = _env(db_env, history, None, fault=False)
        self.stop = workdir / "stop-approver"
        self.approver = z.spawn(["approver"], {**self.env, "HISTORY_STOP": str(self.stop)}, workdir / "err-approver")
        self.n = 0

    def recover(self, offset: float = 0.0, *, stopped: int | None = None) -> None:
        """Run a recovery and wait for it. ``stopped``: a process stopped meanwhile, continued if the recovery waits
        on it too long (a stop can catch its lease thread inside a write, holding a lock recovery needs)."""
        self.n += 1
        err = self.workdir / f"err-recover-{self.n}"
        pid = self.z.spawn(["recover", str(offset)], self.env, err)
        code = self.z.wait(pid, 10.0) if stopped is not None else None
        if code is None and stopped is not None:
            _signal(stopped, signal.SIGCONT)
        code = self.z.wait(pid, 180.0) if code is None else code
        assert code == 0, f"recovery failed (exit {code}): {err.read_text() if err.exists() else ''}"

    def close(self) -> None:
        self.stop.touch()
        code = self.z.wait(self.approver, 120.0)
        err = self.workdir / "err-approver"
        assert code == 0, f"approver failed (exit {code}): {err.read_text() if err.exists() else ''}"


def _terminator(db_env: dict[str, str]) -> Any:
    """Ends every connection of one worker (PostgreSQL), as a restarted server or a dropped network would."""
    engine = sa.create_engine(db_env["UNDOLOG_DATABASE_URL"], pool_size=1, max_overflow=0,
                              isolation_level="AUTOCOMMIT")

    def terminate(app: str) -> int:
        with engine.connect() as c:
            return len(c.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %(a)s",
                {"a": app}).fetchall())

    terminate.engine = engine  # type: ignore[attr-defined]
    return terminate


def drive(seed: int, histories: int, db_env: dict[str, str], workdir: Path, *, code_root: Path = ROOT,
          force: str | None = None, checkpoint: Any = None) -> Run:
    """Run the histories with their faults; returns what the checker needs."""
    history = workdir / f"history-{seed}.jsonl"
    history.touch()  # the approver reads it from its first moment
    postgres = db_env["UNDOLOG_DATABASE_URL"].startswith("postgresql")
    run = Run(seed, plans_for(seed, histories, force=force, postgres=postgres), history, force)
    rng = random.Random(seed + 1)
    z = zygote_for(code_root)
    terminate = _terminator(db_env) if postgres and any(p.fault == "terminate" for p in run.plans) else None
    procs: dict[int, int] = {}  # worker -> pid
    errs: dict[int, Path] = {}

    def start(plan: Plan, seeds: list[int], fault: bool) -> None:
        err = workdir / f"err-w{plan.worker}-{len(errs)}"
        pid = z.spawn([str(plan.worker), *map(str, seeds)],
                      _env(db_env, history, plan, fault=fault, force=force, seed=seed), err)
        procs[plan.worker], errs[pid] = pid, err
        run.workers[pid] = plan.worker
        if plan.host or plan.fault == "terminate":
            # A foreign-looking owner is taken over whenever a recovery thinks its lease ran out, which a recovery
            # whose clock jumped forward thinks of every lease; a compensation whose success met a cut connection
            # is not recorded. Either way a compensation it ran may run once more (under the same undo key).
            run.taken_over.add(pid)

    try:
        helper = Helper(z, db_env, history, workdir)
        for plan in run.plans:
            if plan.seeds:
                start(plan, plan.seeds, True)
        acted: set[int] = set()
        next_cut = {w: time.monotonic() + rng.uniform(0.2, 0.8) for w in range(WORKERS)}
        signed = False
        deadline = time.monotonic() + 600
        while procs:
            assert time.monotonic() < deadline, f"history run {seed} did not end"
            lines = read(history, live=True)
            if checkpoint is not None and not signed and len(lines) > 20:
                checkpoint()
                signed = True
            for w, pid in list(procs.items()):
                plan = run.plans[w]
                mine = [x for x in lines if x["pid"] == pid]
                if plan.fault == "stall" and w not in acted and z.poll(pid) is None and any(
                        x["kind"] == ("comp" if force == "stall-comp" else "run_start") and x.get("pause")
                        for x in mine):
                    # Stopped inside a slow tool or compensation (its claim committed, no database lock held by
                    # that thread), as a VM freeze or a laptop asleep would stop it.
                    acted.add(w)
                    if not _signal(pid, signal.SIGSTOP):
                        continue  # it ended between the read and the stop (its last history had ended)
                    if plan.host is None:
                        run.stopped_local.add(pid)
                    if plan.real:
                        time.sleep(LEASE * 2.5)  # past its lease: its renewals are stopped too
                        helper.recover(0.0, stopped=pid)
                    else:
                        helper.recover(LEASE * 2.5, stopped=pid)  # the recoverer's clock is past the lease
                    _stall_gate(history, plan).touch()  # its pause ends once it runs again
                    _signal(pid, signal.SIGCONT)
                if plan.fault == "clock" and w not in acted and z.poll(pid) is None:
                    jumped = [i for i, x in enumerate(mine) if x["kind"] == "clock"]
                    if jumped and any(x["kind"] == "run_start" and x.get("pause") for x in mine[jumped[0]:]):
                        acted.add(w)  # recovered while the tool runs, by a recovery whose clock jumped too
                        helper.recover(plan.helper_jump)
                # Once the worker is open (an open whose connection is cut fails with DatabaseOpenFailed, as it
                # should): from then on every cut must heal.
                if (plan.fault == "terminate" and mine and z.poll(pid) is None
                        and time.monotonic() >= next_cut[w]):
                    assert terminate is not None
                    terminate(_app_name(seed, plan))
                    next_cut[w] = time.monotonic() + rng.uniform(0.2, 0.8)
                code = z.poll(pid)
                if code is None:
                    continue
                del procs[w]
                if code == -signal.SIGKILL:
                    run.killed.add(pid)
                    done = {x["seed"] for x in read(history, live=True) if x["kind"] == "done"}
                    left = [s for s in plan.seeds if s not in done]
                    started = [x["seed"] for x in read(history, live=True) if x["kind"] == "history" and x["pid"] == pid]
                    left = [s for s in left if not started or s != started[-1]]  # the killed history is not re-run
                    if left:
                        start(plan, left, False)
                else:
                    assert code == 0, f"worker {w} of run {seed} failed (exit {code}): {errs[pid].read_text()}"
            time.sleep(0.05)
        # Every worker has ended: a recovery whose clock is past every lease takes up what they left.
        helper.recover(LEASE * 3)
        helper.close()
    finally:
        z.kill_all()
        if terminate is not None:
            terminate.engine.dispose()
    return run


def check(run: Run, store: Any, verify: Any) -> list[str]:
    """The checker: what the history says happened against what the log says. Returns the violations."""
    lines = read(run.history)
    problems: list[str] = []
    e = sa.table("undolog_effect_log", sa.column("effect_id"), sa.column("session_id"), sa.column("call_id"),
                 sa.column("state"), sa.column("seq"), sa.column("tier"))
    ev = sa.table("undolog_approval_events", sa.column("subject"), sa.column("action"))
    rq = sa.table("undolog_approval_requests", sa.column("approval_request_id"), sa.column("effect_id"))
    with store.read() as c:
        effects = {r.effect_id: r for r in c.execute(sa.select(e.c.effect_id, e.c.session_id, e.c.call_id,
                                                               e.c.state, e.c.seq, e.c.tier))}
        events = [(r.subject, r.action) for r in c.execute(sa.select(ev.c.subject, ev.c.action))]
        request_of = {r.effect_id: r.approval_request_id for r in c.execute(
            sa.select(rq.c.approval_request_id, rq.c.effect_id))}
    late = {s.split(":", 1)[1] for s, a in events if a == "effect.finished_late"}
    approved_in_audit = {s.split(":", 1)[1] for s, a in events if a in ("approve", "modify")}
    by_call = {(r.session_id, r.call_id): r for r in effects.values()}
    index: dict[str, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    start_of: dict[str, dict[str, Any]] = {}
    for i, x in enumerate(lines):
        if x["kind"] in ("run_start", "run_end", "comp"):
            index[x["effect"]][x["kind"]].append(i)
        if x["kind"] == "run_start":
            start_of.setdefault(x["effect"], x)
    rollbacks = {x["session"]: i for i, x in enumerate(lines) if x["kind"] == "rollback"}
    # An approval the scripted approver gave, by request, at its line.
    approved_at = {x["request"]: i for i, x in enumerate(lines) if x["kind"] == "decided" and x["action"] == "approve"}
    for eid, seen in index.items():
        row = effects.get(eid)
        if row is None:
            problems.append(f"effect {eid}: its tool ran but the log has no such effect")
            continue
        first = start_of.get(eid)
        if first is not None and first.get("tool") == "h_wire":
            if len(seen["run_start"]) > 1:
                problems.append(f"effect {eid}: an approved IRREVERSIBLE call ran {len(seen['run_start'])} times")
            rid = request_of.get(eid)
            if rid is None or rid not in approved_in_audit:
                problems.append(f"effect {eid}: an IRREVERSIBLE call ran without an approval in the audit trail")
            if rid is None or approved_at.get(rid, len(lines)) > min(seen["run_start"]):
                problems.append(f"effect {eid}: an IRREVERSIBLE call ran before the approver approved it")
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
        pid = first["pid"] if first is not None else None
        if (pid in run.stopped_local and pid not in run.killed and seen["comp"]
                and row.session_id not in rollbacks):
            problems.append(f"effect {eid}: a call of a live local process (stopped, not dead) was compensated "
                            "behind its back")
    problems += _nothing_after_stop(lines)
    for x in lines:
        if x["kind"] != "answer":
            continue
        row = by_call.get((x["session"], x["call"]))
        if row is None:
            if x["ok"]:
                problems.append(f"answer done for {x['session']}/{x['call']}: no effect in the log")
            continue
        if x["ok"] and row.state not in ("committed",) and not (
                row.state == "compensated" and x["session"] in rollbacks):
            problems.append(f"effect {row.effect_id}: its caller was told done, the log says {row.state}")
        if not x["ok"] and x.get("code") != "approval_pending" and row.state == "committed":
            problems.append(f"effect {row.effect_id}: its caller was told {x.get('code')}, the log says committed")
        if not x["ok"] and x.get("code") == "outcome_conflict" and row.state != "unknown":
            problems.append(f"effect {row.effect_id}: its caller was told outcome_conflict, the log says {row.state}")
    runs: dict[str, list[int]] = collections.defaultdict(list)
    for x in lines:
        if x["kind"] == "comp":
            runs[x["key"]].append(x["pid"])
    excused = run.killed | run.taken_over
    for key, pids in runs.items():
        for k in range(1, len(pids)):
            if not any(p in excused for p in pids[:k]):
                problems.append(f"compensation {key} ran {len(pids)} times (by pids {pids}) with no crash or "
                                "take-over of an earlier runner")
                break
    report = verify()
    if not report.ok:
        problems.append(f"audit trail: {report.problem} (event {report.first_bad_event_id})")
    if problems:
        # What a replay cannot be counted on to show again (the faults land by timing): the plans, and each named
        # effect's own lines of the history, so the failure can be read from CI's log alone.
        named = {p.split()[1].rstrip(":") for p in problems if p.startswith("effect ")}
        problems.append("plans: " + "; ".join(
            f"w{p.worker} {p.fault}{'@' + p.point if p.point else ''}{' foreign' if p.host else ''}"
            + (f" jump={p.jump}/{p.helper_jump}" if p.fault == "clock" else "") for p in run.plans)
            + "; pids: " + ", ".join(f"{pid}=w{w}" for pid, w in sorted(run.workers.items())))
        problems.extend("  " + json.dumps(x) for x in lines if x.get("effect") in named
                        or (x.get("pid") in {start_of[n]["pid"] for n in named if n in start_of}
                            and x["kind"] in ("rollback", "recover", "clock")))
    return problems


def _nothing_after_stop(lines: list[dict[str, Any]]) -> list[str]:
    """Nothing runs that was asked for after its session's halt or rollback committed. Evidence of the commit, each
    written after it: a reject the approver got back, a rollback its client got back, a refusal a client got (its
    session had stopped), a recovery that saw the session stopped."""
    stopped_at: dict[str, int] = {}
    for i, x in enumerate(lines):
        sessions: list[str] = []
        if x["kind"] == "decided" and x["action"] == "reject":
            sessions = [x["session"]]
        elif x["kind"] == "rolled_back" or (x["kind"] == "answer" and x.get("code") in (
                "session_halted", "session_closed", "outcome_conflict", "approval_rejected")):
            sessions = [x["session"]]
        elif x["kind"] == "recovered":
            sessions = x["stopped"]
        for s in sessions:
            stopped_at.setdefault(s, i)
    problems = []
    asked: dict[tuple[str, str], int] = {}
    for i, x in enumerate(lines):
        if x["kind"] == "ask":
            asked[(x["session"], x["call"])] = i  # the latest ask before a run is the one that ran it
        elif x["kind"] == "run_start":
            at = asked.get((x["session"], x["call"]))
            stop = stopped_at.get(x["session"])
            if at is not None and stop is not None and stop < at:
                problems.append(f"effect {x['effect']}: call {x['call']} ran in session {x['session']}, asked for "
                                f"after the session stopped (history line {stop}: {lines[stop]['kind']})")
    return problems
