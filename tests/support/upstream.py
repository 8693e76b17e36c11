"""A fake upstream tool server on loopback for the proxy tests."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    # socketserver's default backlog is 5: under the load test (30 agents, a new connection per upstream call, a
    # GIL-starved accept loop) the listen queue overflowed, a connection was reset, and the desk rightly answered
    # 504 for an upstream that did not answer. The upstream is not what the load test measures.
    request_queue_size = 1024
    daemon_threads = True


@dataclass
class Upstream:
    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    # (path, the UndoLog-Epoch header) of every call: the fencing token sent beside the key (issue 34).
    epochs: list[tuple[str, str | None]] = field(default_factory=list)
    fail: set[str] = field(default_factory=set)
    delay: dict[str, float] = field(default_factory=dict)
    # A call to one of these paths answers only once the test sets the event (a call held in flight).
    hold: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Upstream:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with outer.lock:
                    outer.calls.append((self.path, body, self.headers.get("Idempotency-Key")))
                    outer.epochs.append((self.path, self.headers.get("UndoLog-Epoch")))
                if self.path in outer.hold:
                    outer.hold[self.path].wait(30)
                if self.path in outer.delay:
                    import time

                    time.sleep(outer.delay[self.path])
                if self.path in outer.fail:
                    status, out = 500, {"error": "boom"}
                elif self.path == "/close/status":
                    account = body.get("args", {}).get("account")
                    if account == "vague":  # an answer that is neither yes nor no: the probe cannot tell
                        status, out = 200, {"status": "ok"}
                    elif account == "done":
                        status, out = 200, {"happened": True, "result": {"closed": True}}
                    else:
                        status, out = 404, {}
                else:
                    status, out = 200, {"ok": True, "path": self.path, "echo": body}
                raw = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def to(self, path: str) -> list[tuple[dict[str, Any], str | None]]:
        with self.lock:
            return [(b, k) for p, b, k in self.calls if p == path]

    def config(self) -> str:
        return f"""
[defaults]
timeout = 5

[tools.lookup_order]
tier = "safe"
url = "{self.url}/lookup"
[tools.lookup_order.args_schema]
type = "object"
required = ["order_id"]
properties = {{ order_id = {{ type = "string" }} }}

[tools.refund]
tier = "compensable"
url = "{self.url}/refund"
compensation_url = "{self.url}/refund/cancel"
risk_tags = ["billing"]
[tools.refund.args_schema]
type = "object"
required = ["order_id", "amount"]
properties = {{ order_id = {{ type = "string" }}, amount = {{ type = "number" }} }}

[tools.close_account]
tier = "irreversible"
url = "{self.url}/close"
reason = "Closes the customer's account for good"
probe_url = "{self.url}/close/status"
risk_tags = ["pii"]
[tools.close_account.args_schema]
type = "object"
required = ["account"]
properties = {{ account = {{ type = "string" }}, notify = {{ type = "boolean" }} }}

[tools.flaky]
tier = "compensable"
url = "{self.url}/flaky"
compensation_url = "{self.url}/flaky/cancel"
"""
