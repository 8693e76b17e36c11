"""Undo in the process that did the work, asked from the desk: a rollback asked through the REST API, or with the
dashboard's Rollback button, while a long-lived gateway (``undolog mcp serve --socket``) serves the session is run
by that gateway, over its live connection to an upstream whose state lives in its own memory (the SDK); the
answer names the process that ran it (``ran_by``). With the gateway gone, the desk runs it itself and says so
(``ran_without_live_upstream``). Real processes: the gateway, its upstream, ``undolog mcp connect`` for each
client; the desk is uvicorn serving the real app. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import html
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from undolog_core import SessionState
from undolog_server import create_app
from undolog_server.state import ServerSettings
from undolog_server.storage import ServerStore

from ..server.conftest import LiveServer
from .test_live_rollback import held, listed, memory_config, upstream_processes
from .test_sessions import connected, session_of, socket_gateway

pytestmark = pytest.mark.reads_store


class RealDesk:
    """The desk's app (REST API and dashboard) on uvicorn, loading the gateway's config as its ``--app``."""

    def __init__(self, db: Any, cfg: Path) -> None:
        self.undolog = db.open()
        app = create_app(self.undolog, app_spec=str(cfg), settings=ServerSettings(background=False))
        self.server = LiveServer(app).start()
        _, self.token = ServerStore(self.undolog.store).create_key("ops", ["admin"], ())
        self.api = httpx.Client(base_url=self.server.url, headers={"Authorization": f"Bearer {self.token}"},
                                timeout=60)

    def browser(self) -> httpx.Client:
        """A dashboard user logged in with the admin key (as a person at the desk is)."""
        c = httpx.Client(base_url=self.server.url, timeout=60, follow_redirects=True)
        page = c.get("/ui/login").text
        r = c.post("/ui/login", data={"api_key": self.token, "csrf_token": csrf(page)})
        assert r.status_code == 200, r.text
        return c

    def close(self) -> None:
        self.api.close()
        self.server.stop()
        self.undolog.close()


def csrf(page: str) -> str:
    m = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page)
    assert m is not None, page
    return m.group(1)


@pytest.fixture
def live(db: Any, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    cfg = memory_config(tmp_path)
    cfg.write_text('session = "process"\n' + cfg.read_text())
    db.open()  # the schema, before the desk and the gateway start
    yield cfg, tmp_path / "gw.sock"


async def test_the_desks_rollback_runs_in_the_gateway_over_its_live_upstream(
        db: Any, live: tuple[Path, Path]) -> None:
    cfg, sock = live
    with socket_gateway(db, cfg, sock) as gateway:
        desk = RealDesk(db, cfg)
        try:
            # Two short client connections, one process session (as a client that opens a session per call).
            async with connected(db, sock) as client:
                first = await client.call_tool("add_item", {"name": "a"})
            async with connected(db, sock) as client:
                await client.call_tool("add_item", {"name": "b"})
                before = listed(await client.call_tool("list_items", {}))
            assert before["items"] == ["a", "b"]
            sid = session_of(first)
            owner = held(desk.undolog, sid).owner

            # The REST API: its answer says who ran it; nothing says it ran without the live upstream.
            r = desk.api.post(f"/v1/sessions/{sid}:rollback")
            assert r.status_code == 200, r.text
            report = r.json()
            assert report["complete"] and report["ran_by"] == owner, report
            assert report["ran_without_live_upstream"] is False
            assert [s["outcome"] for s in report["steps"]] == ["compensated", "compensated"]
            async with connected(db, sock) as client:
                after = listed(await client.call_tool("list_items", {}))
                # The live state is restored in the one upstream process that did the work.
                assert after == {"items": [], "pid": before["pid"]}
                made = await client.call_tool("add_item", {"name": "c"})  # the grouping goes on in a new session
                second = session_of(made)
                assert second != sid
            assert desk.undolog.sessions.get(sid).state == SessionState.ROLLED_BACK

            # The dashboard's Rollback button, on the new session: the same, in the same upstream process.
            browser = desk.browser()
            page = browser.get(f"/ui/sessions/{second}")
            assert page.status_code == 200 and 'id="rollback"' in page.text
            shown = browser.post(f"/ui/sessions/{second}/rollback", data={"csrf_token": csrf(page.text)})
            assert shown.status_code == 200, shown.text
            said = html.unescape(shown.text)
            assert "Rollback complete" in said and 'id="rollback-ran-by"' in said and owner in said
            assert 'id="rollback-without-live-upstream"' not in said
            async with connected(db, sock) as client:
                assert listed(await client.call_tool("list_items", {})) == {"items": [], "pid": before["pid"]}
            assert desk.undolog.sessions.get(second).state == SessionState.ROLLED_BACK
            assert upstream_processes(sock.parent / "memory_server.py") == [before["pid"]]
            assert gateway.poll() is None
        finally:
            desk.close()


async def test_with_the_gateway_gone_the_desk_runs_it_and_says_so(db: Any, live: tuple[Path, Path]) -> None:
    cfg, sock = live
    with socket_gateway(db, cfg, sock) as gateway:
        desk = RealDesk(db, cfg)
        try:
            async with connected(db, sock) as client:
                made = await client.call_tool("add_item", {"name": "a"})
            sid = session_of(made)
            held(desk.undolog, sid)
            os.kill(gateway.pid, signal.SIGKILL)  # the gateway dies; its upstream's memory with it
            gateway.wait(timeout=60)
            r = desk.api.post(f"/v1/sessions/{sid}:rollback")
            assert r.status_code == 200, r.text
            report = r.json()
            assert report["complete"] and report["ran_without_live_upstream"] is True and report["ran_by"] is None
            assert desk.undolog.sessions.get(sid).state == SessionState.ROLLED_BACK
        finally:
            desk.close()
