"""Issue #29, part 1: one identity for a principal across the desk and the gateway.

A key holding the agent role raises an IRREVERSIBLE request through the real ``undolog mcp serve --http`` with the
official MCP SDK client, then tries to decide it itself through the REST API, the dashboard and the CLI. Whatever
its other roles (approver, admin; with and without approver groups), every attempt is refused and each refusal of
a key that could decide is in the audit trail; another approver's decision then lets the call run. Before the fix
the gateway stored the owner as ``"<name> (key <id>)"`` and the desk compared ``"key:<id>"``: an agent+approver key
approved its own request (200) and the call ran.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from mcp import ClientSession, types
from mcp.client.streamable_http import streamablehttp_client

from undolog_core.storage import migrate as _migrate
from undolog_core.storage.base import _MIGRATION_LOCK_KEY, Store
from undolog_server.identity import ApproverGroup, key_id_of, legacy_owner_key_id, principal_ref

from ..server.conftest import make_desk, problem
from .http_gateway import http_gateway
from .test_gateway import text, world, write_config

pytestmark = pytest.mark.reads_store

AGENT_COMBOS = [frozenset({"agent", *more}) for n in range(3)
                for more in itertools.combinations(("approver", "admin"), n)]


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert m, html[:500]
    return m.group(1)


def _cli(db: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **db.env}
    return subprocess.run([sys.executable, "-m", "undolog_core.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@contextlib.asynccontextmanager
async def _client(url: str, token: str) -> AsyncIterator[ClientSession]:
    async with streamablehttp_client(url, headers={"Authorization": f"Bearer {token}"}) as (r, w, _):
        async with ClientSession(r, w, client_info=types.Implementation(name="remote", version="1")) as client:
            await client.initialize()
            yield client


def _refusals(desk: Any, rid: str) -> list[Any]:
    return [e for e in desk.undolog.approvals.events(rid) if e.action == "refused"]


async def _decide_own(desk: Any, db: Any, client: ClientSession, key: Any, token: str, roles: frozenset[str],
                     project: str) -> None:
    """The key raises a request through its MCP session, fails to decide it at every door, then another
    approver approves it and the same MCP session's re-ask runs it."""
    first = await client.call_tool("delete_project", {"name": project})
    assert not first.isError and "approv" in text(first).lower(), text(first)
    (req,) = [r for r in desk.undolog.approvals.pending() if r.proposed_args == {"name": project}]
    rid = req.approval_request_id
    session = desk.undolog.sessions.get(req.session_id)
    assert session.created_by == principal_ref(key.key_id) == key.principal_ref

    api = httpx.Client(base_url=desk.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    decider = bool(roles & {"approver", "admin"})
    want = "self_approval_forbidden" if decider else "role_forbidden"
    problem(api.post(f"/v1/approvals/{rid}:approve", json={}), 403, want)
    problem(api.post(f"/v1/approvals/{rid}:modify", json={"args": {"name": "x"}}), 403, want)
    problem(api.post(f"/v1/approvals/{rid}:reject", json={"reason": "mine"}), 403, want)

    ui = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)
    page = ui.get("/ui/login")
    login = ui.post("/ui/login", data={"api_key": token, "csrf_token": _csrf(page.text)})
    if decider:
        assert login.status_code == 303, login.text
        form = _csrf(ui.get(f"/ui/approvals/{rid}").text)
        for action in ("approve", "modify", "reject"):
            data = {"csrf_token": form, "reason": "mine", "args": '{"name": "x"}'}
            assert ui.post(f"/ui/approvals/{rid}/{action}", data=data).status_code == 403
    else:
        assert login.status_code == 403  # an agent-only key does not log in to the desk at all

    cli = _cli(db, "approvals", "approve", rid, "--as", key.principal_ref)
    assert cli.returncode != 0 and "another person must decide it" in cli.stderr, cli.stdout + cli.stderr

    assert desk.undolog.approvals.get(rid).state.value == "pending"
    refused = _refusals(desk, rid)
    # REST x3 and dashboard x3 for a key that may decide at all; the CLI's for every key.
    assert len(refused) == (7 if decider else 1), [(e.actor, e.payload) for e in refused]
    assert {e.payload["principal"] for e in refused} == {key.principal_ref}
    assert {e.payload["attempted"] for e in refused} == {"approve", "modify", "reject"} if decider \
        else {"approve"}
    api.close()
    ui.close()

    assert desk.client("other").post(f"/v1/approvals/{rid}:approve", json={}).status_code == 200
    second = await client.call_tool("delete_project", {"name": project})
    assert not second.isError and "deleted" in text(second), text(second)


# A hang guard: 65-69 s on a slow CI host against the suite-wide 120 s.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("with_groups", [False, True], ids=["no-groups", "approver-groups"])
async def test_no_key_decides_what_it_raised_through_the_gateway(db: Any, tmp_path: Path, with_groups: bool) -> None:
    cfg = write_config(tmp_path)
    desk = make_desk(db)
    try:
        groups = ["ops"] if with_groups else []
        if with_groups:
            desk.store.put_group(ApproverGroup("ops", tools=("delete_project",)))
        desk.add_key("other", ["approver"], groups)
        with http_gateway(db, cfg) as url:
            for n, roles in enumerate(AGENT_COMBOS):
                name = "k" + "-".join(sorted(roles))
                key, token = desk.add_key(name, sorted(roles), groups)
                project = f"p{n}"
                async with _client(url, token) as client:
                    await _decide_own(desk, db, client, key, token, roles, project)
        assert desk.undolog.verify_audit().ok
        ran = [c for c in world(tmp_path)["calls"] if c["tool"] == "delete_project"]
        assert len(ran) == len(AGENT_COMBOS)
    finally:
        desk.close()


def test_sessions_stored_in_the_old_owner_form_are_rewritten_and_refused(db: Any) -> None:
    """A database made by the previous release (at 0011, a gateway session owned as "<name> (key <id>)") upgrades
    to the ``key:<id>`` form; the key that raised its request may then not approve it."""
    desk_db = db
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0011_due_index")
    finally:
        store.dispose()
    desk = make_desk(desk_db)
    try:
        key, token = desk.add_key("bot (ops)", ["agent", "approver"])
        rid, sid = desk.pending(owner="bot (ops)")
        legacy = f"{key.name} (key {key.key_id})"
        assert legacy_owner_key_id(legacy) == key.key_id and key_id_of(legacy) is None
        with desk.undolog.store.engine.begin() as c:
            c.execute(sa.text("UPDATE undolog_sessions SET created_by = :o WHERE session_id = :s"),
                      {"o": legacy, "s": sid})
            # Back to the previous release's revision: the newer ones (idempotent) run again on the next open.
            c.execute(sa.text("UPDATE undolog_alembic_version SET version_num = '0011_due_index'"))
        # The old form is what the desk never compared: with it stored, the hole is open.
        api = httpx.Client(base_url=desk.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        s2 = Store(db.url, schema=db.schema)
        try:
            _migrate.upgrade(s2.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema)
            _migrate.upgrade(s2.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="heads")  # idempotent
            with s2.engine.connect() as c:
                owners = dict(c.execute(sa.text("SELECT session_id, created_by FROM undolog_sessions")).all())
        finally:
            s2.dispose()
        assert owners[sid] == f"key:{key.key_id}"
        assert legacy_owner_key_id("someone (key not-hex)") is None  # not the old gateway form: left alone
        problem(api.post(f"/v1/approvals/{rid}:approve", json={}), 403, "self_approval_forbidden")
        assert [e.payload["principal"] for e in _refusals(desk, rid)] == [key.principal_ref]
        api.close()
    finally:
        desk.close()
