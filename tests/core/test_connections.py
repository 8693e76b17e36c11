"""Connections: bounded whatever the number of threads (hole 2), and healed after they drop (hole 3).

Hole 2, "one connection per thread, forever": COMPENSABLE calls from short-lived threads must not leak a connection
each. On SQLite the process's open file descriptors (and, in the soak, its RSS) stay flat; on PostgreSQL the backends
carrying this test's own ``application_name`` never exceed ``store.max_connections`` and never grow with the call
count.

Hole 3, "no healing after a dropped connection": a call that meets a dropped connection raises
``DatabaseUnavailable`` (never a raw driver error), the next calls work as soon as the database is back, and
``recover()`` settles what was in flight; counting the tool's real executions against the effect rows, nothing is
lost and nothing runs twice. Chaos runs on PostgreSQL: backends terminated with ``pg_terminate_backend`` on the shared
server, and a private cluster (never the shared one) restarted with ``pg_ctl restart -m fast``.

The quick versions always run; ``pytest --long`` adds the soak (2,000 calls) and repeated-chaos versions.
"""

from __future__ import annotations

import asyncio
import glob
import math
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import UndoLog, errors
from undolog_core.storage import schema as t
from undolog_core.testing import internals

from ..support.toolkit import World, setup

PG_URL = os.environ.get("UNDOLOG_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def with_app_name(url: str, name: str) -> str:
    """The URL with an ``application_name`` query parameter, so this test's backends can be told apart."""
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


class Backends:
    """Counts (and terminates) the PostgreSQL backends of one application_name, over its own connection."""

    def __init__(self, url: str, app_name: str) -> None:
        import psycopg

        self.app_name = app_name
        base = url.split("?", 1)[0]
        self.conn = psycopg.connect(libpq(base), autocommit=True, application_name="undolog-test-observer")

    def count(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                                (self.app_name,)).fetchone()
        assert row is not None
        return int(row[0])

    def terminate(self) -> int:
        rows = self.conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s AND pid <> "
            "pg_backend_pid()", (self.app_name,)).fetchall()
        return len(rows)

    def close(self) -> None:
        self.conn.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def pool_bound(store: Any) -> int:
    """The most connections UndoLog's pools may hold: ``store.max_connections`` (added with the connection pool).

    Before it existed the store declared no bound; what its two SQLAlchemy pools could hold (pool size plus
    overflow) stands in, so the leak is measured against the same kind of limit. ``test_store_declares_its_bound``
    requires the attribute itself.
    """
    bound = getattr(store, "max_connections", None)
    if isinstance(bound, int):
        return bound
    return sum(e.pool.size() + e.pool._max_overflow for e in (store.engine, store.fast))


@dataclass
class Named:
    undolog: UndoLog
    app_name: str
    kind: str
    backends: Backends | None


@pytest.fixture
def named(db: Any) -> Iterator[Named]:
    """An UndoLog on the test's database whose PostgreSQL connections carry a unique application_name."""
    app = "ul_" + uuid.uuid4().hex[:16]
    url = with_app_name(db.url, app) if db.kind == "postgres" else db.url
    u = UndoLog.open(url, schema=db.schema)
    db.opened.append(u)
    backends = Backends(db.url, app) if db.kind == "postgres" else None
    yield Named(u, app, db.kind, backends)
    if backends is not None:
        backends.close()


# ------------------------------------------------------------------------------------------ hole 2


class Gauge:
    """Watches what a leak would grow: backends on PostgreSQL, descriptors (and RSS) on SQLite.

    It fails at the first sample over the limit, so a leaking build stops early instead of exhausting the shared
    server's connections (other tests use it at the same time).
    """

    def __init__(self, n: Named) -> None:
        self.n = n
        self.bound = pool_bound(n.undolog.store)
        self.fds0 = open_fds()
        self.rss0 = rss_mb()
        self.samples: list[tuple[int, int]] = []  # (calls so far, backends or descriptors)

    def check(self, calls: int) -> None:
        if self.n.backends is not None:
            c = self.n.backends.count()
            self.samples.append((calls, c))
            assert c <= self.bound, (
                f"after {calls} calls from short-lived threads, {c} backends of {self.n.app_name} are open; "
                f"the pools may hold at most {self.bound}"
            )
        else:
            fds = open_fds()
            self.samples.append((calls, fds))
            assert fds - self.fds0 <= 10, (
                f"after {calls} calls from short-lived threads, {fds - self.fds0} more file descriptors are open"
            )

    def flat(self, *, rss_slack_mb: float | None = None) -> None:
        """At the end: nothing grew with the call count."""
        if self.n.backends is not None:
            early = max(c for k, c in self.samples[: max(1, len(self.samples) // 10)])
            assert self.samples[-1][1] <= early + 1, self.samples[-5:]
        else:
            assert open_fds() - self.fds0 <= 10
        if rss_slack_mb is not None and self.n.backends is None:
            assert rss_mb() - self.rss0 <= rss_slack_mb, f"RSS grew {rss_mb() - self.rss0:.1f} MB"


def _committed(u: UndoLog, session_id: str) -> int:
    with internals(u).read() as c:
        return int(c.execute(sa.select(sa.func.count()).select_from(t.effect_log).where(
            t.effect_log.c.session_id == session_id, t.effect_log.c.state == "committed")).scalar_one())


def _calls_from_new_threads(named: Named, n: int, *, rss_slack_mb: float | None = None) -> None:
    u = named.undolog
    world, tools = setup(u)
    send = tools["send_refund_email"]
    s = u.session(agent_id="threads")
    s.call_sync(send, user_id="warm", amount=0)  # the main thread's share, before the baseline
    gauge = Gauge(named)
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            s.call_sync(send, user_id=f"u{i}", amount=i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    for i in range(n):
        th = threading.Thread(target=one, args=(i,))
        th.start()
        th.join()
        assert not failures, failures[0]
        if named.kind == "postgres" or (i + 1) % 25 == 0:
            gauge.check(i + 1)
        if i == 99 and rss_slack_mb is not None:
            gauge.rss0 = rss_mb()  # after the warm-up: caches and the world's log have their steady size
    gauge.check(n)
    gauge.flat(rss_slack_mb=rss_slack_mb)
    assert world.count("send") == n + 1 and _committed(u, s.id) == n + 1


def test_store_declares_its_bound(undolog: UndoLog) -> None:
    bound = getattr(undolog.store, "max_connections", None)
    assert isinstance(bound, int) and bound > 0, "store.max_connections: the most connections UndoLog may hold"


def test_compensable_calls_from_short_lived_threads_do_not_leak_connections(named: Named) -> None:
    _calls_from_new_threads(named, 300)


@pytest.mark.long
def test_soak_2000_compensable_calls_each_from_a_new_thread(named: Named) -> None:
    _calls_from_new_threads(named, 2000, rss_slack_mb=20.0)


def test_async_calls_from_fresh_threads_do_not_leak_connections(named: Named) -> None:
    """200 ``await s.call(...)``: half on the test's event loop, half on a fresh thread's own loop each."""
    u = named.undolog
    world, tools = setup(u)
    send = tools["send_refund_email"]
    s = u.session(agent_id="async")

    async def main() -> None:
        await s.call(send, user_id="warm", amount=0)
        gauge = Gauge(named)
        loop = asyncio.get_running_loop()
        for i in range(200):
            if i % 2:
                await s.call(send, user_id=f"u{i}", amount=i)
            else:
                # Like asyncio.to_thread, but a thread that is new for every call and then ends.
                with ThreadPoolExecutor(max_workers=1) as fresh:
                    await loop.run_in_executor(fresh, asyncio.run, s.call(send, user_id=f"u{i}", amount=i))
            if named.kind == "postgres" or (i + 1) % 25 == 0:
                gauge.check(i + 1)
        gauge.flat()

    asyncio.run(main())
    assert world.count("send") == 201 and _committed(u, s.id) == 201


# ------------------------------------------------------------------------------------------ hole 3


#: How many calls may fail after the database is back before one succeeds: a dropped connection is met at most once
#: per pool the caller draws on (the general pool and the hot path's two), each time invalidating its pool.
HEALING_CALLS = 3


@dataclass
class Outcome:
    kind: str  # "compensable" | "irreversible" | "safe"
    call_id: str
    started: float
    ended: float
    result: str  # "ok" | "unavailable" | "raw"
    error: BaseException | None = None


@dataclass
class Chaos:
    """A loop of calls (COMPENSABLE, SAFE, IRREVERSIBLE requests) while another thread breaks the database."""

    undolog: UndoLog
    world: World
    tools: dict[str, Any]
    outcomes: list[Outcome] = field(default_factory=list)
    breaks: list[tuple[float, float]] = field(default_factory=list)  # (broken at, usable again at)

    def call(self, kind: str, call_id: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            fn()
            result, err = "ok", None
        except errors.ApprovalPending:
            result, err = "ok", None
        except errors.DatabaseUnavailable as exc:
            result, err = "unavailable", exc
        except Exception as exc:  # noqa: BLE001 - a raw driver error is what the test reports
            result, err = "raw", exc
        self.outcomes.append(Outcome(kind, call_id, t0, time.monotonic(), result, err))
        if result == "unavailable":
            time.sleep(0.01)  # the database is away: do not spin

    def run(self, breaker: Callable[[], None], *, breaks: int, every: float, tail: float = 1.5) -> str:
        s = self.undolog.session(agent_id="chaos")
        tools = self.tools
        done = threading.Event()

        def break_it() -> None:
            for _ in range(breaks):
                time.sleep(every)
                t0 = time.monotonic()
                breaker()
                self.breaks.append((t0, time.monotonic()))
            time.sleep(tail)
            done.set()

        th = threading.Thread(target=break_it, name="chaos-breaker")
        th.start()
        i = 0
        try:
            while not done.is_set() and i < 100_000:
                self.call("compensable", f"c{i}",
                          lambda i=i: s.call_sync(tools["send_refund_email"], user_id=f"u{i}", amount=i,
                                                  call_id=f"c{i}"))
                self.call("safe", f"s{i}", lambda i=i: s.call_sync(tools["search_knowledge_base"], query=f"q{i}"))
                if i % 5 == 0:
                    self.call("irreversible", f"d{i}",
                              lambda i=i: s.call_sync(tools["delete_user_account"], user_id=f"x{i}",
                                                      call_id=f"d{i}"))
                i += 1
        finally:
            done.set()
            th.join()
        return s.id

    def check_calls(self) -> None:
        raw = [o for o in self.outcomes if o.result == "raw"]
        assert not raw, (
            f"{len(raw)} calls met the dropped connection as a raw driver error, not DatabaseUnavailable; first: "
            f"{raw[0].kind} {raw[0].call_id}: {type(raw[0].error).__module__}.{type(raw[0].error).__name__}: "
            f"{raw[0].error}"
        )
        assert len(self.breaks) >= 1
        # Healed at once, counted in calls, not seconds (a loaded machine stretches seconds): per break, of the calls
        # made after the database is back and ended before the next break, at most HEALING_CALLS fail (a dropped
        # connection is met once per pool, then the pool is invalidated), one succeeds, and none fails after it.
        starts = [broke for broke, _ in self.breaks[1:]] + [math.inf]
        healed: list[float] = []
        for (_broke, back), nxt in zip(self.breaks, starts, strict=True):
            after = [o for o in self.outcomes if o.started >= back and o.ended < nxt and o.kind != "safe"]
            first = next((i for i, o in enumerate(after) if o.result == "ok"), None)
            assert first is not None, "no call succeeded after the database came back"
            assert first <= HEALING_CALLS, (
                f"{first} calls failed after the database was back before one succeeded: "
                f"{[(o.kind, o.result, str(o.error)[:80]) for o in after[:first]]}")
            late = [o for o in after[first:] if o.result != "ok"]
            assert not late, f"a healed process failed again: {late[0].kind} {late[0].call_id}: {late[0].error}"
            healed.append(after[first].started)
        # A call fails only around a break: every DatabaseUnavailable overlaps a break, from the moment it began to
        # the first success after it.
        for o in self.outcomes:
            if o.result == "unavailable":
                assert any(o.ended >= broke and o.started <= ok_at
                           for (broke, _back), ok_at in zip(self.breaks, healed, strict=True)), (
                    f"{o.kind} {o.call_id} raised DatabaseUnavailable far from any break: {o.error}"
                )
        assert any(o.result == "ok" for o in self.outcomes if o.started < self.breaks[0][0] and o.kind != "safe")

    def check_ledger(self, session_id: str) -> None:
        """After recover(): every effect settled; real executions against effect rows, nothing lost or run twice."""
        u = self.undolog
        report = u.recover()
        assert report.left_alive == 0 and not report.errors, report.to_dict()
        rows = u.sessions.effects(session_id)
        comp = [r for r in rows if r["tier"] == "compensable"]
        by_call: dict[str, list[dict[str, Any]]] = {}
        for r in comp:
            by_call.setdefault(r["call_id"], []).append(r)
        assert all(len(v) == 1 for v in by_call.values()), "a pre-write was written twice"
        sends: dict[str, int] = {}
        for _, (_user, _amount, key) in [c for c in self.world.calls if c[0] == "send"]:
            sends[key] = sends.get(key, 0) + 1
        cancels: dict[str, int] = {}
        for _, (user_id, *_rest) in [c for c in self.world.calls if c[0] == "cancel"]:
            cancels[user_id] = cancels.get(user_id, 0) + 1
        effect_keys = {f"do-{r['effect_id']}" for r in comp}
        assert set(sends) <= effect_keys, "the tool ran for a call with no effect row: lost"
        assert all(n == 1 for n in sends.values()), "a tool call ran twice"
        for r in comp:
            assert r["state"] in ("committed", "compensated"), (r["call_id"], r["state"])
            ran = sends.get(f"do-{r['effect_id']}", 0)
            user = r["args_snapshot"]["user_id"]
            if r["state"] == "committed":
                assert ran == 1 and cancels.get(user, 0) == 0, (r["call_id"], ran)
            else:
                assert ran <= 1 and cancels.get(user, 0) == 1, (r["call_id"], ran, cancels.get(user))
        ok = {o.call_id for o in self.outcomes if o.kind == "compensable" and o.result == "ok"}
        assert ok <= {r["call_id"] for r in comp if r["state"] == "committed"}, "a call that returned was lost"
        unavailable = {o.call_id for o in self.outcomes if o.kind == "compensable" and o.result == "unavailable"}
        assert not (unavailable & ok)
        # IRREVERSIBLE: each request that was acknowledged exists once, and nothing ran without a person.
        irr = [r for r in rows if r["tier"] == "irreversible"]
        asked = {o.call_id for o in self.outcomes if o.kind == "irreversible" and o.result == "ok"}
        assert asked <= {r["call_id"] for r in irr}
        assert len({r["call_id"] for r in irr}) == len(irr)
        assert self.world.count("delete") == 0
        assert u.recover().reconciled == []  # settled for good


@pytest.fixture
def shared_pg(pg_admin: Any) -> Iterator[tuple[str, Backends, str]]:
    """A fresh schema on the shared server and an application_name of our own (PostgreSQL runs only)."""
    schema = "t_" + uuid.uuid4().hex[:16]
    app = "ul_" + uuid.uuid4().hex[:16]
    backends = Backends(PG_URL, app)
    yield with_app_name(PG_URL, app), backends, schema
    backends.close()
    with pg_admin.connect() as c:
        c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _terminated_backends(shared_pg: tuple[str, Backends, str], *, breaks: int) -> None:
    url, backends, schema = shared_pg
    u = UndoLog.open(url, schema=schema)
    try:
        world, tools = setup(u)
        chaos = Chaos(u, world, tools)
        killed: list[int] = []
        # Breaks more than a second apart, so "works again within a second" is measured per break.
        sid = chaos.run(lambda: killed.append(backends.terminate()), breaks=breaks, every=0.4 if breaks == 1 else 1.2)
        assert all(k >= 1 for k in killed), f"nothing to terminate: {killed}"
        chaos.check_calls()
        chaos.check_ledger(sid)
    finally:
        u.close()


@pytest.mark.postgres_only
def test_terminated_backends_are_healed(shared_pg: tuple[str, Backends, str]) -> None:
    _terminated_backends(shared_pg, breaks=1)


@pytest.mark.postgres_only
@pytest.mark.long
def test_terminated_backends_are_healed_again_and_again(shared_pg: tuple[str, Backends, str]) -> None:
    _terminated_backends(shared_pg, breaks=8)


# -- a private PostgreSQL cluster (the shared server is never restarted: others use it) -------------


@dataclass
class Cluster:
    url: str
    restart: Callable[[], None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def private_pg(tmp_path: Any) -> Iterator[Cluster]:
    """initdb + pg_ctl into a temporary directory, as the ``postgres`` OS user when run as root (initdb refuses
    root); stopped and deleted in the finalizer."""
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    assert bins, "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin"
    bindir = bins[-1]
    base = tempfile.mkdtemp(prefix="undolog-pg-")
    data = os.path.join(base, "data")
    as_pg: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_pg = ["runuser", "-u", "postgres", "--"]
    port = _free_port()

    log = os.path.join(base, "log")

    def pg_ctl(*args: str) -> None:
        # The server's output goes to the log file (-l), never to a pipe of ours: a server that inherits the pipe
        # keeps it open, and waiting for pg_ctl's output would wait for the server to exit.
        subprocess.run([*as_pg, f"{bindir}/pg_ctl", "-D", data, "-w", "-t", "60", "-l", log, *args], check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=90)

    subprocess.run([*as_pg, f"{bindir}/initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync"],
                   check=True, capture_output=True, timeout=120)
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=60"
    pg_ctl("-o", opts, "start")
    try:
        yield Cluster(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
                      lambda: pg_ctl("-m", "fast", "restart"))
    finally:
        try:
            pg_ctl("-m", "immediate", "stop")
        finally:
            shutil.rmtree(base, ignore_errors=True)


def _restarted(private_pg: Cluster, *, breaks: int) -> None:
    app = "ul_" + uuid.uuid4().hex[:16]
    u = UndoLog.open(with_app_name(private_pg.url, app))
    try:
        world, tools = setup(u)
        chaos = Chaos(u, world, tools)
        sid = chaos.run(private_pg.restart, breaks=breaks, every=0.5 if breaks == 1 else 1.2)
        chaos.check_calls()
        chaos.check_ledger(sid)
    finally:
        u.close()


@pytest.mark.postgres_only
def test_postgres_restarted_mid_run_is_healed(private_pg: Cluster) -> None:
    _restarted(private_pg, breaks=1)


@pytest.mark.postgres_only
@pytest.mark.long
def test_postgres_restarted_again_and_again(private_pg: Cluster) -> None:
    _restarted(private_pg, breaks=4)
