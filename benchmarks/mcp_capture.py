"""What ``capture`` adds to a COMPENSABLE MCP call: the read before it and the write of what it read.

    .venv/bin/python benchmarks/mcp_capture.py [--rounds N] [--db URL]

One gateway (``undolog mcp serve`` over stdio, the SDK's client held open) in front of two instances of the reference
``@modelcontextprotocol/server-filesystem`` (Node, installed by ``npm ci``): ``fs1_write_file`` captures the file
before overwriting it (``capture = read_text_file``), ``fs2_write_file`` is the same tool without a capture. The two
are interleaved in rounds; the figure is the median of the per-round difference (paired), with its p25-p75. A report:
exit status 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

ROOT = Path(__file__).resolve().parents[1]
NODE = ROOT / "node_modules" / ".bin" / "node"
FS = ROOT / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"


def config(tmp: Path) -> Path:
    cfg = tmp / "gateway.toml"
    blocks = []
    for name, capture in (("fs1", True), ("fs2", False)):
        root = tmp / name
        root.mkdir()
        (root / "f.txt").write_text("x" * 1000)
        blocks.append(textwrap.dedent(f"""
            [upstreams.{name}]
            command = [{json.dumps(str(NODE))}, {json.dumps(str(FS))}, {json.dumps(str(root))}]

            [tools.{name}.write_file]
            tier = "compensable"
            compensation = {{ tool = "write_file", args = {{ path = "{{args.path}}", content = "{{args.content}}" }} }}
        """))
        if capture:
            blocks.append('capture = { tool = "read_text_file", args = { path = "{args.path}" } }\n')
    cfg.write_text("".join(blocks))
    return cfg


async def main(rounds: int, db: str | None) -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as t:
        tmp = Path(t)
        cfg = config(tmp)
        url = db or f"sqlite:///{tmp / 'undolog.db'}"
        env = {**os.environ, "UNDOLOG_DATABASE_URL": url}
        params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "serve",
                                                                      "--config", str(cfg)], env=env)
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            times: dict[str, list[float]] = {"fs1_write_file": [], "fs2_write_file": []}
            for i in range(rounds + 5):
                for tool in (("fs1_write_file", "fs2_write_file") if i % 2 else ("fs2_write_file", "fs1_write_file")):
                    path = str(tmp / tool[:3] / "f.txt")
                    started = time.perf_counter()
                    out = await s.call_tool(tool, {"path": path, "content": f"round {i}" + "x" * 1000})
                    took = time.perf_counter() - started
                    assert not out.isError, out
                    if i >= 5:  # warm-up left out
                        times[tool].append(took * 1000)
    diffs = [a - b for a, b in zip(times["fs1_write_file"], times["fs2_write_file"], strict=True)]
    q = statistics.quantiles(diffs, n=4)
    print(f"rounds: {rounds}; database: {'sqlite on tmpfs' if db is None else db.split('@')[-1]}")
    print(f"without capture: median {statistics.median(times['fs2_write_file']):.2f} ms")
    print(f"with capture:    median {statistics.median(times['fs1_write_file']):.2f} ms")
    print(f"capture adds:    median {statistics.median(diffs):.2f} ms (p25 {q[0]:.2f}, p75 {q[2]:.2f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--db", default=None)
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.db))
