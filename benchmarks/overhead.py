"""UndoLog overhead, as ratios measured in the same run.

    .venv/bin/python benchmarks/overhead.py [--db sqlite|postgres|both] [--quick] [--pg-url URL]

Two comparisons, each on SQLite (a file in a temp dir) and PostgreSQL (a fresh schema, dropped at the end):

1. SAFE: ``await s.call(tool, **kw)`` (and ``s.call_sync``) against validating the same arguments with the
   same pydantic model (``spec.args_model.model_validate``) and calling the function with the validated
   values (``fn(**model.__dict__)``; awaited for the async tool, inside the same event loop). The tool bodies
   are trivial, so this is the worst case for the ratio. Goal: at most 2x.
2. COMPENSABLE: ``await s.call(tool, **kw)`` against one bare durable two-row commit on the same database
   (a raw DB-API connection: sqlite3 in WAL with synchronous=FULL, or psycopg; two INSERTs into two small
   tables, then COMMIT). Goal: at most 2.2x with the default durable commit mark. Two more rows are lower
   bounds for both modes: the work that cannot be skipped (validation, snapshot and digest, the same
   one-statement pre-write with its undo entry, the commit mark) with none of UndoLog's own bookkeeping around
   it (see ``lower_bound``). UndoLog over the lower bound of its own mode is printed as a row of its own, goal
   at most 1.1x in both modes (``UndoLog.open(url, fast_commit_mark=True)`` included; its earlier goal of
   1.3x a bare commit was withdrawn: it sat below the lower bound itself).

Machines are noisy (here, mostly the disk: the same fsync takes 0.3 ms or 0.6 ms from one second to the next),
so the variants of a comparison are interleaved: every round runs one batch of each variant, in a shuffled
order, a few milliseconds apart. A variant's time is the median over rounds of its per-call mean. Its ratio is
paired: each round divides the variant's batch by the baseline's batch of the same round (measured moments
apart, under the same disk weather), and the figure is the median of those per-round ratios, with their
p25-p75 beside it.

3. OpenTelemetry, no database: what UndoLog's instrumentation adds to each gated (COMPENSABLE/IRREVERSIBLE) call
   with ``opentelemetry-api`` installed and no SDK configured (goal: at most 5 us), beside what a no-op span and a
   recorded span (SDK, in-memory exporter) would cost, for scale. Without the API installed the cost is one
   ``is None`` test. The COMPENSABLE rows above already include the no-SDK checks.

It is a report: the exit status is 0 whatever the numbers (non-zero only if the benchmark itself breaks).
``--quick`` is a smoke run for CI (well under 30 s for both databases).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool  # noqa: E402

# Internal on purpose: the lower bound canonicalises and hashes with UndoLog's own code (the same bytes stored).
from undolog_core._json import canonical_text, sha256_hex  # noqa: E402
from undolog_core.limits import result_text  # noqa: E402
from undolog_core.storage.base import new_id  # noqa: E402

DEFAULT_PG_URL = os.environ.get("UNDOLOG_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

# -- the tools under test (trivial bodies: what is measured is UndoLog, not the tool) ---------------


@undolog_tool(tier=ToolTier.SAFE)
def bench_search(query: str, limit: int = 5) -> list[str]:
    return [query]


@undolog_tool(tier=ToolTier.SAFE)
async def bench_asearch(query: str, limit: int = 5) -> list[str]:
    return [query]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("bench_cancel_refund"))
async def bench_refund(user_id: str, amount: int) -> dict[str, Any]:
    return {"refund": user_id, "amount": amount}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("bench_cancel_refund"))
def bench_refund_sync(user_id: str, amount: int) -> dict[str, Any]:
    return {"refund": user_id, "amount": amount}


@compensation("bench_cancel_refund")
def bench_cancel_refund(ctx: Any) -> None:
    return None


TOOLS = (bench_search, bench_asearch, bench_refund, bench_refund_sync, bench_cancel_refund)
SAFE_KW: dict[str, Any] = {"query": "refund policy", "limit": 3}
COMP_KW: dict[str, Any] = {"user_id": "u1", "amount": 25}

# -- measurement -----------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    run: Callable[[int], float]  # runs n calls, returns the seconds they took
    baseline: str | None = None  # name of the variant this one is compared with
    goal: float | None = None
    samples: list[float] = field(default_factory=list)  # per-call seconds, one per round
    # A second, paired comparison printed as its own row: (the variant compared with, its goal). Used for
    # UndoLog's own bookkeeping over the lower bound of the same mode.
    over: tuple[str, str, float] | None = None  # (row label, variant compared with, goal)


def measure(variants: list[Variant], *, rounds: int, batch: int, rng: random.Random) -> None:
    for v in variants:  # warm-up: caches, prepared statements, pool connections, the lease thread
        v.run(max(1, batch // 2))
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            gc.collect()
            v.samples.append(v.run(batch) / batch)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


@dataclass
class Row:
    db: str
    group: str
    variant: str
    median_us: float
    p25_us: float
    p75_us: float
    ratio: float | None
    goal: float | None
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    goal_us: float | None = None  # an absolute goal (the OpenTelemetry rows)

    @property
    def verdict(self) -> str:
        if self.goal_us is not None:
            return "PASS" if self.median_us <= self.goal_us else "MISS"
        if self.group == "OTEL":
            return "scale"
        if self.ratio is None:
            return "baseline"
        if self.goal is None:
            return "bound" if self.variant.startswith("lower bound") else "report"
        return "PASS" if self.ratio <= self.goal else "MISS"


def rows_for(db: str, group: str, variants: list[Variant]) -> list[Row]:
    by_name = {v.name: v for v in variants}
    out = []
    for v in variants:
        lo, hi = quartiles(v.samples)
        row = Row(db, group, v.name, median(v.samples) * 1e6, lo * 1e6, hi * 1e6, None, v.goal)
        if v.baseline:
            paired = [a / b for a, b in zip(v.samples, by_name[v.baseline].samples, strict=True)]
            row.ratio = median(paired)
            row.ratio_lo, row.ratio_hi = quartiles(paired)
        out.append(row)
    for v in variants:
        if v.over is None:
            continue
        label, bound, goal = v.over
        paired = [a / b for a, b in zip(v.samples, by_name[bound].samples, strict=True)]
        lo, hi = quartiles(paired)
        extra = [(a - b) * 1e6 for a, b in zip(v.samples, by_name[bound].samples, strict=True)]
        out.append(Row(db, group, label, median(extra), *quartiles(extra), median(paired), goal,
                       lo, hi))
    return out


# -- SAFE ------------------------------------------------------------------------------------------


def safe_variants(u: UndoLog, loop: asyncio.AbstractEventLoop) -> list[Variant]:
    s = u.session(agent_id="bench-safe")
    sync_spec = u.tool_spec("bench_search")
    async_spec = u.tool_spec("bench_asearch")
    sync_validate, async_validate = sync_spec.args_model.model_validate, async_spec.args_model.model_validate
    sync_fn, async_fn = bench_search, bench_asearch
    kw = dict(SAFE_KW)

    def direct_sync(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            sync_fn(**sync_validate(kw).__dict__)
        return time.perf_counter() - t0

    def undolog_sync(n: int) -> float:
        call = s.call_sync
        t0 = time.perf_counter()
        for _ in range(n):
            call(sync_fn, **kw)
        return time.perf_counter() - t0

    async def _direct_async(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await async_fn(**async_validate(kw).__dict__)
        return time.perf_counter() - t0

    async def _undolog_async(n: int) -> float:
        call = s.call
        t0 = time.perf_counter()
        for _ in range(n):
            await call(async_fn, **kw)
        return time.perf_counter() - t0

    return [
        Variant("direct: validate + call (sync)", direct_sync),
        Variant("s.call_sync (sync tool)", undolog_sync, "direct: validate + call (sync)", 2.0),
        Variant("direct: validate + await (async)", lambda n: loop.run_until_complete(_direct_async(n))),
        Variant(
            "await s.call (async tool)",
            lambda n: loop.run_until_complete(_undolog_async(n)),
            "direct: validate + await (async)",
            2.0,
        ),
    ]


# -- COMPENSABLE -----------------------------------------------------------------------------------

_BASE_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_effect (id VARCHAR(32) PRIMARY KEY, session_id VARCHAR(200) NOT NULL, "
    "tool_name VARCHAR(200) NOT NULL, args TEXT NOT NULL, created_at TIMESTAMP NOT NULL)",
    "CREATE TABLE IF NOT EXISTS bench_undo (id VARCHAR(32) PRIMARY KEY, effect_id VARCHAR(32) NOT NULL, "
    "args TEXT NOT NULL, created_at TIMESTAMP NOT NULL)",
)


class SqliteBaseline:
    """One bare durable two-row commit: sqlite3, WAL, synchronous=FULL, same database file."""

    def __init__(self, path: str) -> None:
        self.con = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute("PRAGMA synchronous=FULL")
        for ddl in _BASE_DDL:
            self.con.execute(ddl)
        self.args = json.dumps(COMP_KW)

    def run(self, n: int) -> float:
        con, args = self.con, self.args
        t0 = time.perf_counter()
        for _ in range(n):
            a, b = uuid.uuid4().hex, uuid.uuid4().hex
            now = time.strftime("%Y-%m-%d %H:%M:%S")
            con.execute("BEGIN")
            con.execute(
                "INSERT INTO bench_effect VALUES (?, ?, ?, ?, ?)", (a, "s1", "bench_refund", args, now)
            )
            con.execute("INSERT INTO bench_undo VALUES (?, ?, ?, ?)", (b, a, args, now))
            con.execute("COMMIT")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.con.close()


class PostgresBaseline:
    """One bare durable two-row commit: psycopg, default synchronous_commit, same schema."""

    def __init__(self, url: str, schema: str) -> None:
        import psycopg

        conninfo = url.replace("postgresql+psycopg://", "postgresql://", 1)
        self.con = psycopg.connect(conninfo, options=f"-csearch_path={schema}")
        with self.con.cursor() as cur:
            for ddl in _BASE_DDL:
                cur.execute(ddl)
        self.con.commit()
        self.args = json.dumps(COMP_KW)

    def run(self, n: int) -> float:
        import datetime as dt

        con, args = self.con, self.args
        t0 = time.perf_counter()
        for _ in range(n):
            a, b = uuid.uuid4().hex, uuid.uuid4().hex
            now = dt.datetime.now()
            with con.cursor() as cur:
                cur.execute(
                    "INSERT INTO bench_effect VALUES (%s, %s, %s, %s, %s)",
                    (a, "s1", "bench_refund", args, now),
                )
                cur.execute("INSERT INTO bench_undo VALUES (%s, %s, %s, %s)", (b, a, args, now))
            con.commit()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.con.close()


def compensable_variants(
    durable: UndoLog, fast: UndoLog, baseline: Any, loop: asyncio.AbstractEventLoop
) -> list[Variant]:
    sd = durable.session(agent_id="bench-durable")
    sf = fast.session(agent_id="bench-fast")
    ssync = durable.session(agent_id="bench-durable-sync")
    kw = dict(COMP_KW)

    def via_call(s: Any, u: UndoLog) -> Callable[[int], float]:
        async def go(n: int) -> float:
            call = s.call
            t0 = time.perf_counter()
            for _ in range(n):
                await call(bench_refund, **kw)
            # Fast mode's queued commit marks are written inside the timed batch (conservative: the flush is
            # charged to the calls), and never later, in the middle of another variant's timing.
            u.engine.flush_marks()
            return time.perf_counter() - t0

        return lambda n: loop.run_until_complete(go(n))

    def via_call_sync(n: int) -> float:
        call = ssync.call_sync
        t0 = time.perf_counter()
        for _ in range(n):
            call(bench_refund_sync, **kw)
        return time.perf_counter() - t0

    base = "bare durable 2-row commit (DB-API)"
    lb_durable, lb_fast = "lower bound, durable mark", "lower bound, fast mode"
    # UndoLog's own bookkeeping (pins, leases, the in-flight set, current_call(), call-id handling, the driver)
    # over the work no implementation can skip, in the same mode: at most 10% (issue 13's goal, which replaced
    # the withdrawn "fast mode <= 1.3x a bare commit": that one sat below the stored work itself).
    return [
        Variant(base, baseline.run),
        Variant("await s.call, durable commit mark", via_call(sd, durable), base, 2.2,
                over=("over its lower bound: await s.call, durable", lb_durable, 1.1)),
        Variant("s.call_sync, durable commit mark", via_call_sync, base, 2.2,
                over=("over its lower bound: s.call_sync, durable", lb_durable, 1.1)),
        Variant("await s.call, fast_commit_mark=True", via_call(sf, fast), base,
                over=("over its lower bound: fast mode", lb_fast, 1.1)),
        Variant(lb_durable, lower_bound(durable, loop, durable=True), base),
        Variant(lb_fast, lower_bound(fast, loop), base),
    ]


def lower_bound(u: UndoLog, loop: asyncio.AbstractEventLoop, *, durable: bool = False) -> Callable[[int], float]:
    """The work no implementation can skip, with nothing else: a lower bound, not a competitor.

    Per call: validate the arguments, take their JSON snapshot and canonical text, digest it, mint an effect id,
    write UndoLog's own one-statement pre-write (the effect row and its undo entry, durably, the session checked),
    run the tool, serialise its result and write the commit mark: with ``durable``, at once and fsynced; else
    queued and written per batch without fsync, like fast mode's flusher. Left out, although UndoLog needs them:
    the pin check, the in-flight set and lease, ``current_call()``, the recent-calls ring, call-id conflict
    handling. If this row misses a goal, no amount of trimming UndoLog's own code meets it on this machine: only
    storing less would.
    """
    spec = u.tool_spec("bench_refund")
    s = u.session(agent_id="bench-lower-bound")
    # Written now: the bound's statements go straight to the hot path, which finds a session only in the store (on
    # PostgreSQL UndoLog writes a new session's row with its first logged call).
    u.engine.persist(s.id)
    hot, owner, lease = u.engine.hot, u.engine.owner, u.lease_seconds
    validate, kw, fn = spec.args_model.__pydantic_validator__.validate_python, dict(COMP_KW), bench_refund
    assert spec.compensation is not None
    comp, version = spec.compensation.name, spec.compensation.version

    async def go(n: int) -> float:
        marks: list[tuple[str, str, float]] = []
        t0 = time.perf_counter()
        for _ in range(n):
            model = validate(kw)
            text = canonical_text(model.model_dump(mode="json"))
            digest = sha256_hex(text)
            effect_id = new_id()
            now = time.time()
            if not hot.prewrite(s.id, 0, effect_id, effect_id, spec.name, spec.revision, text, digest, owner, now,
                                now + lease, comp, version):
                raise RuntimeError("the lower bound's pre-write was refused")
            out = await fn(**model.__dict__)
            if durable:
                hot.mark(effect_id, result_text(out), time.time(), fast=False)
            else:
                marks.append((effect_id, result_text(out), time.time()))
        if marks:
            hot.mark_many(marks)
        return time.perf_counter() - t0

    return lambda n: loop.run_until_complete(go(n))


# -- OpenTelemetry ---------------------------------------------------------------------------------


def otel_rows(plan: Plan, rng: random.Random) -> list[Row]:
    """Per gated call: UndoLog's checks with the API but no SDK, against a no-op and a recorded span."""
    from undolog_core import _observe as obs

    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:
        print("[otel] opentelemetry-api/-sdk not installed: no OpenTelemetry rows", file=sys.stderr)
        return []
    if obs.tracing():
        print("[otel] an SDK is configured in this process: the no-SDK row would not mean anything", file=sys.stderr)
        return []
    attrs = obs.tool_attrs("bench_refund", "compensable", call_id="c-1", session_id="s-1", effect_id="e" * 32)
    noop = trace.get_tracer("bench")  # the API's proxy: a no-op span while no SDK is set
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    recording = provider.get_tracer("bench")  # not the global provider: the no-SDK row stays true

    def checks(n: int) -> float:
        # Exactly what CallDriver.run_sync/run_async add to a gated call when no SDK is configured.
        gated = obs.count_gated
        t0 = time.perf_counter()
        for _ in range(n):
            gated("compensable", "bench_refund")
        return time.perf_counter() - t0

    def noop_span(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with noop.start_as_current_span("execute_tool bench_refund", attributes=attrs):
                pass
        return time.perf_counter() - t0

    def recorded_span(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with recording.start_as_current_span("execute_tool bench_refund", attributes=attrs):
                pass
        exporter.clear()
        return time.perf_counter() - t0

    variants = [Variant("gated call's checks, API without SDK", checks),
                Variant("(a no-op span, API without SDK: skipped)", noop_span),
                Variant("(a recorded span, SDK + in-memory exporter)", recorded_span)]
    measure(variants, rounds=plan.safe_rounds, batch=plan.safe_batch, rng=rng)
    provider.shutdown()
    rows = rows_for("-", "OTEL", variants)
    rows[0].goal_us = 5.0
    return rows


# -- per database ----------------------------------------------------------------------------------


@dataclass
class Plan:
    safe_rounds: int
    safe_batch: int
    comp_rounds: int
    comp_batch: int


def bench_db(kind: str, plan: Plan, pg_url: str, rng: random.Random) -> list[Row]:
    loop = asyncio.new_event_loop()
    opened: list[UndoLog] = []
    baseline: Any = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    schema: str | None = None
    admin: Any = None
    try:
        if kind == "sqlite":
            tmp = tempfile.TemporaryDirectory(prefix="undolog-bench-")
            path = os.path.join(tmp.name, "bench.db")
            url = f"sqlite:///{path}"
        else:
            import sqlalchemy as sa

            schema = "bench_" + uuid.uuid4().hex[:12]
            admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", pool_size=1)
            with admin.connect() as c:
                c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
            url = pg_url
        durable = UndoLog.open(url, schema=schema)
        opened.append(durable)
        fast = UndoLog.open(url, schema=schema, fast_commit_mark=True, migrate=False)
        opened.append(fast)
        for u in opened:
            u.register(*TOOLS)
        baseline = SqliteBaseline(path) if kind == "sqlite" else PostgresBaseline(pg_url, schema or "public")

        safe = safe_variants(durable, loop)
        measure(safe, rounds=plan.safe_rounds, batch=plan.safe_batch, rng=rng)
        comp = compensable_variants(durable, fast, baseline, loop)
        measure(comp, rounds=plan.comp_rounds, batch=plan.comp_batch, rng=rng)
        return rows_for(kind, "SAFE", safe) + rows_for(kind, "COMPENSABLE", comp)
    finally:
        if baseline is not None:
            baseline.close()
        for u in opened:
            try:
                u.close()
            except Exception:  # noqa: BLE001 - a report; cleanup problems must not hide the numbers
                pass
        loop.close()
        if admin is not None:
            with admin.connect() as c:
                c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            admin.dispose()
        if tmp is not None:
            tmp.cleanup()


def print_table(rows: list[Row], plan: Plan, elapsed: float) -> None:
    # "over its lower bound" rows: their microseconds are UndoLog's own, the difference per round.
    headers = ("db", "tier", "variant", "median us", "p25-p75 us", "ratio", "ratio p25-p75", "goal", "result")
    body = []
    for r in rows:
        body.append(
            (
                r.db,
                r.group,
                r.variant,
                f"{r.median_us:,.1f}",
                f"{r.p25_us:,.1f}-{r.p75_us:,.1f}",
                f"{r.ratio:.2f}x" if r.ratio is not None else "" if r.group == "OTEL" else "1.00x",
                f"{r.ratio_lo:.2f}-{r.ratio_hi:.2f}" if r.ratio_lo is not None and r.ratio_hi is not None else "",
                f"<= {r.goal_us:.0f} us" if r.goal_us is not None else f"<= {r.goal:.1f}x" if r.goal is not None
                else "",
                r.verdict,
            )
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    right = {3, 4, 5, 6}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    prev = None
    for b in body:
        if prev is not None and b[:2] != prev[:2]:
            print()
        print(line(b))
        prev = b
    misses = [r for r in rows if r.verdict == "MISS"]
    passes = [r for r in rows if r.verdict == "PASS"]
    print()
    print(
        f"{len(passes)} PASS, {len(misses)} MISS; SAFE {plan.safe_rounds} rounds x {plan.safe_batch} calls, "
        f"COMPENSABLE {plan.comp_rounds} rounds x {plan.comp_batch} calls, interleaved; {elapsed:.1f} s. "
        f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    p.add_argument("--pg-url", default=DEFAULT_PG_URL)
    p.add_argument("--rounds", type=int, help="override the number of COMPENSABLE rounds")
    p.add_argument("--seed", type=int, default=20240601)
    args = p.parse_args(argv)
    plan = (
        Plan(safe_rounds=9, safe_batch=500, comp_rounds=7, comp_batch=5)
        if args.quick
        # 200 COMPENSABLE rounds: a round's paired ratio spreads by +-0.15x with the disk's weather, so 25 rounds
        # left the median itself moving by about 0.05x from run to run, as much as the margins measured here.
        else Plan(safe_rounds=31, safe_batch=2000, comp_rounds=200, comp_batch=10)
    )
    if args.rounds:
        plan.comp_rounds = args.rounds
    rng = random.Random(args.seed)
    kinds = ("sqlite", "postgres") if args.db == "both" else (args.db,)
    rows: list[Row] = []
    broken = False
    t0 = time.perf_counter()
    for kind in kinds:
        try:
            rows += bench_db(kind, plan, args.pg_url, rng)
        except Exception as exc:  # noqa: BLE001 - report what could not be measured, keep the rest
            broken = True
            print(f"[{kind}] the benchmark could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        rows += otel_rows(plan, rng)
    except Exception as exc:  # noqa: BLE001 - as above
        broken = True
        print(f"[otel] the benchmark could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
    if rows:
        print_table(rows, plan, time.perf_counter() - t0)
    # A report: missed goals do not fail the run; a benchmark that cannot run does (CI smoke).
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
