"""Benchmark: approvals decided per second through the REST API, and timeouts swept per second.

Each figure is printed next to its in-process baseline, with the ratio, so a regression in
the HTTP layer (auth, validation, problem mapping) or in the sweeper shows up as a falling
ratio rather than a number that depends on the machine.

    python benchmarks/approvals_api.py                      # SQLite file in a temp dir
    python benchmarks/approvals_api.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test --schema bench_x
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from undolog_core import ApprovalPending, ToolTier, UndoLog, undolog_tool  # noqa: E402
from undolog_server import create_app  # noqa: E402
from undolog_server.state import ServerSettings  # noqa: E402
from undolog_server.storage import ServerStore  # noqa: E402
from undolog_server.sweeper import Sweeper  # noqa: E402


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="benchmark", risk_tags=["bench"])
def close_account(account: str) -> dict[str, Any]:
    return {"closed": account}


def raise_requests(u: UndoLog, n: int) -> list[str]:
    ids = []
    for i in range(n):
        s = u.session(agent_id=f"bench-{i}", created_by="key:bench-agent")
        try:
            s.call_sync("close_account", account=f"a{i}", call_id="c")
        except ApprovalPending as p:
            ids.append(p.approval_request_id)
    return ids


def register(u: UndoLog) -> None:
    """``--app`` hook for the server process."""
    u.register(close_account)


def start_server(url: str, schema: str | None) -> tuple[subprocess.Popen[bytes], str]:
    """Run `undolog serve` in its own process, as in production (and off this process's GIL)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "UNDOLOG_DATABASE_URL": url, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    if schema:
        env["UNDOLOG_SCHEMA"] = schema
    proc = subprocess.Popen(
        [sys.executable, "-m", "undolog_server", "serve", "--port", str(port), "--log-level", "warning",
         "--app", "approvals_api:register", "--sweep-interval", "3600", "--recover-interval", "3600"],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/v1/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    ap.add_argument("--schema", default=None, help="PostgreSQL schema (default: a fresh one)")
    ap.add_argument("-n", type=int, default=200, help="requests per measurement")
    ap.add_argument("--concurrency", type=int, default=4, help="API clients deciding at once")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--quick", action="store_true", help="small run for CI smoke tests (n=40)")
    args = ap.parse_args()
    if args.quick:
        args.n = 40

    tmp = tempfile.mkdtemp(prefix="undolog-bench-")
    url = args.db or f"sqlite:///{tmp}/bench.db"
    schema = args.schema or (f"bench_{uuid.uuid4().hex[:8]}" if url.startswith("postgres") else None)
    u = UndoLog.open(url, schema=schema)
    u.register(close_account)
    n = args.n

    # Baseline: decisions in-process.
    ids = raise_requests(u, n)
    t0 = time.perf_counter()
    for rid in ids:
        u.approvals.approve(rid, approver="bench")
    lib_rate = n / (time.perf_counter() - t0)

    # Through the API: bearer auth, role and group checks, the decision, the response.
    proc, base = start_server(url, schema)
    _, token = ServerStore(u.store).create_key("bench-approver", ["approver"])
    ids = raise_requests(u, n)
    clients = [httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) for _ in range(args.concurrency)]

    def decide(i_rid: tuple[int, str]) -> int:
        i, rid = i_rid
        return clients[i % len(clients)].post(f"/v1/approvals/{rid}:approve", json={}).status_code

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        codes = list(pool.map(decide, enumerate(ids)))
    api_rate = n / (time.perf_counter() - t0)
    assert codes == [200] * n, set(codes)
    # Deciding twice is a 409 and never a second decision.
    assert clients[0].post(f"/v1/approvals/{ids[0]}:approve", json={}).status_code == 409
    for c in clients:
        c.close()
    proc.terminate()
    proc.wait(30)

    # Timeouts: due requests expired in-process (baseline) and by a server sweep (expire + outbox fan-out).
    u.policy.set(actor="bench", approval_timeout_seconds=1)
    raise_requests(u, n)
    time.sleep(1.05)
    t0 = time.perf_counter()
    expired = u.approvals.expire_due()
    lib_sweep = len(expired) / (time.perf_counter() - t0)
    raise_requests(u, n)
    time.sleep(1.05)
    app = create_app(u, settings=ServerSettings(background=False))
    sweeper = Sweeper(app.state.undolog_server)
    t0 = time.perf_counter()
    counts = sweeper.tick()
    sweep_rate = counts["expired"] / (time.perf_counter() - t0)
    assert counts["expired"] == n and len(expired) == n
    u.close()

    result = {
        "database": url.split(":", 1)[0],
        "n": n,
        "concurrency": args.concurrency,
        "decided_per_s_api": round(api_rate, 1),
        "decided_per_s_library": round(lib_rate, 1),
        "ratio_api_to_library": round(api_rate / lib_rate, 3),
        "timeouts_swept_per_s_server": round(sweep_rate, 1),
        "timeouts_expired_per_s_library": round(lib_sweep, 1),
        "ratio_sweeper_to_library": round(sweep_rate / lib_sweep, 3),
        "ratio_swept_to_decided_api": round(sweep_rate / api_rate, 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"database                          {result['database']} (n={n}, {args.concurrency} API clients)")
    print(f"approvals decided/s via API       {result['decided_per_s_api']:>10}")
    print(f"approvals decided/s in-process    {result['decided_per_s_library']:>10}")
    print(f"ratio API / in-process            {result['ratio_api_to_library']:>10}")
    print(f"timeouts swept/s by the sweeper   {result['timeouts_swept_per_s_server']:>10}")
    print(f"timeouts expired/s in-process     {result['timeouts_expired_per_s_library']:>10}")
    print(f"ratio sweeper / in-process        {result['ratio_sweeper_to_library']:>10}")
    print(f"ratio swept / decided (API)       {result['ratio_swept_to_decided_api']:>10}")


if __name__ == "__main__":
    main()
