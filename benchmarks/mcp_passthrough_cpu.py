"""CPU per resource read of the gateway's pass-through against a forward-only proxy's, in this process.

    .venv/bin/python benchmarks/mcp_passthrough_cpu.py [--reads N] [--rounds R]

Both servers run in this process over the SDK's in-memory transport, each in front of its own copy of the same
upstream (``mcp_upstream.py``, a subprocess over stdio, whose CPU is not counted): the real ``Gateway`` (passing
resources through, SQLite store on a temporary file, untouched by a read), and a forward-only proxy written with
the same SDK (``resources/read`` forwarded and answered as it came). What differs is the handler's own work. CPU
time (``time.process_time``) is far less sensitive than wall time to a loaded machine; the variants are
interleaved in rounds, and the figure is the median over rounds of the per-round difference. A report: exit
status 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mcp import ClientSession, StdioServerParameters, types  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.server.lowlevel import Server  # noqa: E402
from mcp.shared.memory import create_connected_server_and_client_session  # noqa: E402

UPSTREAM = [sys.executable, str(HERE / "mcp_upstream.py")]
DOC: Any = "bench://doc"


@contextlib.asynccontextmanager
async def proxy() -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:])
    async with stdio_client(params) as (r, w), ClientSession(r, w) as upstream:
        await upstream.initialize()
        server: Server[Any, Any] = Server("forward-proxy")

        async def read(req: types.ReadResourceRequest) -> types.ServerResult:
            return types.ServerResult(await upstream.read_resource(req.params.uri))

        server.request_handlers[types.ReadResourceRequest] = read
        async with create_connected_server_and_client_session(server) as client:
            yield client


@contextlib.asynccontextmanager
async def gateway(tmp: Path) -> AsyncIterator[ClientSession]:
    from undolog_core import UndoLog
    from undolog_mcp.config import load_config
    from undolog_mcp.gateway import Gateway

    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.bench]
        command = {UPSTREAM!r}
        [tools.bench.lookup]
        tier = "safe"
    """).replace("'", '"'))
    undolog = UndoLog.open(f"sqlite:///{tmp / 'bench.db'}")
    gw = Gateway(load_config(cfg), undolog)
    try:
        async with gw.running(), create_connected_server_and_client_session(gw.server) as client:
            yield client
    finally:
        undolog.close()


async def cpu_per_read(client: ClientSession, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        out = await client.read_resource(DOC)
        assert out.contents
    return (time.process_time() - t0) / n


async def main(reads: int, rounds: int) -> None:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="undolog-passthrough-") as d:
        async with proxy() as p, gateway(Path(d)) as g:
            for c in (p, g):
                await cpu_per_read(c, 50)  # warm-up
            samples: dict[str, list[float]] = {"proxy": [], "gateway": []}
            for i in range(rounds):
                order = [("proxy", p), ("gateway", g)] if i % 2 else [("gateway", g), ("proxy", p)]
                for name, c in order:
                    samples[name].append(await cpu_per_read(c, reads))
    diffs = [a - b for a, b in zip(samples["gateway"], samples["proxy"], strict=True)]
    for name, xs in samples.items():
        print(f"{name:8s} CPU per resource read: {statistics.median(xs) * 1e3:.3f} ms (median of {rounds} rounds)")
    print(f"gateway minus proxy: {statistics.median(diffs) * 1e3:+.3f} ms CPU per read "
          f"(min {min(diffs) * 1e3:+.3f}, max {max(diffs) * 1e3:+.3f}); goal: at most +0.3 ms")
    print(f"load average: {' '.join(f'{x:.2f}' for x in load_before)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    asyncio.run(main(a.reads, a.rounds))
