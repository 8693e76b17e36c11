"""Where one COMPENSABLE call's time goes, in the gateway and in the forward-only proxy (a diagnostic, not a gate).

    .venv/bin/python benchmarks/mcp_trace.py [--db sqlite|postgres] [--calls N] [--pg-url URL]
                                             [--tool add_item|lookup|mixed]

The gateway and the proxy run as usual (stdio subprocesses of one MCP client), each started through this file's
``--wrap`` mode, which stamps ``time.perf_counter_ns()`` (CLOCK_MONOTONIC: comparable across the processes) at:
the request frame read from stdin, the SDK's request handler entered, the gateway's decide, the upstream call,
the commit mark, the handler left, and the response frame flushed to stdout; the client stamps its own send and
receive. Each process also counts its worker-thread hops (``asyncio.to_thread`` / anyio ``run_sync``). The
report is the median of each segment per call, the gateway's beside the proxy's, then the gateway process's threads
over the measured calls, read from ``/proc`` (Linux): per call, each thread's voluntary context switches (it blocked:
an fsync, a lock, the GIL, the loop's wait for input), involuntary ones (preempted) and its user and system CPU.
Counts the machine's load does not move: which threads wake during a call, and how often the loop thread sleeps.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import json
import os
import runpy
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


# -- the wrapped process's side ----------------------------------------------------------------------------------


def _install(out_path: str) -> None:
    """Patch the stamps into this process (before the gateway or the proxy imports anything of its own)."""
    import functools

    stamps: list[tuple[str, int]] = []
    hops: collections.Counter[str] = collections.Counter()
    cpu: dict[str, list[int]] = collections.defaultdict(list)
    threads: dict[int, str] = {}  # native thread id -> the Python thread's name (the report's per-thread counts)
    now = time.perf_counter_ns

    import threading

    run = threading.Thread.run

    def named_run(self: threading.Thread) -> None:
        threads[threading.get_native_id()] = self.name
        run(self)

    threading.Thread.run = named_run  # type: ignore[method-assign]
    threads[threading.get_native_id()] = "main (the event loop)"

    profile = None
    if os.environ.get("UNDOLOG_TRACE_PROFILE"):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()

    def dump() -> None:
        Path(out_path).write_text(json.dumps({"stamps": stamps, "hops": hops, "cpu": cpu, "threads": threads}))
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.environ["UNDOLOG_TRACE_PROFILE"])

    atexit.register(dump)

    def on_term(*_: Any) -> None:
        dump()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)

    class In:
        def __init__(self, raw: Any) -> None:
            self._raw = raw

        def read1(self, n: int = -1) -> bytes:
            data: bytes = self._raw.read1(n)
            if data:
                stamps.append(("frame_in", now()))
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self._raw, name)

    class Out:
        def __init__(self, raw: Any) -> None:
            self._raw = raw

        def flush(self) -> None:
            self._raw.flush()
            stamps.append(("frame_out", now()))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._raw, name)

    class Std:
        def __init__(self, real: Any, buffer: Any) -> None:
            self._real, self.buffer = real, buffer

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

    sys.stdin = Std(sys.stdin, In(sys.stdin.buffer))  # type: ignore[assignment]
    sys.stdout = Std(sys.stdout, Out(sys.stdout.buffer))  # type: ignore[assignment]

    def around(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        async def wrapped(*a: Any, **k: Any) -> Any:
            stamps.append((label + "<", now()))
            try:
                return await fn(*a, **k)
            finally:
                stamps.append((label + ">", now()))

        setattr(owner, name, wrapped)

    def around_sync(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            stamps.append((label + "<", now()))
            c0 = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                stamps.append((label + ">", now()))
                cpu[label].append(time.thread_time_ns() - c0)

        setattr(owner, name, wrapped)

    import anyio.to_thread
    from mcp import ClientSession
    from mcp.server.lowlevel import Server

    around(Server, "_handle_request", "handler")
    around(ClientSession, "call_tool", "upstream")
    from anyio._backends import _asyncio as anyio_asyncio

    send, receive = anyio_asyncio.StreamWriterWrapper.send, anyio_asyncio.StreamReaderWrapper.receive

    async def pipe_send(self: Any, item: bytes) -> None:
        await send(self, item)
        stamps.append(("up_sent", now()))

    async def pipe_receive(self: Any, max_bytes: int = 65536) -> bytes:
        data: bytes = await receive(self, max_bytes)
        stamps.append(("up_read", now()))
        return data

    anyio_asyncio.StreamWriterWrapper.send = pipe_send  # type: ignore[method-assign]
    anyio_asyncio.StreamReaderWrapper.receive = pipe_receive  # type: ignore[method-assign]

    real_to_thread = asyncio.to_thread

    async def to_thread(fn: Any, *a: Any, **k: Any) -> Any:
        hops[f"asyncio.to_thread {getattr(fn, '__qualname__', fn)}"] += 1
        return await real_to_thread(fn, *a, **k)

    asyncio.to_thread = to_thread  # type: ignore[assignment]
    real_run_sync = anyio.to_thread.run_sync

    async def run_sync(fn: Any, *a: Any, **k: Any) -> Any:
        hops[f"anyio run_sync {getattr(fn, '__qualname__', fn)}"] += 1
        return await real_run_sync(fn, *a, **k)

    anyio.to_thread.run_sync = run_sync  # type: ignore[assignment]

    try:
        from undolog_core import _driver, _engine, _mark_queue
    except ImportError:
        return
    around(_driver.CallDriver, "adecide", "decide")
    around_sync(_mark_queue.MarkQueue, "complete", "complete")  # bound as engine.complete when an engine is made
    around_sync(_engine.Engine, "intercept_spec", "intercept")


def _wrap(argv: list[str]) -> None:
    out = os.environ["UNDOLOG_TRACE_OUT"]
    _install(out)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


# -- the client's side -------------------------------------------------------------------------------------------


def _segments(stamps: list[tuple[str, int]], client: list[tuple[int, int]], gateway: bool) -> dict[str, list[float]]:
    """Per call, the time between consecutive stamps (us), keyed by the pair of stamp names."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    ordered = sorted(stamps, key=lambda s: s[1])
    for sent, got in client:
        inside = [s for s in ordered if sent <= s[1] <= got]
        # The first frame_in of the call (a frame may arrive in more than one read), the last frame_out.
        seq: list[tuple[str, int]] = [("client_send", sent)]
        seen: set[str] = set()
        for name, t in inside:
            if name == "frame_in" and "frame_in" in seen:
                continue
            seen.add(name)
            seq.append((name, t))
        seq.append(("client_recv", got))
        for (a, ta), (b, tb) in zip(seq, seq[1:], strict=False):
            out[f"{a} -> {b}"].append((tb - ta) / 1e3)
        out["TOTAL"].append((got - sent) / 1e3)
    return out


def _cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + sys) of this process's descendants, keyed by a short form of their command lines."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        cpu[-int(entry)] = int(fields[12]) / tick
    me = os.getpid()
    out: dict[str, float] = {"client (this process)": cpu.get(me, 0.0)}
    for pid in [p for p in cpu if p > 0]:
        p, depth = pid, 0
        while p in parent and p != me and p > 1:
            p, depth = parent[p], depth + 1
        if p != me or pid == me:
            continue
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        words = [w.decode() for w in cmd if w]
        name = ("gateway" if "serve" in words else "proxy" if any("forward_proxy" in w for w in words)
                else "upstream" if any("mcp_upstream" in w for w in words) else " ".join(words)[:40])
        kind = f"{name} (pid {pid}, parent {parent[pid]})"
        out[kind] = cpu[pid]
        out[kind + " sys"] = cpu[-pid]
    return out


def _tasks(pid: int) -> dict[int, tuple[int, int, int, int]]:
    """Per thread of ``pid``: (voluntary and involuntary context switches, user and system CPU in clock ticks)."""
    out: dict[int, tuple[int, int, int, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        switches = dict(line.split(":\t", 1) for line in status.splitlines() if "ctxt_switches" in line)
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(switches["voluntary_ctxt_switches"]), int(switches["nonvoluntary_ctxt_switches"]),
                         int(fields[11]), int(fields[12]))
    return out


def _gateway_pid() -> int | None:
    """The gateway's process (a child of this one, ``... mcp serve ...``)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if b"serve" in cmd and int(stat[stat.rindex(")") + 2:].split()[1]) == me:
            return int(entry)
    return None


async def _run(kind: str, calls: int, pg_url: str, tool: str = "add_item") -> None:
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from mcp_gateway import UPSTREAM, client, config

    # mixed: each measured COMPENSABLE call follows a SAFE call on the same session, as in mcp_gateway.py's rounds
    # (the core counts a SAFE call in memory and its next pre-write writes the count: that cost lands here).
    mixed, tool = tool == "mixed", "add_item" if tool == "mixed" else tool
    with tempfile.TemporaryDirectory(prefix="undolog-mcp-trace-") as tmpdir:
        tmp = Path(tmpdir)
        schema = None
        admin: Any = None
        if kind == "sqlite":
            url = f"sqlite:///{tmp / 'bench.db'}"
        else:
            import sqlalchemy as sa

            schema = "mcptrace_" + uuid.uuid4().hex[:10]
            admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", pool_size=1)
            with admin.connect() as c:
                c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
            url = pg_url
        me = [sys.executable, str(Path(__file__).resolve()), "--wrap"]
        gw_out, px_out = tmp / "gw.json", tmp / "px.json"
        base = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        gw_env = {**base, "UNDOLOG_DATABASE_URL": url, "UNDOLOG_TRACE_OUT": str(gw_out),
                  **({"UNDOLOG_TRACE_PROFILE": os.environ["PROFILE_GATEWAY"]} if "PROFILE_GATEWAY" in os.environ else {}),
                  **({"UNDOLOG_SCHEMA": schema} if schema else {})}
        px_env = {**base, "UNDOLOG_TRACE_OUT": str(px_out)}
        gw_cmd = [*me, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(config(tmp))]
        px_cmd = [*me, str(HERE / "mcp_forward_proxy.py"), *UPSTREAM]
        timings: dict[str, list[tuple[int, int]]] = {"gateway": [], "proxy": []}
        # The yardstick of issue #32's COMPENSABLE goal, in this run: one bare durable two-row commit on the same
        # database (overhead.py's), between calls, its wall and CPU (this thread's) beside the pre-write's and
        # the mark's.
        bare: list[tuple[int, int]] = []
        try:
            async with client(gw_cmd, gw_env) as gw, client(px_cmd, px_env) as px:
                sessions = {"gateway": gw, "proxy": px}
                for s in sessions.values():  # warm-up (the first call lists tools, opens the UndoLog session)
                    for i in range(20):
                        await s.call_tool(tool, _args(tool, f"w{i}-{id(s)}"))
                await asyncio.sleep(0.2)
                from overhead import PostgresBaseline, SqliteBaseline

                baseline: Any = (SqliteBaseline(str(tmp / "bench.db")) if kind == "sqlite"
                                 else PostgresBaseline(pg_url, schema or "public"))
                cpu0 = _cpu_by_process()
                gw_pid = _gateway_pid()
                tasks0 = _tasks(gw_pid) if gw_pid is not None else {}
                warm = time.perf_counter_ns()
                for i in range(calls):
                    for which, s in sessions.items():
                        if mixed:  # unmeasured: its stamps fall outside every measured call's window
                            await s.call_tool("lookup", _args("lookup", f"m{i}"))
                        t0 = time.perf_counter_ns()
                        out = await s.call_tool(tool, _args(tool, f"c{i}"))
                        t1 = time.perf_counter_ns()
                        if out.isError:
                            raise RuntimeError(out.content)
                        timings[which].append((t0, t1))
                    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                    baseline.run(1)
                    bare.append((time.perf_counter_ns() - w0, time.thread_time_ns() - c0))
                cpu1 = _cpu_by_process()
                tasks1 = _tasks(gw_pid) if gw_pid is not None else {}
                baseline.close()
        finally:
            if admin is not None:
                with admin.connect() as c:
                    c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                admin.dispose()
        print(f"\nbare durable two-row commit (client process, same database), median of {len(bare)}: "
              f"{statistics.median(w for w, _ in bare) / 1e3:.1f} us wall, "
              f"{statistics.median(c for _, c in bare) / 1e3:.1f} us CPU of its thread")
        print(f"\nCPU time (user+sys) per call, us, over the {calls} calls of each (robust to the machine's load):")
        for key in sorted(cpu1):
            if key in cpu0:
                print(f"  {key:<60} {(cpu1[key] - cpu0[key]) / calls * 1e6:9.1f}")
        for which, path in (("gateway", gw_out), ("proxy", px_out)):
            data = json.loads(path.read_text())
            stamps = [(n, t) for n, t in data["stamps"] if t >= warm]
            segs = _segments(stamps, timings[which], which == "gateway")
            tier = "SAFE" if tool == "lookup" else "COMPENSABLE" + (", each after a SAFE call" if mixed else "")
            print(f"\n[{kind}] {which}: median us per call over {calls} {tier} calls ({tool})")
            for name, xs in segs.items():
                if len(xs) >= calls // 2:
                    print(f"  {name:<40} {statistics.median(xs):9.1f}")
            for label, xs in data.get("cpu", {}).items():
                print(f"  CPU of the loop thread in {label}: median {statistics.median(xs[-calls:]) / 1e3:.1f} us")
            print("  thread hops (whole run, incl. warm-up):")
            for name, n in sorted(data["hops"].items(), key=lambda kv: -kv[1]):
                print(f"    {n:6d}  {name}")
            if which == "gateway" and tasks1:
                tick = os.sysconf("SC_CLK_TCK")
                names = {int(k): v for k, v in data.get("threads", {}).items()}
                per = f"per measured call{' (and its unmeasured SAFE call)' if mixed else ''}"
                print(f"  threads of the gateway process, {per}: voluntary / involuntary context switches, "
                      "user / system CPU us")
                for tid, after in sorted(tasks1.items()):
                    before = tasks0.get(tid, (0, 0, 0, 0))
                    d = [(a - b) / calls for a, b in zip(after, before, strict=True)]
                    if any(d):
                        print(f"    {names.get(tid, f'tid {tid}')[:36]:<36} {d[0]:6.2f} / {d[1]:5.2f}   "
                              f"{d[2] * 1e6 / tick:7.0f} / {d[3] * 1e6 / tick:5.0f}")


def _args(tool: str, unique: str) -> dict[str, str]:
    """The benchmark upstream's arguments: ``lookup`` (SAFE) takes ``q``, ``add_item`` (COMPENSABLE) a new name."""
    return {"q": unique} if tool == "lookup" else {"name": unique}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--wrap":
        _wrap(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--pg-url", default=None)
    p.add_argument("--tool", choices=("add_item", "lookup", "mixed"), default="add_item",
                   help="add_item: the COMPENSABLE tool (default); lookup: the SAFE one, to compare segment by "
                        "segment; mixed: add_item, each call after an unmeasured lookup on the same session")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    from overhead import DEFAULT_PG_URL

    asyncio.run(_run(args.db, args.calls, args.pg_url or DEFAULT_PG_URL, args.tool))


if __name__ == "__main__":
    main()
