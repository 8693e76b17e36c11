"""Fixtures of the server tests: a real uvicorn server on loopback over the ``db`` fixture."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn

from undolog_core import ApprovalPending
from undolog_server import create_app
from undolog_server.state import ServerSettings
from undolog_server.storage import ApiKey, ServerStore

from ..support import demo_app


class LiveServer:
    """A uvicorn server in a thread, bound to a random loopback port."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@dataclass
class Desk:
    """A running approval desk with one key per role and helpers to make work for it."""

    undolog: Any
    server: LiveServer
    store: ServerStore
    keys: dict[str, tuple[ApiKey, str]] = field(default_factory=dict)
    clients: dict[str, httpx.Client] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def key(self, name: str) -> ApiKey:
        return self.keys[name][0]

    def token(self, name: str) -> str:
        return self.keys[name][1]

    def client(self, who: str | None) -> httpx.Client:
        """An HTTP client authenticated as ``who`` (a key name) or anonymous (None)."""
        name = who or "anonymous"
        if name not in self.clients:
            headers = {"Authorization": f"Bearer {self.token(who)}"} if who else {}
            self.clients[name] = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        return self.clients[name]

    def add_key(self, name: str, roles: list[str], groups: list[str] = ()) -> tuple[ApiKey, str]:
        self.keys[name] = self.store.create_key(name, roles, groups)
        return self.keys[name]

    def session(self, owner: str = "agent", agent_id: str = "bot") -> Any:
        return self.undolog.session(agent_id=agent_id, created_by=self.key(owner).principal_ref)

    def pending(self, tool: str = "delete_user_account", owner: str = "agent", **args: Any) -> tuple[str, str]:
        """Raise an approval request through the library; returns (approval_request_id, session_id)."""
        s = self.session(owner)
        args = args or ({"user_id": "u1"} if tool == "delete_user_account" else {"to": "acme", "amount": 10.0})
        with s:
            try:
                s.call_sync(tool, call_id="c-1", **args)
            except ApprovalPending as p:
                return p.approval_request_id, s.id
        raise AssertionError("expected an approval request")

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.server.stop()


def make_desk(db: Any, *, settings: ServerSettings | None = None, proxy_config: Any = None, **open_kw: Any) -> Desk:
    undolog = db.open(**open_kw)
    demo_app.register(undolog)
    app = create_app(
        undolog,
        proxy_config=proxy_config,
        settings=settings or ServerSettings(background=False),
    )
    server = LiveServer(app).start()
    desk = Desk(undolog, server, ServerStore(undolog.store))
    desk.add_key("admin", ["admin"])
    desk.add_key("approver", ["approver"])
    desk.add_key("agent", ["agent"])
    desk.add_key("agent2", ["agent"])
    return desk


@pytest.fixture
def desk(db: Any) -> Iterator[Desk]:
    d = make_desk(db)
    try:
        yield d
    finally:
        d.close()
        d.undolog.close()


def problem(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """Assert a problem+json response and return its body."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/problem+json"), resp.headers
    body = resp.json()
    assert body["status"] == status
    if code is not None:
        assert body["code"] == code, body
    assert body["type"].endswith(body["code"])
    return body
