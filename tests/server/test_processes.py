"""Real server processes: `keys create`, `serve`, and two servers sharing one database's timeouts."""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from undolog_core import ApprovalPending
from undolog_core.storage import schema as core
from undolog_core.testing import internals
from undolog_server.storage import ServerStore

from ..support import demo_app
from ..support.receiver import Receiver

HERE = Path(__file__).resolve().parent


def _env(db: Any) -> dict[str, str]:
    env = {**os.environ, **db.env}
    # --app imports demo_app as a top-level module from tests/support.
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "support"), str(HERE.parents[1]),
                                         env.get("PYTHONPATH", "")])
    return env


def _cli(db: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "undolog_server", *args], env=_env(db), capture_output=True,
                          text=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(db: Any, log: Path, *extra: str, cli: list[str] | None = None,
           app: str = "demo_app:register") -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    with open(log, "wb") as fh:  # a file, not a pipe: an unread pipe would stall a chatty server
        proc = subprocess.Popen(
            [*(cli or [sys.executable, "-m", "undolog_server"]), "serve", "--port", str(port),
             "--log-level", "warning", "--app", app, "--webhook-allow-private", *extra],
            env=_env(db), stdout=subprocess.DEVNULL, stderr=fh,
        )
    return proc, f"http://127.0.0.1:{port}"


def _wait_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/v1/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"server did not come up: {log.read_text()}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_keys_create_prints_the_key_once(db: Any) -> None:
    r = _cli(db, "keys", "create", "--role", "approver", "--name", "ana", "--group", "billing")
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token.startswith("ulk_") and "shown only now" in r.stderr
    u = db.open()
    key = ServerStore(u.store).authenticate(token)
    assert key is not None and key.name == "ana" and key.roles == {"approver"} and key.groups == {"billing"}
    listed = _cli(db, "keys", "list")
    assert "ana" in listed.stdout and token.split("_", 2)[2] not in listed.stdout
    bad = _cli(db, "keys", "create", "--role", "root", "--name", "x")
    assert bad.returncode == 2 and "roles" in bad.stderr


@pytest.mark.storage
def test_two_servers_handle_each_timeout_once(db: Any, tmp_path: Path) -> None:
    u = db.open()
    demo_app.register(u)
    store = ServerStore(u.store)
    store.migrate()  # the servers below would; the target is created before they start
    receiver = Receiver().start()
    target = store.create_target("audit", f"{receiver.url}/audit", event_types=["approval.timed_out"])
    receiver.secrets["/audit"] = target.secret
    u.policy.set(actor="test", approval_timeout_seconds=1)
    n = 40
    ids = []
    for i in range(n):
        s = u.session(agent_id=f"bot-{i}")
        try:
            s.call_sync("delete_user_account", user_id=f"u{i}", call_id="c")
        except ApprovalPending as p:
            ids.append(p.approval_request_id)
    time.sleep(1.1)  # every request is due before the servers start, so both race for all of them
    procs = []
    try:
        # Both start at once, so both sweepers race for the same due requests. A generous attempt deadline (30 s,
        # the default 5 s before): an attempt cut short by a loaded machine would be sent again, and the deliveries
        # are counted exactly below.
        for i in range(2):
            procs.append((*_spawn(db, tmp_path / f"server{i}.log", "--sweep-interval", "0.02", "--webhook-timeout", "30"),
                          tmp_path / f"server{i}.log"))
        for proc, url, log in procs:
            _wait_up(proc, url, log)
        receiver.wait(lambda: len(receiver.events("/audit")) >= n, timeout=60)
        time.sleep(1.0)  # a double delivery would arrive by now
        for rid in ids:
            assert u.approvals.get(rid).state == "timed_out"
        ev = core.approval_events
        ob = core.outbox
        with internals(u).sql_engine.connect() as conn:
            timeouts = collections.Counter(
                conn.execute(sa.select(ev.c.approval_request_id).where(ev.c.action == "timeout")).scalars()
            )
            announced = conn.execute(sa.select(ob.c.payload).where(ob.c.event_type == "approval.timed_out")).scalars()
            announced_ids = collections.Counter(p["approval_request_id"] for p in announced)
        assert timeouts == {rid: 1 for rid in ids}
        assert announced_ids == {rid: 1 for rid in ids}
        delivered = collections.Counter(g.body["data"]["approval_request_id"] for g in receiver.events("/audit"))
        assert delivered == {rid: 1 for rid in ids}
        assert all(g.signature_ok for g in receiver.events("/audit"))
        assert u.verify_audit().ok
    finally:
        for proc, _, _ in procs:
            _stop(proc)
        receiver.stop()


def test_undolog_serve_with_the_apps_own_undolog(db: Any, tmp_path: Path) -> None:
    """`undolog --db X serve --app module:factory`: the factory's UndoLog serves, so its compensations run."""
    u = db.open()
    demo_app.register(u)
    store = ServerStore(u.store)
    store.migrate()  # before the server starts
    _, token = store.create_key("ops", ["admin"])
    s = u.session(agent_id="bot")
    with s:
        s.call_sync("send_refund_email", user_id="u1", amount=3.0, call_id="m1")
    undolog_cli = str(Path(sys.executable).with_name("undolog"))
    log = tmp_path / "serve.log"
    proc, url = _spawn(db, log, cli=[undolog_cli, "--db", db.url], app="demo_app:make_undolog")
    try:
        _wait_up(proc, url, log)
        r = httpx.post(f"{url}/v1/sessions/{s.id}:rollback", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert [st["outcome"] for st in r.json()["steps"]] == ["compensated"]
    finally:
        _stop(proc)


@pytest.mark.storage
def test_approve_reject_and_modify_sent_at_once_to_three_servers(db: Any, tmp_path: Path) -> None:
    """Three `undolog serve` processes on one database, each sent approve, reject and modify of the same request at
    the same moment, then the agent's re-issue sent to all three at once: one decision wins (one audit event), the
    others are 409 ``approval_already_decided``, and the upstream is called at most once, with the winner's
    arguments."""
    from ..support.upstream import Upstream

    upstream = Upstream().start()
    cfg = tmp_path / "tools.toml"
    cfg.write_text(upstream.config())
    u = db.open()
    demo_app.register(u)
    store = ServerStore(u.store)
    store.migrate()
    agent = {"Authorization": f"Bearer {store.create_key('bot', ['agent'])[1]}"}
    approvers = [{"Authorization": f"Bearer {store.create_key(f'ana{i}', ['approver'])[1]}"} for i in range(3)]
    procs = [(*_spawn(db, tmp_path / f"s{i}.log", "--proxy-config", str(cfg)), tmp_path / f"s{i}.log") for i in range(3)]
    bodies = {"approve": {}, "reject": {"reason": "no"}, "modify": {"args": {"account": "acct-edited"}}}

    def at_once(calls: list[tuple[str, dict[str, Any], dict[str, str]]]) -> list[httpx.Response]:
        gate = threading.Barrier(len(calls))

        def one(call: tuple[str, dict[str, Any], dict[str, str]]) -> httpx.Response:
            gate.wait()
            return httpx.post(call[0], json=call[1], headers=call[2], timeout=60)

        with ThreadPoolExecutor(len(calls)) as pool:
            return list(pool.map(one, calls))

    try:
        for proc, url, log in procs:
            _wait_up(proc, url, log)
        urls = [url for _, url, _ in procs]
        winners = []
        for n in range(4):
            sid = httpx.post(f"{urls[0]}/v1/sessions", json={"agent_id": "a"}, headers=agent, timeout=30).json()["session_id"]
            invoke = f"/v1/sessions/{sid}/tools/close_account:invoke"
            call = ({"account": f"acct-{n}"}, {**agent, "Idempotency-Key": "k"})
            r = httpx.post(urls[n % 3] + invoke, json=call[0], headers=call[1], timeout=60)
            assert r.status_code == 202, r.text
            rid = r.json()["approval_request_id"]
            answers = at_once([(f"{url}/v1/approvals/{rid}:{action}", body, approvers[i])
                               for i, url in enumerate(urls) for action, body in bodies.items()])
            assert sorted(a.status_code for a in answers) == [200] + [409] * 8, [a.text[:200] for a in answers]
            assert {a.json()["code"] for a in answers if a.status_code == 409} == {"approval_already_decided"}
            won = next(a.json() for a in answers if a.status_code == 200)
            winners.append(won["state"])
            before = len(upstream.to("/close"))
            reissued = at_once([(url + invoke, *call) for url in urls])
            if won["state"] == "rejected":
                assert {a.json()["code"] for a in reissued} == {"approval_rejected"}
            else:
                # One runs it; another arriving meanwhile is told it is running, or gets the stored answer.
                assert [a.status_code for a in reissued].count(200) >= 1
                assert all(a.status_code == 200 or a.json()["code"] == "invalid_effect_state" for a in reissued)
                assert [b for b, _ in upstream.to("/close")[before:]] == [won["approved_args"] or won["proposed_args"]]
        assert len(upstream.to("/close")) == sum(w != "rejected" for w in winners)
        ev = core.approval_events
        with internals(u).sql_engine.connect() as conn:
            decisions = collections.Counter(conn.execute(
                sa.select(ev.c.approval_request_id).where(ev.c.action.in_(("approve", "reject", "modify")))).scalars())
        assert sorted(decisions.values()) == [1] * 4
        assert u.verify_audit().ok
    finally:
        for proc, _, _ in procs:
            _stop(proc)
        upstream.stop()
    for i in range(3):
        assert "Traceback" not in (tmp_path / f"s{i}.log").read_text()
