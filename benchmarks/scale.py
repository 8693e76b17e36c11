"""Benchmark: many worker processes on one PostgreSQL.

Four measurements, each printed with what it is compared against:

1. ``throughput``: N worker processes (1, 2, 4, 8) each running sessions of COMPENSABLE calls, against the same
   number of processes doing bare durable two-row inserts (psycopg, default ``synchronous_commit``) on the same
   database. Goal: UndoLog >= 80% of the bare throughput at every N. Beside UndoLog, in both modes, its lower
   bound (``lower_bound_worker``: the same statements on raw connections, none of UndoLog's bookkeeping), marked
   reachable or OUT OF REACH for the goal, and UndoLog over it. Each row has its CPU per call, the workers' own
   (client) and their PostgreSQL backends' (server, from /proc): from 2 workers on, a 2-core machine that runs
   both is CPU bound, and the ratio is the bare CPU per insert over the CPU per call.
2. ``expire``: approval requests past their timeout expired by ``approvals.expire_due()`` from N processes at
   once. Goal: >= 3,000/s with 4 workers, more workers never slower, each request timed out exactly once
   (checked: one ``timeout`` audit event and one ``approval.timed_out`` outbox row per request, the audit chain
   verifies). The due requests are raised once (``seed_expire_template``) and copied into a fresh schema per run
   (``clone_schema``), so every run starts from the same rows. Each worker first sweeps two requests of its own, as
   a running server's sweeper has (``warm_sweeper``); ``--expire-cold`` also times each process's very first
   sweep. ``--expire-rounds`` (7) runs every worker count once per round, and the base count (2) a second time,
   in a shuffled order: per pair (each count against the next smaller one), the median of the per-round ratios
   with their p25-p75, in rate and in CPU per timeout, and a verdict read against the base count's pair with
   itself, the measurement's own spread (``expire_verdict``), and the same for the database work per timeout
   (blocks and index entries read, from PostgreSQL's statistics: counts, steady on a busy machine).
   ``--expire-probe`` adds the sweepers' wait events (sampled; it takes CPU in the timed window).
3. ``recover``: ``recover()`` of 1,000 (and 10,000) in-flight COMPENSABLE effects left by a SIGKILLed process,
   trivial compensations, on PostgreSQL and SQLite. Goal: 1,000 in < 2 s, 10,000 in < 20 s; each compensation
   run exactly once.
4. ``api``: approvals decided per second through the REST API with 4 ``undolog serve`` processes.

    python benchmarks/scale.py                      # everything (several minutes)
    python benchmarks/scale.py --quick              # a few seconds: the CI smoke run
    python benchmarks/scale.py --only expire,recover --workers 1,2,4,8
    python benchmarks/scale.py --only throughput --variants bare,durable,fast   # without the lower bounds
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from undolog_core import ApprovalPending, ToolTier, UndoLog, compensation, undolog_tool  # noqa: E402

# Internal on purpose: the lower-bound row batches its marks on fast mode's own flush period, so it is compared
# with UndoLog under the same durability window (not a setting a user picks, hence not public API).
from undolog_core._mark_queue import MARK_FLUSH_SECONDS  # noqa: E402
from undolog_core.integration import Execute  # noqa: E402

# The halts recovery and expiry make are logged at WARNING, one per session: thousands of lines here.
logging.getLogger("undolog").setLevel(logging.ERROR)

PG_URL = os.environ.get("UNDOLOG_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


# -- the tools ------------------------------------------------------------------------------------------------


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="scale_cancel")
def scale_refund(user_id: str, amount: int) -> dict[str, Any]:
    return {"refunded": user_id, "amount": amount}


_CANCELLED: list[str] = []


@compensation("scale_cancel")
def scale_cancel(ctx: Any) -> None:
    _CANCELLED.append(ctx.idempotency_key)


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="benchmark", risk_tags=["bench"])
def scale_close(account: str) -> dict[str, Any]:
    return {"closed": account}


def register(u: UndoLog) -> None:
    """``--app`` hook for the server processes."""
    u.register(scale_refund)
    u.register(scale_cancel)
    u.register(scale_close)


def open_undolog(url: str, schema: str | None) -> UndoLog:
    u = UndoLog.open(url, schema=schema)
    register(u)
    return u


def fresh_schema() -> str:
    return f"scale_{uuid.uuid4().hex[:10]}"


def drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as con:
        con.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def run_workers(n: int, target: Callable[..., Any], args: tuple[Any, ...],
                released: list[float] | None = None,
                ready: Callable[[], None] | None = None) -> tuple[float, list[Any]]:
    """Start ``n`` processes, release them at once, return (wall seconds from the release, their results);
    ``released`` gets the release's ``time.monotonic()``; ``ready`` is called once every worker is prepared, before
    the release.

    A worker that is done waits, alive, until every worker is: a process exiting (its interpreter torn down, its
    PostgreSQL backend ended) is no part of the work measured, and a running server's worker does not exit when it
    has nothing left to do. Exiting at once, a worker that finished early (an expire worker that found every sweep
    slot held: half of them at 8) spent its teardown, about 5 ms of CPU and its backend's exit, on the cores the
    others were still working on, inside the timed window."""
    ctx = mp.get_context("fork")
    start, done = ctx.Event(), ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(target, i, start, out, args, done)) for i in range(n)]
    for p in procs:
        p.start()
    ready_ = [out.get(timeout=120) for _ in procs]
    assert all(r == "ready" for r in ready_), ready_
    if ready is not None:
        ready()
    if released is not None:
        released.append(time.monotonic())
    t0 = time.perf_counter()
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    done.set()
    for p in procs:
        p.join(60)
    errors = [r for r in results if isinstance(r, str) and r.startswith("error")]
    if errors:
        raise SystemExit("\n".join(errors))
    return wall, results


def _worker_main(target: Callable[..., Any], i: int, start: Any, out: Any, args: tuple[Any, ...],
                 done: Any) -> None:
    try:
        prepared = target(i, None, *args)  # prepare (connect, warm up)
        out.put("ready")
        start.wait()
        out.put(target(i, prepared, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put(f"error in worker {i}: {exc!r}\n{traceback.format_exc()}")
    done.wait(600)  # exit once every worker is done (see ``run_workers``)


# -- CPU accounting: the workers' own (client) and their PostgreSQL backends' (server) ---------------------------

def _proc_cpu(pid: int) -> float:
    """Seconds of CPU process ``pid`` has used (/proc/<pid>/schedstat: on-CPU time in nanoseconds, exact where
    /proc/<pid>/stat counts clock ticks); 0 if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return 0.0


def _backends(app: str) -> list[int]:
    """The pids of the PostgreSQL backends whose ``application_name`` is ``app`` (one worker's connections)."""
    import psycopg

    with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as con:
        return [r[0] for r in con.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,))]


class CpuMeter:
    """One worker's CPU over its timed run: ``time.process_time()`` of the worker process (every thread) and the
    CPU its PostgreSQL backends used, read from /proc (the server runs on this machine). A backend opened during
    the run counts whole (its start-up included: a connection opened per call would be charged for)."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.client0 = 0.0
        self.server0: dict[int, float] = {}

    def start(self) -> None:
        self.server0 = {pid: _proc_cpu(pid) for pid in _backends(self.app)}
        self.client0 = time.process_time()

    def stop(self) -> tuple[float, float]:
        """(client seconds, server seconds) since ``start``; call it before the connections close."""
        client = time.process_time() - self.client0
        server = sum(_proc_cpu(pid) - self.server0.get(pid, 0.0) for pid in _backends(self.app))
        return client, server


def _app_name(kind: str, i: int) -> str:
    return f"scale-{kind}-{i}-{uuid.uuid4().hex[:8]}"


def _with_app(url: str, app: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={app}"


def _postgres_pids() -> list[int]:
    """Every process of the local PostgreSQL server (backends of anyone, WAL writer, checkpointer...)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/comm") as f:
                    if f.read().strip() == "postgres":
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def _postgres_cpu() -> dict[int, float]:
    return {pid: _proc_cpu(pid) for pid in _postgres_pids()}


def _other_postgres_cpu(before: dict[int, float]) -> float:
    """CPU since ``before`` of the PostgreSQL processes alive then and now: the server's own (WAL writer,
    checkpointer, autovacuum) and anyone else's long-lived backends, not the workers' (opened after ``before``)."""
    now = _postgres_cpu()
    return sum(now[pid] - cpu for pid, cpu in before.items() if pid in now)


# -- 1. throughput: sessions of COMPENSABLE calls vs bare two-row inserts ---------------------------------------


_BASE_DDL = [
    "CREATE TABLE IF NOT EXISTS bench_effect (effect_id text primary key, session_id text, tool text, args text, "
    "created_at timestamp)",
    "CREATE TABLE IF NOT EXISTS bench_undo (undo_id text primary key, effect_id text references bench_effect, "
    "args text, created_at timestamp)",
]


def bare_worker(i: int, prepared: Any, schema: str, seconds: float, sessions: int = 1) -> Any:
    """``sessions`` threads, each with its own connection (what a bare application serving that many requests at
    once holds), each doing one durable two-row insert transaction after another."""
    import psycopg

    if prepared is None:
        app = _app_name("bare", i)
        return [psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1),
                                options=f"-csearch_path={schema}", application_name=app)
                for _ in range(sessions)], CpuMeter(app)
    conns, meter = prepared
    args = json.dumps({"user_id": "u1", "amount": 5})
    end = time.perf_counter() + seconds

    def loop(con: Any) -> int:
        n = 0
        while time.perf_counter() < end:
            a, b = uuid.uuid4().hex, uuid.uuid4().hex
            now = dt.datetime.now()
            with con.cursor() as cur:
                cur.execute("INSERT INTO bench_effect VALUES (%s, %s, %s, %s, %s)",
                            (a, f"s{i}", "scale_refund", args, now))
                cur.execute("INSERT INTO bench_undo VALUES (%s, %s, %s, %s)", (b, a, args, now))
            con.commit()
            n += 1
        return n

    meter.start()
    n = _in_threads(loop, conns)
    client, server = meter.stop()
    for con in conns:
        con.close()
    return {"calls": n, "client": client, "server": server}


def _in_threads(fn: Callable[[Any], int], items: list[Any]) -> int:
    if len(items) == 1:
        return fn(items[0])
    with ThreadPoolExecutor(len(items)) as pool:
        return sum(pool.map(fn, items))


CALLS_PER_SESSION = 10


def undolog_worker(i: int, prepared: Any, schema: str, seconds: float, sessions: int = 1,
                   fast: bool = False) -> Any:
    """``sessions`` threads sharing one ``UndoLog`` (one process serving that many agent sessions at once), each
    running sessions of ten COMPENSABLE calls one after another."""
    if prepared is None:
        app = _app_name("fast" if fast else "durable", i)
        u = UndoLog.open(_with_app(PG_URL, app), schema=schema, fast_commit_mark=fast, pool_size=max(5, sessions))
        register(u)
        s = u.session(agent_id=f"warm-{i}")
        for k in range(CALLS_PER_SESSION):
            s.call_sync("scale_refund", user_id="u", amount=k)
        s.complete()
        return u, CpuMeter(app)
    u, meter = prepared
    end = time.perf_counter() + seconds

    def loop(t: int) -> int:
        n = 0
        while time.perf_counter() < end:
            s = u.session(agent_id=f"worker-{i}-{t}")
            for k in range(CALLS_PER_SESSION):
                s.call_sync("scale_refund", user_id=f"u{k}", amount=k)
                n += 1
            s.complete()
        return n

    meter.start()
    n = _in_threads(loop, list(range(sessions)))
    u.engine.flush_marks()  # fast mode: every queued mark written inside the measured CPU
    client, server = meter.stop()
    u.close()
    return {"calls": n, "client": client, "server": server}


def lower_bound_worker(i: int, prepared: Any, schema: str, seconds: float, sessions: int = 1,
                       fast: bool = False) -> Any:
    """The work no implementation of UndoLog's guarantees can skip, with none of UndoLog's bookkeeping: a lower
    bound, not a competitor. Raw psycopg connections (one per thread, autocommit), and per call: validate the
    arguments, take their JSON snapshot and canonical text, digest it, mint an effect id, run UndoLog's own
    one-statement pre-write (the session checked, the effect and its undo entry, durably), run the tool, serialise
    its result and run UndoLog's own commit mark: durably at once, or (``fast``) queued and written by the
    session's end statement, as fast mode's ``complete()`` does on PostgreSQL. Per session of ten calls, UndoLog's
    own session statements: its row written by the first call's pre-write statement (the row the other pre-writes
    check has to exist), and its end. Left out, although
    UndoLog needs them: the pool, the session cache and pins, the in-flight set and lease, ``current_call()``, the
    recent-calls ring, call-id handling, the driver. If this misses the goal, no trimming of UndoLog's own code
    meets it on this machine: only storing less (or in fewer commits) would. The statements are sent by the hot
    path's own functions (``undolog_core.storage.postgres``), so the client's cost per statement is the same too.
    The fast marks go as fast mode sends them, and as often: in the session's end statement (``pg_end_session``
    with the queued marks), and in a batch of their own (``pg_mark_many``, not fsynced) whenever
    ``MARK_FLUSH_SECONDS`` passed since the last batch, since fast mode promises
    a queued mark is written within that period (its background flusher), not only at ``complete()``. Without
    that periodic batch the bound left out a statement UndoLog must send (1.0 batches per session here against
    1.6-1.8 for UndoLog on a loaded machine, where a session outlasts the period)."""
    import psycopg

    # Internal on purpose: the lower bound canonicalises and hashes with UndoLog's own code, so the row measures
    # the writes and not a different serialiser.
    from undolog_core._json import canonical_text, sha256_hex
    from undolog_core.limits import result_text
    from undolog_core.storage import postgres as pg
    from undolog_core.storage.base import new_id

    if prepared is None:
        app = _app_name("lb-fast" if fast else "lb-durable", i)
        u = open_undolog(PG_URL, schema)
        spec, owner, lease = u.tool_spec("scale_refund"), u.engine.owner, u.lease_seconds
        u.close()
        dsn = PG_URL.replace("postgresql+psycopg://", "postgresql://", 1)
        conns = [(psycopg.connect(dsn, options=f"-csearch_path={schema}", application_name=app, autocommit=True),
                  psycopg.connect(dsn, options=f"-csearch_path={schema} -csynchronous_commit=off",
                                  application_name=app, autocommit=True) if fast else None)
                 for _ in range(sessions)]
        return conns, CpuMeter(app), spec, owner, lease
    conns, meter, spec, owner, lease = prepared
    assert spec.compensation is not None
    comp, version, name, revision = spec.compensation.name, spec.compensation.version, spec.name, spec.revision
    validate, fn, pins = spec.args_model.__pydantic_validator__.validate_python, scale_refund, {name: revision}
    # The hot path's own statement functions (PostgreSQL), on these raw connections.
    prewrite, mark, end_session = pg.pg_prewrite, pg.pg_mark, pg.pg_end_session
    first_prewrite = pg.pg_prewrite_starting
    end = time.perf_counter() + seconds

    def loop(pair: tuple[Any, Any]) -> int:
        con, fast_con = pair
        n = 0
        flushed = time.monotonic()
        while time.perf_counter() < end:
            sid = new_id()
            start = {"agent_id": f"lb-{i}", "created_by": None, "on_failure": "rollback", "pinned_revisions": pins,
                     "created_at": time.time()}
            marks: list[tuple[str, str, float]] = []
            for k in range(CALLS_PER_SESSION):
                model = validate({"user_id": f"u{k}", "amount": k})
                text = canonical_text(model.model_dump(mode="json"))
                effect_id = new_id()
                t = time.time()
                # The session's row goes in with its first call's pre-write, as UndoLog writes it.
                if not (first_prewrite(con, start, sid, 0, effect_id, effect_id, name, revision, text,
                                       sha256_hex(text), owner, t, t + lease, comp, version) if k == 0 else
                        prewrite(con, sid, 0, effect_id, effect_id, name, revision, text, sha256_hex(text), owner,
                                 t, t + lease, comp, version)):
                    raise RuntimeError("the lower bound's pre-write was refused")
                result = result_text(fn(**model.__dict__))
                if fast_con is None:
                    if not mark(con, effect_id, result, time.time(), owner):
                        raise RuntimeError("the lower bound's mark found no effect in flight")
                else:
                    marks.append((effect_id, result, time.time()))
                    if time.monotonic() - flushed >= MARK_FLUSH_SECONDS:  # what fast mode's flusher does
                        pg.pg_mark_many(fast_con, marks, owner)
                        marks, flushed = [], time.monotonic()
                n += 1
            # The marks still queued ride in the end's statement, as fast mode's end sends them.
            if not end_session(con, sid, CALLS_PER_SESSION, "completed", ["active"], time.time(), marks, owner):
                raise RuntimeError("the lower bound's session did not end")
            if marks:
                flushed = time.monotonic()
        return n

    meter.start()
    n = _in_threads(loop, conns)
    client, server = meter.stop()
    for pair in conns:
        for con in pair:
            if con is not None:
                con.close()
    return {"calls": n, "client": client, "server": server}


GOAL = 0.8
VARIANTS = ("bare", "durable", "fast", "lb_durable", "lb_fast")


def bench_throughput(workers: list[int], seconds: float, rounds: int = 2, sessions: int = 1,
                     variants: tuple[str, ...] = VARIANTS) -> list[dict[str, Any]]:
    """Interleaved rounds of: bare inserts, UndoLog with durable commit marks, UndoLog in fast mode (the mark
    without fsync; the pre-write stays durable), and the lower bound of each mode (``lower_bound_worker``). A rate
    is the calls of its runs over their summed wall time; CPU per call is the workers' own (client) and their
    backends' (server), summed over the runs and divided by their calls. ``server_other`` is the CPU of the other
    PostgreSQL processes over the runs (the WAL writer, and anyone else's backends: noisy on a shared machine)."""
    rows = []
    for n in workers:
        schema = fresh_schema()
        u = open_undolog(PG_URL, schema)
        u.close()
        import psycopg

        with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1),
                             options=f"-csearch_path={schema}", autocommit=True) as con:
            for ddl in _BASE_DDL:
                con.execute(ddl)
        assert "bare" in variants, "every ratio is over the bare inserts"
        tot = {k: {"calls": 0, "wall": 0.0, "client": 0.0, "server": 0.0, "server_other": 0.0} for k in variants}
        plan = (("bare", bare_worker, (schema, seconds, sessions)),
                ("durable", undolog_worker, (schema, seconds, sessions, False)),
                ("fast", undolog_worker, (schema, seconds, sessions, True)),
                ("lb_durable", lower_bound_worker, (schema, seconds, sessions, False)),
                ("lb_fast", lower_bound_worker, (schema, seconds, sessions, True)))
        plan = tuple(p for p in plan if p[0] in variants)
        for _ in range(rounds):
            for name, target, args in plan:
                pg0 = _postgres_cpu()
                w, res = run_workers(n, target, args)
                t = tot[name]
                t["server_other"] += _other_postgres_cpu(pg0)
                t["wall"] += w
                for r in res:
                    t["calls"] += r["calls"]
                    t["client"] += r["client"]
                    t["server"] += r["server"]
        drop_schema(schema)
        row: dict[str, Any] = {"workers": n}
        rate = {k: tot[k]["calls"] / tot[k]["wall"] for k in variants}
        for k in variants:
            t = tot[k]
            row[k] = {"per_s": round(rate[k]), "ratio": round(rate[k] / rate["bare"], 3),
                      "client_us": round(1e6 * t["client"] / t["calls"], 1),
                      "server_us": round(1e6 * t["server"] / t["calls"], 1),
                      "server_other_us": round(1e6 * t["server_other"] / t["calls"], 1)}
        # UndoLog over the lower bound of its own mode: how much of the gap its own bookkeeping is.
        # What the ratio tends to where the machine is CPU bound (2 cores, from 2 workers on): the bare insert's CPU
        # (client + server) over the call's. Less swayed than the rates by what else the machine runs meanwhile.
        bare_cpu = row["bare"]["client_us"] + row["bare"]["server_us"]
        for k in variants:
            row[k]["cpu_ratio"] = round(bare_cpu / (row[k]["client_us"] + row[k]["server_us"]), 3)
        for mode in ("durable", "fast"):
            if mode in rate and f"lb_{mode}" in rate:
                row[mode]["over_lower_bound"] = round(rate[f"lb_{mode}"] / rate[mode], 3)
        rows.append(row)
    return rows


def print_throughput(rows: list[dict[str, Any]]) -> None:
    labels = {"bare": "bare 2-row inserts", "durable": "UndoLog, durable marks", "fast": "UndoLog, fast mode",
              "lb_durable": "lower bound, durable", "lb_fast": "lower bound, fast"}
    for r in rows:
        print(f"throughput  {r['workers']} workers (goal: UndoLog >= {GOAL:.2f} of bare; CPU: the bare insert's CPU "
              "over the call's, what the ratio tends to when CPU bound)")
        for k in VARIANTS:
            if k not in r:
                continue
            v = r[k]
            cpu = (f"CPU/call client {v['client_us']:>6.1f} us, server {v['server_us']:>6.1f} us "
                   f"(other postgres {v['server_other_us']:>6.1f})")
            note = ""
            if k in ("durable", "fast"):
                note = f"  {'meets' if v['ratio'] >= GOAL else 'misses'} the goal"
                if "over_lower_bound" in v:
                    note += f"; {v['over_lower_bound']:.2f}x its lower bound's time"
            elif k.startswith("lb_"):
                note = f"  goal {'reachable' if v['ratio'] >= GOAL else 'OUT OF REACH'} on this machine"
            ratio = "" if k == "bare" else f"ratio {v['ratio']:.2f} (CPU {v['cpu_ratio']:.2f})"
            print(f"  {labels[k]:<24} {v['per_s']:>6}/s {ratio:<22} {cpu}{note}")


# -- 2. expiry of due approval requests from N processes --------------------------------------------------------


def raise_requests(u: UndoLog, n: int, threads: int = 4, prefix: str = "") -> list[str]:
    def one(i: int) -> str:
        s = u.session(agent_id=f"bench-{prefix}{i}")
        try:
            s.call_sync("scale_close", account=f"a{i}", call_id="c")
        except ApprovalPending as p:
            return p.approval_request_id
        raise AssertionError("not gated")

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(n)))


#: Due requests of its own each expire worker sweeps while it warms up (two: a batch of more than one event takes
#: the batched chain-head path, one event the single-event path).
WARM_REQUESTS = 2


def warm_sweeper(u: UndoLog, own: list[str], now: dt.datetime | None = None) -> list[str]:
    """Bring a freshly started sweeper to where a running server's sweeper is: every statement of a sweep compiled
    (SQLAlchemy, psycopg) and its tables in the database backend's caches. ``own``: due requests reserved for this
    worker, timed out here (returned); empty: only the claim is warmed (a process's first sweep, ``--expire-cold``).
    ``now``: the sweep's clock (tests); the time now by default.

    A server's sweeper pays that once in its life; one sweep per freshly started process pays it inside the timed
    window, once per worker (15-35 ms of CPU each, counted on the 2-core machine), which is what made 8 workers
    slower than 4 on 2 cores while the CPU per timeout of warm sweepers is the same at 2, 4 and 8 workers.
    """
    early = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)  # nothing is due then
    u.approvals.expire_due(early)  # what a sweep with nothing due runs (on PostgreSQL: is anything due?)
    if not own:
        return []
    got = u.approvals.expire(own, now=now)  # a batch: its updates, outbox rows and audit events
    assert sorted(got) == sorted(own), (got, own)
    # The sweep's own claim (``expire`` above claims by id, a statement of its own), run with nothing to claim.
    with u.store.tx() as conn:
        conn.execute(u.store.for_update(u.store.approvals.due_claim(early), skip_locked=True)).all()
    return got


def _postgres_aux_pids() -> list[int]:
    """The PostgreSQL server's own processes (WAL writer, checkpointer, background writer, autovacuum), not its
    client backends: the machine's other users' backends are no part of a sweep."""
    aux = []
    for pid in _postgres_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        if "(" not in title and "[local]" not in title:  # a client backend's title names its client's address
            aux.append(pid)
    return aux


#: The database work done in a schema's tables and indexes, from the cumulative statistics (every expire run):
#: blocks read (found in shared buffers or not), index entries read, index scans, rows inserted and updated. Counts,
#: not times: the same on a busy machine as on a quiet one.
_SCHEMA_WORK = """
SELECT coalesce(sum(coalesce(io.heap_blks_hit, 0) + coalesce(io.heap_blks_read, 0) + coalesce(io.idx_blks_hit, 0)
                    + coalesce(io.idx_blks_read, 0) + coalesce(io.toast_blks_hit, 0) + coalesce(io.toast_blks_read, 0)
                    + coalesce(io.tidx_blks_hit, 0) + coalesce(io.tidx_blks_read, 0)), 0),
       coalesce(sum(st.idx_tup_fetch), 0), coalesce(sum(st.idx_scan), 0), coalesce(sum(st.seq_scan), 0),
       coalesce(sum(st.n_tup_ins), 0), coalesce(sum(st.n_tup_upd), 0),
       (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE schemaname = %(s)s)
FROM pg_statio_user_tables io JOIN pg_stat_user_tables st USING (relid) WHERE io.schemaname = %(s)s"""
def _machine() -> tuple[float, float]:
    """(busy, steal): seconds of CPU the whole machine spent busy (user, nice, system, irq, softirq) and lost to its
    hypervisor (``steal``: time the virtual CPUs were ready but not run), from /proc/stat, all CPUs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq) / tick, steal / tick


#: Autovacuum and autoanalyze runs in the whole database so far (every table, the catalogs included).
_AUTOVACUUMS = "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_all_tables"


def _autovacuums() -> int:
    import psycopg

    with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as con:
        row = con.execute(_AUTOVACUUMS).fetchone()
    assert row is not None
    return int(row[0])


WORK_KEYS = ("blocks", "heap_fetched_by_index", "index_scans", "seq_scans", "inserted", "updated", "index_read")


def _schema_work(schema: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as con:
        row = con.execute(_SCHEMA_WORK, {"s": schema}).fetchone()
    assert row is not None
    return {k: int(v) for k, v in zip(WORK_KEYS, row, strict=True)}


def _flush_stats(u: UndoLog) -> None:
    """Make every pooled connection's backend report its pending statistics now (PostgreSQL 15+: a backend
    reports them at most once a second, or when it exits): each runs ``pg_stat_force_next_flush()``, and the
    backend reports before it answers that statement. Every idle pooled connection is checked out at once, so
    each backend gets it."""
    engine = u.store.engine
    conns = [engine.connect() for _ in range(max(1, engine.pool.checkedin()))]  # type: ignore[attr-defined]
    try:
        for c in conns:
            c.exec_driver_sql("SELECT pg_stat_force_next_flush()")
            c.commit()
    finally:
        for c in conns:
            c.close()


def expire_worker(i: int, prepared: Any, url: str, schema: str | None, warm: list[list[str]] | None = None,
                  count: bool = False) -> Any:
    """One sweeper process: prepared (opened, warmed, its backends' CPU noted), then one sweep. Returns the ids it
    timed out, its own CPU and its backends' over the sweep (``client_s``, ``server_s``: /proc/<pid>/schedstat) and
    when it started and ended (``time.monotonic``, the same clock in every process: the start lag after the
    release); with ``count``, its backends report their statistics before the release and after the sweep
    (``_flush_stats``), so the parent can count the sweep's database work (``_schema_work``)."""
    if prepared is None:
        app = _app_name("expire", i)
        u = open_undolog(_with_app(url, app), schema)
        warm_sweeper(u, warm[i] if warm else [])
        if count:  # the warm-up's work counted before the release (``expire_once`` reads the baseline then)
            _flush_stats(u)
        backends = _backends(app)
        return u, backends, {pid: _proc_cpu(pid) for pid in backends}
    u, backends, server0 = prepared
    began, client0 = time.monotonic(), time.process_time()
    # One sweep per process, as each server's sweeper does it: it claims batches until none is left to claim
    # (rows another worker holds are that worker's to finish).
    got = u.approvals.expire_due()  # the process exits without closing: closing is not part of the sweep
    client, ended = time.process_time() - client0, time.monotonic()
    server = sum(_proc_cpu(pid) - cpu for pid, cpu in server0.items())
    if count:  # after the timed window: the sweep's work reported before the parent reads it
        _flush_stats(u)
    return {"expired": got, "client_s": client, "server_s": server, "began": began, "ended": ended}


def check_expired_once(u: UndoLog, ids: list[str], expired: list[str]) -> None:
    import sqlalchemy as sa

    from undolog_core.storage import schema as t

    assert sorted(expired) == sorted(ids), (len(expired), len(ids), len(set(expired)))
    with u.store.read() as conn:
        events = conn.execute(
            sa.select(t.approval_events.c.approval_request_id, sa.func.count())
            .where(t.approval_events.c.action == "timeout").group_by(t.approval_events.c.approval_request_id)
        ).all()
        outbox = conn.execute(
            sa.select(sa.func.count()).select_from(t.outbox).where(t.outbox.c.event_type == "approval.timed_out")
        ).scalar_one()
        states = conn.execute(
            sa.select(t.approval_requests.c.state, sa.func.count()).group_by(t.approval_requests.c.state)
        ).all()
    assert len(events) == len(ids) and all(c == 1 for _, c in events), "a request was timed out twice or never"
    assert outbox == len(ids), (outbox, len(ids))
    assert dict(states) == {"timed_out": len(ids)}, states
    assert u.verify_audit().ok, "the audit chain does not verify"


def _raise_share(schema: str, n: int) -> list[str]:
    """Child process of ``seed_expire_template``: ``n`` due requests raised through UndoLog."""
    u = open_undolog(PG_URL, schema)
    try:
        return raise_requests(u, n, prefix=f"p{os.getpid()}-")
    finally:
        u.close()


def seed_expire_template(n: int, max_workers: int, procs: int = 2) -> tuple[str, list[str]]:
    """The due requests every expire run starts from, raised once through UndoLog (a gated call each, in a session
    of its own) in a schema of their own: ``n`` to sweep, then ``WARM_REQUESTS`` per worker of the largest count.
    Returns (the schema, the request ids in that order). Raising them costs 2-5 ms of CPU each: once per benchmark
    in ``procs`` processes, not once per run (12 runs of 6,000 took over ten minutes on the loaded 2-core
    machine)."""
    schema = fresh_schema()
    u = open_undolog(PG_URL, schema)
    u.policy.set(actor="bench", approval_timeout_seconds=1)
    u.close()
    total = n + WARM_REQUESTS * max_workers
    shares = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    with mp.get_context("fork").Pool(procs) as pool:
        ids = [x for part in pool.starmap(_raise_share, [(schema, k) for k in shares]) for x in part]
    time.sleep(1.05)  # every one due
    return schema, ids


def clone_schema(src: str) -> tuple[str, UndoLog]:
    """A fresh schema holding a copy of ``src``'s rows (an UndoLog schema): tables, indexes, triggers and sequences
    made by UndoLog's own migrations (the UndoLog opened to make them is returned, open), the rows copied with triggers off (``session_replication_role = replica``:
    the audit tables refuse changes, and the copy of a chain is the chain), the sequences set as in ``src``, then
    vacuumed and analyzed, with autovacuum off for its tables, and checkpointed.

    Every run of a comparison starts from the same rows laid out the same way, with the same statistics: the
    runs paired differ by the worker count, not by their seeding, nor by whether autovacuum's minute fell inside
    one of them (it analyzed a freshly seeded table during some runs only)."""
    import psycopg

    dst = fresh_schema()
    u = open_undolog(PG_URL, dst)
    with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1)) as con:
        con.execute("SET LOCAL session_replication_role = replica")
        tables = [r[0] for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s AND table_type = 'BASE TABLE'",
            (src,))]
        con.execute("TRUNCATE " + ", ".join(f'"{dst}"."{name}"' for name in tables))
        for name in tables:
            cols = ", ".join(f'"{r[0]}"' for r in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
                "ORDER BY ordinal_position", (src, name)))
            con.execute(f'INSERT INTO "{dst}"."{name}" ({cols}) OVERRIDING SYSTEM VALUE '
                        f'SELECT {cols} FROM "{src}"."{name}"')
        for seq, last, called in con.execute(
                "SELECT s.relname, q.last_value, q.last_value IS NOT NULL FROM pg_sequences q "
                "JOIN pg_class s ON s.relname = q.sequencename JOIN pg_namespace ns ON ns.oid = s.relnamespace "
                "AND ns.nspname = q.schemaname WHERE q.schemaname = %s", (src,)).fetchall():
            if called:
                con.execute("SELECT setval(format('%%I.%%I', %s::text, %s::text)::regclass, %s)", (dst, seq, last))
        con.commit()
        con.autocommit = True
        for name in tables:
            con.execute(f'ALTER TABLE "{dst}"."{name}" SET (autovacuum_enabled = false)')
            # VACUUM as well as ANALYZE: the copied rows' hint bits and the visibility map are set here, not by
            # whichever run first reads them (a reader setting hint bits dirties every page it reads).
            con.execute(f'VACUUM (ANALYZE) "{dst}"."{name}"')
        # The catalogs too: every run creates a schema of some twenty tables and drops the one before, and
        # autovacuum woke on pg_class, pg_attribute and friends inside some runs only (CPU on the sweepers' cores
        # that no worker's accounting shows).
        con.execute("VACUUM (ANALYZE) pg_catalog.pg_class, pg_catalog.pg_attribute, pg_catalog.pg_type, "
                    "pg_catalog.pg_depend, pg_catalog.pg_constraint, pg_catalog.pg_index, pg_catalog.pg_attrdef, "
                    "pg_catalog.pg_trigger, pg_catalog.pg_namespace, pg_catalog.pg_sequence, pg_catalog.pg_statistic, "
                    "pg_catalog.pg_shdepend, pg_catalog.pg_description, pg_catalog.pg_init_privs")
        # Every run starts right after a checkpoint: the first change of a page after a checkpoint logs the whole
        # page (full_page_writes), so a run that a checkpoint preceded by chance wrote several times the WAL of
        # one that ran late in a checkpoint cycle (the same count ran at 4,605 and 8,240 timeouts/s).
        con.execute("CHECKPOINT")
    return dst, u


class WaitSampler:
    """What the sweepers' backends are doing, sampled from ``pg_stat_activity`` every ``period`` seconds from
    the release until stopped (``--expire-probe``; diagnostic: the sampling itself takes CPU in the timed window,
    so rates measured with it are not reported as figures). Counts per ``wait_event_type:wait_event`` of the
    active backends (``CPU`` when not waiting), and how often a sample saw more than ``SWEEP_SLOTS`` of them in a
    sweep statement at once."""

    def __init__(self, released: list[float], period: float = 0.002) -> None:
        import threading

        self.released, self.period = released, period
        self.counts: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as con:
            while not self.released and not self.stop.is_set():
                time.sleep(0.001)
            while not self.stop.is_set():
                rows = con.execute(
                    "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity "
                    "WHERE application_name LIKE 'scale-expire-%' AND state = 'active'").fetchall()
                for (what,) in rows:
                    self.counts[what] = self.counts.get(what, 0) + 1
                self.counts["samples"] = self.counts.get("samples", 0) + 1
                time.sleep(self.period)

    def done(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join(5)
        return self.counts


def expire_once(template: tuple[str, list[str]], n: int, w: int, *, cold: bool = False,
                probe: bool = False) -> tuple[float, dict[str, Any]]:
    """The ``n`` due requests of ``template`` (``seed_expire_template``), in a copy of their own
    (``clone_schema``), swept by ``w`` worker processes released at once; returns the seconds it took (checked:
    each request timed out exactly once) and where the CPU went: the workers that swept (``sweeping``: client and
    backend CPU) and those that found every sweep slot held and stopped (``stopped``), the server's other
    processes (``other``: WAL writer, checkpointer), and the release (``lag``: seconds from the release to the
    last worker's start). The warm-up requests of the workers a run does not start are timed out before the
    release, so every run starts with the same rows in the same states."""
    src, ids = template
    schema, u = clone_schema(src)
    k = 0 if cold else WARM_REQUESTS
    warm = [ids[n + k * i:n + k * (i + 1)] for i in range(w)]
    spare = ids[n + k * w:]
    if spare:
        assert sorted(u.approvals.expire(spare)) == sorted(spare)
    released: list[float] = []
    sampler = WaitSampler(released) if probe else None
    aux0 = {pid: _proc_cpu(pid) for pid in _postgres_aux_pids()}
    work0: dict[str, int] = {}
    # The database work is counted in every run: the backends report their statistics outside the timed window
    # (after the warm-up, and after the sweep once its times are taken).
    machine0: list[float] = []
    vacuums0 = _autovacuums()

    def ready() -> None:
        work0.update(_schema_work(schema))
        machine0.extend(_machine())  # the last thing before the release

    wall, res = run_workers(w, expire_worker, (PG_URL, schema, warm, True), released, ready=ready)
    busy1, steal1 = _machine()
    # A process that ended meanwhile (an autovacuum worker) reads 0, or its pid's next owner less: not counted.
    other = sum(max(0.0, _proc_cpu(pid) - cpu) for pid, cpu in aux0.items())
    work = {k: v - work0[k] for k, v in _schema_work(schema).items()}
    sampled = sampler.done() if sampler else {}
    t0 = released[0]
    expired = [x for r in res for x in r["expired"]]
    check_expired_once(u, ids, expired + [x for mine in warm for x in mine] + spare)
    u.close()
    drop_schema(schema)
    vacuums = _autovacuums() - vacuums0  # read late: an autovacuum worker reports its runs when it ends
    swept = [r for r in res if r["expired"]]
    stopped = [r for r in res if not r["expired"]]
    cpu = {"sweeping_client": sum(r["client_s"] for r in swept), "sweeping_server": sum(r["server_s"] for r in swept),
           "stopped_client": sum(r["client_s"] for r in stopped), "stopped_server": sum(r["server_s"] for r in stopped),
           "other": other, "lag": max(r["began"] for r in res) - t0, "sweepers": len(swept), "waits": sampled,
           "work": work}
    # What else the machine did in the timed window (about: /proc/stat counts in clock ticks, and its window runs
    # from just before the release to just after the results are in): busy CPU no worker, backend or server
    # process accounts for (the parent, autovacuum workers, anything else running), and the hypervisor's steal.
    ours = sum(cpu[k] for k in ("sweeping_client", "sweeping_server", "stopped_client", "stopped_server", "other"))
    cpu["foreign"] = max(0.0, busy1 - machine0[0] - ours)
    cpu["steal"] = steal1 - machine0[1]
    cpu["autovacuums"] = vacuums
    return wall, cpu


def quartiles(xs: list[float]) -> tuple[float, float]:
    """(p25, p75); with fewer than four values, (min, max)."""
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def median_interval(xs: list[float], level: float = 0.9, resamples: int = 4000) -> tuple[float, float]:
    """A ``level`` bootstrap interval of the median of ``xs`` (percentile method, a fixed seed: the same data give
    the same interval). Where the quartiles say how far one round's ratio strays, this says how far the median of
    the rounds may be from the ratio the runs estimate: "not slower by more than 1 - low", at that level.

    Example:
        >>> lo, hi = median_interval([0.97, 1.02, 0.99, 1.05, 1.01, 0.98, 1.00])
        >>> lo <= 1.0 <= hi
        True
    """
    rng = random.Random(4242)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    cut = (1.0 - level) / 2
    return meds[int(cut * resamples)], meds[min(resamples - 1, int((1.0 - cut) * resamples))]


#: The widest spread of the measurement's own pair (the same worker count run twice per round) under which "not
#: slower beyond the measurement's own spread" is said at all: past it the run cannot tell, and says so.
EXPIRE_TOLERANCE = 0.10


def expire_verdict(ratio: float, own_lo: float, *, what: str = "slower") -> str:
    """"More workers never slower" for one pair, from its median paired rate ratio (more workers over fewer) and
    the measurement's own pair's spread (``own_lo``: how far from 1.0 a count compared with itself falls in a
    quarter of the rounds, either way: min(p25, 1 / p75)). ``what``: the word for worse (CPU and database work per
    timeout are given as fewer over more, "more").

    Example:
        >>> expire_verdict(0.97, own_lo=0.95)
        "not slower beyond the measurement's own spread"
    """
    # The spread first: a median above 1.0 says nothing either when the count against itself strays further.
    if 1.0 - own_lo > EXPIRE_TOLERANCE:
        return f"cannot tell: the measurement's own spread ({own_lo:.3f}x) is wider than {EXPIRE_TOLERANCE:.0%}"
    if ratio >= 1.0:
        return f"not {what}"
    if ratio >= own_lo:
        return f"not {what} beyond the measurement's own spread"
    return what.upper()


def bench_expire(workers: list[int], n: int, *, rounds: int = 1, cold: bool = False, probe: bool = False,
                 rng: random.Random | None = None) -> dict[str, Any]:
    """``n`` due requests (one template, copied per run: ``expire_once``) swept by each worker count once per
    round, and the base count (2, or the second count) a second time: the measurement's own pair. The runs of a
    round go in a shuffled order. Per count: the median rate and its range, CPU per timeout; per pair (each count
    against the next smaller one, and the base against itself), the median of the per-round ratios with their
    p25-p75, in rate and in CPU per timeout (all the workers' client and backend CPU), and the verdict
    (``expire_verdict``). Warm sweepers (``warm_sweeper``) unless ``cold``."""
    rng = rng or random.Random(13)
    base = 2 if 2 in workers else workers[min(1, len(workers) - 1)]
    again = f"{base} again"
    labels: list[Any] = [*workers, again]
    template = seed_expire_template(n, max(workers))
    walls: dict[Any, list[float]] = {x: [] for x in labels}
    cpus: dict[Any, list[dict[str, Any]]] = {x: [] for x in labels}
    try:
        for _ in range(rounds):
            for x in rng.sample(labels, len(labels)):
                wall, cpu = expire_once(template, n, base if x == again else x, cold=cold, probe=probe)
                walls[x].append(wall)
                cpus[x].append(cpu)
    finally:
        drop_schema(template[0])

    def total(c: dict[str, Any]) -> float:
        return float(c["sweeping_client"] + c["sweeping_server"] + c["stopped_client"] + c["stopped_server"])

    rows = []
    for x in labels:
        w = base if x == again else x
        rates = [n / s for s in walls[x]]
        row: dict[str, Any] = {"workers": w, "label": str(x), "requests": n, "rounds": rounds,
                               "expired_per_s": round(statistics.median(rates)), "min_per_s": round(min(rates)),
                               "max_per_s": round(max(rates)), "sweepers": "cold" if cold else "warm"}
        # CPU per timeout (µs, medians over the rounds): the workers that swept, client + their backends, and what
        # the workers that stopped at once cost in all.
        row["cpu_us"] = {k: round(statistics.median(c[k] for c in cpus[x]) * 1e6 / n, 1)
                         for k in ("sweeping_client", "sweeping_server", "stopped_client", "stopped_server", "other")}
        row["cpu_us"]["all_workers"] = round(statistics.median(total(c) for c in cpus[x]) * 1e6 / n, 1)
        row["lag_ms"] = round(statistics.median(c["lag"] for c in cpus[x]) * 1e3, 1)
        # The machine's other load and steal, as a share of the wall time of each run (cores), median and max.
        for k in ("foreign", "steal"):
            shares = [c[k] / s for c, s in zip(cpus[x], walls[x], strict=True)]
            row[f"{k}_cores"] = [round(statistics.median(shares), 3), round(max(shares), 3)]
        row["runs_with_autovacuum"] = sum(1 for c in cpus[x] if c["autovacuums"])
        row["swept_by"] = sorted({int(c["sweepers"]) for c in cpus[x]})
        row["work_per_timeout"] = {k: round(statistics.median(c["work"][k] for c in cpus[x]) / n, 2)
                                   for k in WORK_KEYS}
        if probe:
            merged: dict[str, int] = {}
            for c in cpus[x]:
                for k, v in c["waits"].items():
                    merged[k] = merged.get(k, 0) + v
            row["waits"] = merged
        rows.append(row)
    pairs = [(workers[i], workers[i - 1]) for i in range(1, len(workers))]
    pairs.insert(0, (again, base))
    own_lo = own_cpu_lo = own_work_lo = 1.0
    out_pairs = []
    for more, fewer in pairs:
        rate = [b / a for a, b in zip(walls[more], walls[fewer], strict=True)]  # rate(more) / rate(fewer)
        cpu = [total(a) / total(b) for a, b in zip(cpus[more], cpus[fewer], strict=True)]  # CPU per timeout
        # The database work (blocks read) per timeout: a count, which the machine's other load does not move.
        work = [a["work"]["blocks"] / b["work"]["blocks"] for a, b in zip(cpus[more], cpus[fewer], strict=True)]
        lo, hi = quartiles(rate)
        clo, chi = quartiles(cpu)
        wlo, whi = quartiles(work)
        pair: dict[str, Any] = {"more": str(more), "fewer": str(fewer), "rate_ratio": round(statistics.median(rate), 3),
                                "rate_p25": round(lo, 3), "rate_p75": round(hi, 3),
                                "cpu_ratio": round(statistics.median(cpu), 3), "cpu_p25": round(clo, 3),
                                "cpu_p75": round(chi, 3), "work_ratio": round(statistics.median(work), 3),
                                "work_p25": round(wlo, 3), "work_p75": round(whi, 3)}
        ilo, ihi = median_interval(rate)
        pair["rate_ci90"] = [round(ilo, 3), round(ihi, 3)]
        if more == again:
            # Which of the two runs of the base count is "more" is arbitrary: the spread is taken both ways.
            own_lo, own_cpu_lo, own_work_lo = min(lo, 1.0 / hi), min(1.0 / chi, clo), min(1.0 / whi, wlo)
            pair["verdict"] = pair["cpu_verdict"] = pair["work_verdict"] = "the measurement's own spread"
        else:
            pair["verdict"] = expire_verdict(pair["rate_ratio"], own_lo)
            # The same question in CPU per timeout (fewer over more: >= 1 is no more CPU), steadier than the rate
            # while other programs share the cores: on 2 cores two sweepers are CPU bound.
            pair["cpu_verdict"] = expire_verdict(1.0 / pair["cpu_ratio"], own_cpu_lo, what="more")
            pair["work_verdict"] = expire_verdict(1.0 / pair["work_ratio"], own_work_lo, what="more")
        out_pairs.append(pair)
    return {"rows": rows, "pairs": out_pairs, "base": base}


def print_expire(res: dict[str, Any]) -> None:
    for r in res["rows"]:
        c = r["cpu_us"]
        print(f"expire      {r['label']:>7} workers: {r['expired_per_s']:>6} timeouts/s (median of {r['rounds']}, "
              f"{r['min_per_s']}-{r['max_per_s']}; {r['requests']} due, each exactly once; {r['sweepers']} sweepers)"
              f"{'  goal >= 3,000/s: ' + ('met' if r['expired_per_s'] >= 3000 else 'MISSED') if r['label'] == '4' else ''}")
        print(f"            CPU per timeout: all workers {c['all_workers']} us = sweeping {c['sweeping_client']} + "
              f"{c['sweeping_server']} us (client + backend; swept by {r['swept_by']} workers), stopped at once "
              f"{c['stopped_client']} + {c['stopped_server']} us; server's own processes {c['other']} us; last "
              f"worker started {r['lag_ms']} ms after the release")
        if "foreign_cores" in r:
            print(f"            machine in the timed window (cores, median / max): other busy CPU "
                  f"{r['foreign_cores'][0]} / {r['foreign_cores'][1]}, steal {r['steal_cores'][0]} / "
                  f"{r['steal_cores'][1]}; runs with an autovacuum: {r['runs_with_autovacuum']} of {r['rounds']}")
        if "work_per_timeout" in r:
            wk = r["work_per_timeout"]
            print("            database work per timeout (all workers): " + ", ".join(f"{k} {v}" for k, v in wk.items()))
        if "waits" in r:
            w = dict(r["waits"])
            samples = w.pop("samples", 0)
            top = ", ".join(f"{k} {v}" for k, v in sorted(w.items(), key=lambda kv: -kv[1])[:6])
            print(f"            backends seen active in {samples} samples: {top}")
    print("expire      more workers never slower (paired per round: median [p25-p75]; rate more/fewer, >= 1 is "
          "not slower; CPU and database work (blocks) per timeout more/fewer, all workers, <= 1 is no more)")
    for p in res["pairs"]:
        print(f"            {p['more']:>7} vs {p['fewer']}: rate {p['rate_ratio']:.3f}x [{p['rate_p25']:.3f}-"
              f"{p['rate_p75']:.3f}], CPU {p['cpu_ratio']:.3f}x [{p['cpu_p25']:.3f}-{p['cpu_p75']:.3f}], "
              f"database work {p['work_ratio']:.3f}x [{p['work_p25']:.3f}-{p['work_p75']:.3f}]; the rate ratio's "
              f"median, 90% bootstrap interval {p['rate_ci90'][0]:.3f}-{p['rate_ci90'][1]:.3f}")
        if p["more"] != f"{res['base']} again":
            print(f"                rate: {p['verdict']}; CPU per timeout: {p['cpu_verdict']}; database work per "
                  f"timeout: {p['work_verdict']}")


# -- 3. recovery of in-flight effects of a SIGKILLed process ----------------------------------------------------


def seed_in_flight(url: str, schema: str | None, n: int, per_session: int = 4) -> None:
    """Child process: pre-write ``n`` COMPENSABLE calls (never marked), then die by SIGKILL."""
    u = open_undolog(url, schema)
    sid = None
    for i in range(n):
        if i % per_session == 0:
            sid = u.session(agent_id=f"crashed-{i}").id
        assert sid is not None
        d = u.driver.decide(sid, "scale_refund", {"user_id": f"u{i}", "amount": i}, call_id=f"c{i}")
        assert isinstance(d, Execute), d
    os.kill(os.getpid(), signal.SIGKILL)


def bench_recover(url: str, n: int) -> dict[str, Any]:
    schema = fresh_schema() if url.startswith("postgres") else None
    u = open_undolog(url, schema)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    code = subprocess.run(
        [sys.executable, "-c", f"import scale; scale.seed_in_flight({url!r}, {schema!r}, {n})"], env=env,
        cwd=str(HERE),
    ).returncode
    assert code == -signal.SIGKILL, code
    _CANCELLED.clear()
    t0 = time.perf_counter()
    report = u.recover()
    wall = time.perf_counter() - t0
    assert len(report.reconciled) == n, (len(report.reconciled), report.errors[:3])
    assert len(_CANCELLED) == n == len(set(_CANCELLED)), len(_CANCELLED)
    u.close()
    if schema:
        drop_schema(schema)
    return {"database": url.split(":", 1)[0].split("+")[0], "effects": n, "seconds": round(wall, 3),
            "per_s": round(n / wall)}


# -- 4. approvals decided through the REST API with 4 server processes -----------------------------------------


def start_servers(url: str, schema: str | None, k: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    import httpx

    procs, bases = [], []
    env = {**os.environ, "UNDOLOG_DATABASE_URL": url, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    if schema:
        env["UNDOLOG_SCHEMA"] = schema
    for _ in range(k):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "undolog_server", "serve", "--port", str(port), "--log-level", "warning",
             "--app", "scale:register", "--sweep-interval", "3600", "--recover-interval", "3600"], env=env))
        bases.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 90
    for base in bases:
        while True:
            try:
                if httpx.get(base + "/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit("the servers did not start")
            time.sleep(0.1)
    return procs, bases


def bench_api(n: int, servers: int = 4, clients: int = 8) -> dict[str, Any]:
    import httpx

    from undolog_server.storage import ServerStore

    schema = fresh_schema()
    u = open_undolog(PG_URL, schema)
    ServerStore(u.store).migrate()
    _, token = ServerStore(u.store).create_key("bench-approver", ["approver"])
    ids = raise_requests(u, n)
    procs, bases = start_servers(PG_URL, schema, servers)
    try:
        pool_clients = [httpx.Client(base_url=bases[i % servers], headers={"Authorization": f"Bearer {token}"})
                        for i in range(clients)]
        for c in pool_clients:  # connections open and each server warm before the clock starts
            c.get("/v1/approvals", params={"limit": 1})

        def decide(i_rid: tuple[int, str]) -> int:
            i, rid = i_rid
            return pool_clients[i % clients].post(f"/v1/approvals/{rid}:approve", json={}).status_code

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            codes = list(pool.map(decide, enumerate(ids)))
        wall = time.perf_counter() - t0
        assert codes == [200] * n, set(codes)
        for c in pool_clients:
            c.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    u.close()
    drop_schema(schema)
    return {"servers": servers, "clients": clients, "decisions": n, "decided_per_s": round(n / wall)}


# -- main -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds: small sizes, 1 and 4 workers")
    ap.add_argument("--only", default="throughput,expire,recover,api",
                    help="comma-separated: throughput, expire, recover, api")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--sessions", type=int, default=1,
                    help="throughput: concurrent sessions (threads) per worker process, the same on the bare side")
    ap.add_argument("--seconds", type=float, default=5.0, help="throughput: seconds per run")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="throughput: comma-separated, of " + ", ".join(VARIANTS) + " (bare is needed)")
    ap.add_argument("--rounds", type=int, default=2, help="throughput: interleaved rounds")
    ap.add_argument("--expire-n", type=int, default=6000, help="expire: due requests per run")
    ap.add_argument("--expire-rounds", type=int, default=7,
                    help="expire: rounds, every worker count once per round in a shuffled order (medians)")
    ap.add_argument("--expire-cold", action="store_true",
                    help="expire: also time each worker process's first sweep (statements compiled, the backend's "
                         "caches filled inside the timed window), after the warm sweepers")
    ap.add_argument("--expire-probe", action="store_true",
                    help="expire: sample the sweepers' backends in pg_stat_activity (wait events); diagnostic: the "
                         "sampling takes CPU in the timed window")
    ap.add_argument("--recover-n", default="1000,10000", help="recover: in-flight effects per run")
    ap.add_argument("--api-n", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    workers = [int(x) for x in args.workers.split(",")]
    recover_ns = [int(x) for x in args.recover_n.split(",")]
    rounds = args.rounds
    if args.quick:  # a smoke run: every path once, small
        workers, args.seconds, args.expire_n, recover_ns, args.api_n, rounds = [2], 0.3, 300, [100], 40, 1
        args.expire_rounds = 1
    out: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="undolog-scale-")
    if "throughput" in only:
        out["throughput"] = bench_throughput(workers, args.seconds, rounds, args.sessions,
                                             tuple(args.variants.split(",")))
    if "expire" in only:
        sweepers = [1, 2] if args.quick else workers  # the quick run still pairs two counts
        out["expire"] = [bench_expire(sweepers, args.expire_n, rounds=args.expire_rounds, probe=args.expire_probe)]
        if args.expire_cold:
            out["expire"].append(bench_expire(sweepers, args.expire_n, rounds=args.expire_rounds, cold=True))
    if "recover" in only:
        out["recover"] = [bench_recover(db, k) for k in recover_ns
                          for db in (PG_URL, f"sqlite:///{tmp}/recover-{k}.db")]
    if "api" in only:
        out["api"] = bench_api(args.api_n, servers=2 if args.quick else 4)
    if args.json:
        print(json.dumps(out))
        return 0
    print_throughput(out.get("throughput", []))
    if "expire" in out:
        for res in out["expire"]:
            print_expire(res)
    for r in out.get("recover", []):
        print(f"recover     {r['database']:<10} {r['effects']:>6} in-flight effects in {r['seconds']:>7} s "
              f"({r['per_s']}/s)")
    if "api" in out:
        r = out["api"]
        print(f"api         {r['servers']} servers, {r['clients']} clients: {r['decided_per_s']} approvals "
              "decided/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
