"""A local HTTP server standing in for Slack's Web API, for the real ``slack_sdk`` client to talk to.

It records ``chat.postMessage``, ``chat.update``, ``views.open`` and ``conversations.history`` (and what is POSTed
to a ``response_url``) and answers with the shapes Slack documents: ``{"ok": true, ...}``, ``{"ok": false, "error":
...}``, and for a rate limit HTTP 429 with ``Retry-After`` and ``{"ok": false, "error": "ratelimited"}``. Channels
keep their messages (with ``metadata``, returned by ``conversations.history`` only with ``include_all_metadata``).

Also signs interactivity payloads as Slack does (``v0=`` HMAC-SHA256 of ``v0:<timestamp>:<body>``).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from undolog_server.slack import sign_request

TOKEN = "xoxb-standin-token"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TEAM = "T0UNDOLOG"


@dataclass
class Call:
    method: str
    args: dict[str, Any]


@dataclass
class SlackStandIn:
    """The stand-in's state: what was called, the channels' messages, the answers to inject."""

    calls: list[Call] = field(default_factory=list)
    channels: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    responses: list[dict[str, Any]] = field(default_factory=list)
    #: method -> Retry-After seconds of the next call's 429 answer.
    ratelimit: dict[str, int] = field(default_factory=dict)
    #: method -> an Event the handler waits on before answering (a client killed while it waits).
    hold: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _ts: Any = field(default_factory=lambda: itertools.count(1))
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def api_url(self) -> str:
        return self.url + "/api/"

    def of(self, method: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method]

    def add_message(self, channel: str, text: str, metadata: dict[str, Any] | None = None) -> str:
        with self.lock:
            ts = f"{int(time.time())}.{next(self._ts):06d}"
            self.channels.setdefault(channel, []).append({"type": "message", "ts": ts, "text": text,
                                                          "blocks": [], "metadata": metadata})
            return ts

    def message(self, channel: str, ts: str) -> dict[str, Any]:
        with self.lock:
            return next(m for m in self.channels.get(channel, []) if m["ts"] == ts)

    # ---- the API ----------------------------------------------------------------------------------

    def answer(self, method: str, args: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self.lock:
            self.calls.append(Call(method, args))
            retry = self.ratelimit.pop(method, None)
        if retry is not None:
            return 429, {"ok": False, "error": "ratelimited"}, {"Retry-After": str(retry)}
        if method == "chat.postMessage":
            channel = args["channel"]
            with self.lock:
                ts = f"{int(time.time())}.{next(self._ts):06d}"
                msg = {"type": "message", "ts": ts, "text": args.get("text"), "blocks": args.get("blocks") or [],
                       "metadata": args.get("metadata"), "bot_id": "B0STANDIN"}
                self.channels.setdefault(channel, []).append(msg)
            return 200, {"ok": True, "channel": channel, "ts": ts, "message": msg}, {}
        if method == "chat.update":
            with self.lock:
                for m in self.channels.get(args["channel"], []):
                    if m["ts"] == args["ts"]:
                        m.update(text=args.get("text"), blocks=args.get("blocks") or [], edited=True)
                        return 200, {"ok": True, "channel": args["channel"], "ts": args["ts"],
                                     "text": args.get("text")}, {}
            return 200, {"ok": False, "error": "message_not_found"}, {}
        if method == "views.open":
            if not args.get("trigger_id"):
                return 200, {"ok": False, "error": "invalid_trigger_id"}, {}
            return 200, {"ok": True, "view": {"id": "V0STANDIN", **(args.get("view") or {})}}, {}
        if method == "conversations.history":
            with self.lock:
                msgs = list(reversed(self.channels.get(args.get("channel", ""), [])))
            if str(args.get("include_all_metadata")).lower() not in ("true", "1"):
                msgs = [{k: v for k, v in m.items() if k != "metadata"} for m in msgs]
            limit = int(args.get("limit") or 100)
            return 200, {"ok": True, "messages": msgs[:limit], "has_more": len(msgs) > limit,
                         "response_metadata": {"next_cursor": ""}}, {}
        return 200, {"ok": False, "error": "unknown_method"}, {}

    def start(self) -> SlackStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, status: int, body: Any, headers: dict[str, str]) -> None:
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _args(self) -> dict[str, Any]:
                parsed = urllib.parse.urlsplit(self.path)
                args: dict[str, Any] = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                ctype = self.headers.get("Content-Type", "")
                if raw and ctype.startswith("application/json"):
                    args.update(json.loads(raw))
                elif raw:
                    for k, v in urllib.parse.parse_qs(raw.decode()).items():
                        val: Any = v[-1]
                        if k in ("blocks", "metadata", "view"):
                            val = json.loads(val)
                        args[k] = val
                return args

            def _handle(self) -> None:
                path = urllib.parse.urlsplit(self.path).path
                args = self._args()
                if path.startswith("/response/"):
                    with standin.lock:
                        standin.responses.append({"path": path, **args})
                    self._send(200, b"ok", {})
                    return
                if not path.startswith("/api/"):
                    self._send(404, {"ok": False, "error": "not_found"}, {})
                    return
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._send(200, {"ok": False, "error": "invalid_auth"}, {})
                    return
                method = path[len("/api/"):]
                held = standin.hold.get(method)
                status, body, headers = standin.answer(method, args)
                if held is not None:
                    held.wait(60)
                self._send(status, body, headers)

            do_GET = _handle
            do_POST = _handle

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        for ev in self.hold.values():
            ev.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed while it waited for its answer (the crash tests) is what is being tested, not an error.
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def signed(payload: dict[str, Any], *, secret: str = SIGNING_SECRET, timestamp: int | None = None) -> tuple[bytes, dict[str, str]]:
    """An interactivity request as Slack sends it: the form-encoded ``payload`` and its signature headers."""
    body = urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()
    ts = int(time.time()) if timestamp is None else timestamp
    return body, {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": str(ts),
        "X-Slack-Signature": sign_request(secret, ts, body),
    }


def block_action(standin: SlackStandIn, action: str, value: str, *, user: str = "U0ANA", team: str = TEAM,
                 channel: str = "C0FIN", ts: str = "1.000001") -> dict[str, Any]:
    """A ``block_actions`` payload for one of the message's buttons, as Slack documents it."""
    return {
        "type": "block_actions",
        "team": {"id": team, "domain": "undolog"},
        "user": {"id": user, "username": user.lower(), "team_id": team},
        "api_app_id": "A0UNDOLOG",
        "trigger_id": f"{int(time.time())}.trigger.{user}",
        "container": {"type": "message", "message_ts": ts, "channel_id": channel, "is_ephemeral": False},
        "channel": {"id": channel, "name": "approvals"},
        "response_url": f"{standin.url}/response/{user}",
        "actions": [{"type": "button", "action_id": f"undolog_{action}", "block_id": "undolog_decide",
                     "value": value, "action_ts": str(time.time())}],
    }


def view_submission(view: dict[str, Any], values: dict[str, dict[str, Any]], *, user: str = "U0ANA",
                    team: str = TEAM) -> dict[str, Any]:
    """A ``view_submission`` payload of a modal the desk opened, with ``values`` as ``view.state.values``."""
    return {
        "type": "view_submission",
        "team": {"id": team, "domain": "undolog"},
        "user": {"id": user, "username": user.lower(), "team_id": team},
        "api_app_id": "A0UNDOLOG",
        "trigger_id": f"{int(time.time())}.trigger.{user}",
        "view": {**view, "id": "V0STANDIN", "state": {"values": values}},
    }
