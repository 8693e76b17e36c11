"""What a client that opens an MCP session per call waits for, through the gateway's socket and directly.

    .venv/bin/python benchmarks/mcp_session_start.py [--rounds 20] [--quick]

``langchain-mcp-adapters``' default ``get_tools()``, Inspector ``--cli`` and ``fast-agent go`` start their stdio
server for every session, and open a session per call. In front of such a client the gateway runs long-lived
(``undolog mcp serve --socket PATH``) and the client's config starts ``undolog mcp connect --socket PATH``, a
forwarder, per session. Timed per session, each a fresh client process's worth of work (the SDK's ``stdio_client``
starting the command, ``initialize``, one SAFE ``tools/call``, close), variants interleaved in shuffled rounds:

- direct: the client starts the upstream itself (``mcp_upstream.py``: the peer a user would pick instead, with no
  gateway);
- through the gateway: the client starts ``undolog mcp connect`` (the console script's path, as a config gives it);
- the forwarder's start alone: ``undolog mcp connect`` to a socket nobody listens on (it exits at once, status 2),
  beside ``python -c pass``, the interpreter's own start.

Figures are medians over rounds with p25-p75, and the same-run ratio of the gateway's session to the direct one.
No goal: a report, with the machine's load average beside it (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from mcp_gateway import UPSTREAM, client, config  # noqa: E402
from overhead import quartiles  # noqa: E402

# The console script, as an MCP client's config names it (``undolog``), from this interpreter's environment.
UNDOLOG = shutil.which("undolog", path=str(Path(sys.executable).parent)) or "undolog"


async def one_session(command: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    async with client(command, env) as session:
        out = await session.call_tool("lookup", {"q": "x"})
        if out.isError:
            raise RuntimeError(f"lookup failed: {out.content}")
    return time.perf_counter() - t0


def one_start(command: list[str], status: int) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, timeout=60, check=False)
    spent = time.perf_counter() - t0
    if done.returncode != status:
        raise RuntimeError(f"{command} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return spent


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="3 rounds: a smoke run")
    args = p.parse_args()
    rounds = 3 if args.quick else args.rounds
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="undolog-session-bench-") as tmpdir:
        tmp = Path(tmpdir)
        sock = tmp / "gw.sock"
        env = {**os.environ, "UNDOLOG_DATABASE_URL": f"sqlite:///{tmp / 'bench.db'}"}
        gateway = subprocess.Popen([UNDOLOG, "mcp", "serve", "--config", str(config(tmp)), "--socket", str(sock)],
                                   env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert gateway.stderr is not None
            for line in gateway.stderr:
                if "serving on socket" in line:
                    break
            else:
                raise RuntimeError(f"the socket gateway did not start (exit {gateway.wait()})")
            variants: dict[str, Callable[[], Awaitable[float]]] = {
                "session direct (the client starts the upstream)": lambda: one_session(UPSTREAM),
                "session through the gateway (undolog mcp connect)":
                    lambda: one_session([UNDOLOG, "mcp", "connect", "--socket", str(sock)]),
                "undolog mcp connect, start and exit (no gateway)":
                    lambda: asyncio.to_thread(one_start, [UNDOLOG, "mcp", "connect", "--socket",
                                                          str(tmp / "none.sock")], 2),
                "python -c pass (the interpreter's start)":
                    lambda: asyncio.to_thread(one_start, [sys.executable, "-c", "pass"], 0),
            }
            times: dict[str, list[float]] = {name: [] for name in variants}
            for run in variants.values():  # warm-up: caches, the gateway's first session
                await run()
            for _ in range(rounds):
                order = list(variants)
                random.shuffle(order)
                for name in order:
                    times[name].append(await variants[name]())
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
    ratios = [g / d for g, d in zip(times["session through the gateway (undolog mcp connect)"],
                                    times["session direct (the client starts the upstream)"], strict=True)]
    for name, ts in times.items():
        lo, hi = quartiles([t * 1000 for t in ts])
        print(f"{name:<55} {statistics.median(ts) * 1000:8.1f} ms  ({lo:.1f}-{hi:.1f})")
    lo, hi = quartiles(ratios)
    print(f"{'gateway session over direct session (same round)':<55} {statistics.median(ratios):8.2f}x    "
          f"({lo:.2f}-{hi:.2f})")
    print(f"{rounds} rounds, interleaved; Python {sys.version.split()[0]}, {os.cpu_count()} CPU; load average "
          f"{load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end. No goal: a report.")


if __name__ == "__main__":
    asyncio.run(main())
