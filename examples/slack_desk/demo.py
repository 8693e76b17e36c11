"""An agent wires money; the request is posted to Slack; a person clicks Approve (or Reject) there; the message is
updated in place; the agent's re-issued call runs (or its session is halted).

Everything is real but Slack itself: the desk (uvicorn on loopback), the official ``slack_sdk`` client, Slack's
signing scheme for the click. Slack's Web API is the local stand-in in ``standin.py``.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from undolog_core import ApprovalPending, ToolTier, UndoLog, errors, undolog_tool
from undolog_server import create_app
from undolog_server.slack import SlackConfig
from undolog_server.state import ServerSettings
from undolog_server.storage import ServerStore

from .standin import SIGNING_SECRET, TEAM, TOKEN, SlackStandIn, block_action, signed

WIRED: list[dict[str, Any]] = []


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Moves money out of the company account", risk_tags=["billing"])
def wire_money(to: str, amount: float, memo: str = "") -> dict[str, Any]:
    """Wire money to a vendor."""
    WIRED.append({"to": to, "amount": amount})
    return {"wired": amount, "to": to}


def _serve(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def _show(title: str, blocks: list[dict[str, Any]]) -> None:
    print(f"--- {title}")
    for b in blocks:
        text = b.get("text")
        if isinstance(text, dict):
            print("   ", text["text"].replace("\n", "\n    "))
        for f in b.get("fields") or []:
            print("   ", f["text"].replace("\n", ": "))
        for e in b.get("elements") or []:
            label = e.get("text")
            print("    [" + label["text"] + "]" if isinstance(label, dict) else "    " + e.get("text", ""))


def main(*, reject: bool = False, db_path: str | None = None) -> int:
    folder = Path(db_path).parent if db_path else Path(tempfile.mkdtemp(prefix="undolog-slack-"))
    url = f"sqlite:///{db_path or folder / 'undolog.db'}"
    standin = SlackStandIn().start()
    undolog = UndoLog.open(url)
    undolog.register(wire_money)
    config = SlackConfig(bot_token=TOKEN, signing_secret=SIGNING_SECRET, team_id=TEAM, api_url=standin.api_url,
                         response_url_prefixes=(standin.url + "/response/",), update_now=False)
    app = create_app(undolog, settings=ServerSettings(background=False, slack=config))
    desk_url, server, thread = _serve(app)
    try:
        store = ServerStore(undolog.store)
        _, admin = store.create_key("ops", ["admin"])
        ana, _ = store.create_key("ana", ["approver"], ["finance"])
        agent, _ = store.create_key("billing-bot", ["agent"])
        ops = httpx.Client(base_url=desk_url, headers={"Authorization": f"Bearer {admin}"})
        # The admin's set-up: a group, its channel (the memo is not for Slack), and ana's Slack account.
        ops.put("/v1/approver-groups/finance", json={"tools": ["wire_money"]}).raise_for_status()
        ops.put("/v1/slack/channels/finance", json={"channel": "C0FINANCE", "sensitive": ["memo"]}).raise_for_status()
        ops.put(f"/v1/slack/users/{TEAM}/U0ANA", json={"key_id": ana.key_id}).raise_for_status()
        print("admin: group 'finance' posts to #C0FINANCE; Slack user U0ANA decides as", ana.identity)

        session = undolog.session(agent_id="billing-bot", created_by=agent.principal_ref)
        with session:
            try:
                session.call_sync("wire_money", to="Globex <!channel>", amount=1200.0, memo="acct 0042", call_id="w1")
            except ApprovalPending as pending:
                rid = pending.approval_request_id
                print(f"agent: wire_money is waiting for approval ({rid})")
            sweeper = app.state.sweeper
            sweeper.tick()  # the outbox event becomes a post; the post is sent
            [post] = standin.of("chat.postMessage")
            _show("Slack #C0FINANCE: the message", post.args["blocks"])
            value = json.dumps({"r": rid, "d": undolog.approvals.get(rid).action_digest})
            payload = block_action(standin, "reject" if reject else "approve", value, channel="C0FINANCE")
            body, headers = signed(payload)
            answer = httpx.post(f"{desk_url}/v1/slack/interactivity", content=body, headers=headers).json()
            print(f"ana clicks {'Reject' if reject else 'Approve'} in Slack: desk answers {answer['text']!r}")
            sweeper.tick()  # the decision's outbox event: the message is updated in place
            [update] = standin.of("chat.update")
            _show("Slack #C0FINANCE: the same message, updated", update.args["blocks"])
            try:
                result = session.call_sync("wire_money", to="Globex <!channel>", amount=1200.0, memo="acct 0042",
                                           call_id="w1")
                print("agent: re-issued the call; the tool ran:", result)
            except errors.UndoLogError as exc:
                print(f"agent: re-issued the call; refused: {exc.code}")
        state = undolog.sessions.get(session.id).state
        print(f"session {session.id}: {state}; money wired: {WIRED}")
        return 0
    finally:
        server.should_exit = True
        thread.join(10)
        standin.stop()
        undolog.close()
