"""A webhook receiver on loopback that checks signatures and can fail or stall on purpose."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from undolog_core.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, verify_signature


@dataclass
class Received:
    path: str
    event_type: str
    delivery_id: str
    body: dict[str, Any]
    signature_ok: bool
    answered: int


@dataclass
class Receiver:
    """Records every POST; ``fail_first[path]`` answers 500 that many times first; ``delay`` (every path) or
    ``delays[path]`` stalls; ``gates[path]`` holds a request until the test sets the event (at most a minute);
    ``arrived`` lists paths as requests come in, before any stall."""

    secrets: dict[str, str] = field(default_factory=dict)
    fail_first: dict[str, int] = field(default_factory=dict)
    delay: float = 0.0
    delays: dict[str, float] = field(default_factory=dict)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    arrived: list[str] = field(default_factory=list)
    got: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Receiver:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.lock:
                    outer.arrived.append(self.path)
                if outer.delay or self.path in outer.delays:
                    time.sleep(outer.delays.get(self.path, outer.delay))
                if self.path in outer.gates:
                    outer.gates[self.path].wait(60)
                secret = outer.secrets.get(self.path, "")
                ok = verify_signature(secret, self.headers.get(SIGNATURE_HEADER, ""), raw,
                                      delivery_id=self.headers.get(DELIVERY_HEADER, ""))
                with outer.lock:
                    left = outer.fail_first.get(self.path, 0)
                    status = 500 if left > 0 else 200
                    if left > 0:
                        outer.fail_first[self.path] = left - 1
                    outer.got.append(Received(self.path, self.headers.get("UndoLog-Event", ""),
                                              self.headers.get("UndoLog-Delivery", ""), json.loads(raw), ok, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def events(self, path: str | None = None, *, delivered: bool = True) -> list[Received]:
        with self.lock:
            return [g for g in self.got if (path is None or g.path == path) and (not delivered or g.answered == 200)]

    def wait(self, pred: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.02)
        raise AssertionError(f"receiver did not see the expected events; got {[(g.path, g.event_type) for g in self.got]}")
