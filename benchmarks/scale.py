"""Benchmark: many worker processes on one PostgreSQL.

Four measurements, each printed with what it is compared against:

1. ``throughput``: N worker processes (1, 2, 4, 8) each running sessions of COMPENSABLE calls, against the same
   number of processes doing bare durable two-row inserts (psycopg, default ``synchronous_commit``) on the same
   database. Goal: UndoLog >= 80% of the bare throughput at every N.
2. ``expire``: approval requests past their timeout expired by ``approvals.expire_due()`` from N processes at
   once. Goal: >= 3,000/s with 4 workers, more workers never slower, each request timed out exactly once
   (checked: one ``timeout`` audit event and one ``approval.timed_out`` outbox row per request). Each worker
   first sweeps two requests of its own, as a running server's sweeper has (``warm_sweeper``); ``--expire-cold``
   also times each process's very first sweep.
3. ``recover``: ``recover()`` of 1,000 (and 10,000) in-flight COMPENSABLE effects left by a SIGKILLed process,
   trivial compensations, on PostgreSQL and SQLite. Goal: 1,000 in < 2 s, 10,000 in < 20 s; each compensation
   run exactly once.
4. ``api``: approvals decided per second through the REST API with 4 ``undolog serve`` processes.

    python benchmarks/scale.py                      # everything (several minutes)
    python benchmarks/scale.py --quick              # a few seconds: the CI smoke run
    python benchmarks/scale.py --only expire,recover --workers 1,2,4,8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
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
from undolog_core._driver import Execute  # noqa: E402

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


def run_workers(n: int, target: Callable[..., Any], args: tuple[Any, ...]) -> tuple[float, list[Any]]:
    """Start ``n`` processes, release them at once, return (wall seconds from the release, their results)."""
    ctx = mp.get_context("fork")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(target, i, start, out, args)) for i in range(n)]
    for p in procs:
        p.start()
    ready = [out.get(timeout=120) for _ in procs]
    assert all(r == "ready" for r in ready), ready
    t0 = time.perf_counter()
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    errors = [r for r in results if isinstance(r, str) and r.startswith("error")]
    if errors:
        raise SystemExit("\n".join(errors))
    return wall, results


def _worker_main(target: Callable[..., Any], i: int, start: Any, out: Any, args: tuple[Any, ...]) -> None:
    try:
        prepared = target(i, None, *args)  # prepare (connect, warm up)
        out.put("ready")
        start.wait()
        out.put(target(i, prepared, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put(f"error in worker {i}: {exc!r}\n{traceback.format_exc()}")


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
        return [psycopg.connect(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1),
                                options=f"-csearch_path={schema}") for _ in range(sessions)]
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
        con.close()
        return n

    return _in_threads(loop, prepared)


def _in_threads(fn: Callable[[Any], int], items: list[Any]) -> int:
    if len(items) == 1:
        return fn(items[0])
    with ThreadPoolExecutor(len(items)) as pool:
        return sum(pool.map(fn, items))


def undolog_worker(i: int, prepared: Any, schema: str, seconds: float, sessions: int = 1,
                   fast: bool = False) -> Any:
    """``sessions`` threads sharing one ``UndoLog`` (one process serving that many agent sessions at once), each
    running sessions of ten COMPENSABLE calls one after another."""
    if prepared is None:
        u = UndoLog.open(PG_URL, schema=schema, fast_commit_mark=fast, pool_size=max(5, sessions))
        register(u)
        s = u.session(agent_id=f"warm-{i}")
        s.call_sync("scale_refund", user_id="u", amount=1)
        s.complete()
        return u
    u = prepared
    end = time.perf_counter() + seconds
    calls_per_session = 10

    def loop(t: int) -> int:
        n = 0
        while time.perf_counter() < end:
            s = u.session(agent_id=f"worker-{i}-{t}")
            for k in range(calls_per_session):
                s.call_sync("scale_refund", user_id=f"u{k}", amount=k)
                n += 1
            s.complete()
        return n

    n = _in_threads(loop, list(range(sessions)))
    u.close()
    return n


def bench_throughput(workers: list[int], seconds: float, rounds: int = 2, sessions: int = 1) -> list[dict[str, Any]]:
    """Interleaved rounds of: bare inserts, UndoLog with durable commit marks, UndoLog in fast mode (the mark
    without fsync; the pre-write stays durable). A figure is the calls of its runs over their summed wall time."""
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
        calls = {"bare": 0, "durable": 0, "fast": 0}
        wall = {"bare": 0.0, "durable": 0.0, "fast": 0.0}
        for _ in range(rounds):
            for name, target, args in (("bare", bare_worker, (schema, seconds, sessions)),
                                       ("durable", undolog_worker, (schema, seconds, sessions, False)),
                                       ("fast", undolog_worker, (schema, seconds, sessions, True))):
                w, res = run_workers(n, target, args)
                calls[name] += sum(res)
                wall[name] += w
        drop_schema(schema)
        rate = {k: calls[k] / wall[k] for k in calls}
        rows.append({"workers": n, "bare_per_s": round(rate["bare"]), "undolog_per_s": round(rate["durable"]),
                     "ratio": round(rate["durable"] / rate["bare"], 3), "undolog_fast_per_s": round(rate["fast"]),
                     "ratio_fast": round(rate["fast"] / rate["bare"], 3)})
    return rows


# -- 2. expiry of due approval requests from N processes --------------------------------------------------------


def raise_requests(u: UndoLog, n: int, threads: int = 4) -> list[str]:
    def one(i: int) -> str:
        s = u.session(agent_id=f"bench-{i}")
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
        conn.execute(u.store.for_update(u.store.due_claim(early), skip_locked=True)).all()
    return got


def expire_worker(i: int, prepared: Any, url: str, schema: str | None, warm: list[list[str]] | None = None) -> Any:
    if prepared is None:
        u = open_undolog(url, schema)
        warm_sweeper(u, warm[i] if warm else [])
        return u
    u = prepared
    # One sweep per process, as each server's sweeper does it: it claims batches until none is left to claim
    # (rows another worker holds are that worker's to finish).
    return u.approvals.expire_due()  # the process exits without closing: closing is not part of the sweep


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


def bench_expire(workers: list[int], n: int, *, cold: bool = False) -> list[dict[str, Any]]:
    """``n`` due requests swept by each worker count; warm sweepers (``warm_sweeper``) unless ``cold``."""
    rows = []
    for w in workers:
        schema = fresh_schema()
        u = open_undolog(PG_URL, schema)
        u.policy.set(actor="bench", approval_timeout_seconds=1)
        k = 0 if cold else WARM_REQUESTS
        ids = raise_requests(u, n + k * w)
        warm = [ids[n + k * i:n + k * (i + 1)] for i in range(w)]
        time.sleep(1.05)
        wall, res = run_workers(w, expire_worker, (PG_URL, schema, warm))
        expired = [x for r in res for x in r]
        check_expired_once(u, ids, expired + [x for mine in warm for x in mine])
        u.close()
        drop_schema(schema)
        rows.append({"workers": w, "requests": n, "expired_per_s": round(n / wall), "seconds": round(wall, 3),
                     "sweepers": "cold" if cold else "warm"})
    return rows


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
    ap.add_argument("--expire-n", type=int, default=6000, help="expire: due requests per run")
    ap.add_argument("--expire-cold", action="store_true",
                    help="expire: also time each worker process's first sweep (statements compiled, the backend's "
                         "caches filled inside the timed window), after the warm sweepers")
    ap.add_argument("--recover-n", default="1000,10000", help="recover: in-flight effects per run")
    ap.add_argument("--api-n", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    workers = [int(x) for x in args.workers.split(",")]
    recover_ns = [int(x) for x in args.recover_n.split(",")]
    rounds = 2
    if args.quick:  # a smoke run: every path once, small
        workers, args.seconds, args.expire_n, recover_ns, args.api_n, rounds = [2], 0.3, 300, [100], 40, 1
    out: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="undolog-scale-")
    if "throughput" in only:
        out["throughput"] = bench_throughput(workers, args.seconds, rounds, args.sessions)
    if "expire" in only:
        out["expire"] = bench_expire(workers, args.expire_n)
        if args.expire_cold:
            out["expire"] += bench_expire(workers, args.expire_n, cold=True)
    if "recover" in only:
        out["recover"] = [bench_recover(db, k) for k in recover_ns
                          for db in (PG_URL, f"sqlite:///{tmp}/recover-{k}.db")]
    if "api" in only:
        out["api"] = bench_api(args.api_n, servers=2 if args.quick else 4)
    if args.json:
        print(json.dumps(out))
        return 0
    for r in out.get("throughput", []):
        print(f"throughput  {r['workers']} workers: bare 2-row inserts {r['bare_per_s']:>6}/s; UndoLog durable marks "
              f"{r['undolog_per_s']:>6} calls/s (ratio {r['ratio']:.2f}), fast mode {r['undolog_fast_per_s']:>6} "
              f"calls/s (ratio {r['ratio_fast']:.2f}); goal >= 0.80")
    for r in out.get("expire", []):
        print(f"expire      {r['workers']} workers: {r['expired_per_s']:>6} timeouts/s ({r['requests']} in "
              f"{r['seconds']} s, each exactly once; {r['sweepers']} sweepers)")
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
