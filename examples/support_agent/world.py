"""The outside world of the support agent: an email outbox and an account store in one SQLite file.

Only this module is fake. It keeps real state on disk, so a second process (or a test) sees what
the agent did, and it behaves like the systems it stands for in the one way that matters here:
an email sits in the outbox for ``delivery_delay`` seconds before it is delivered, and can be
recalled only while it sits there. That delay is what makes an email COMPENSABLE at all; after
delivery the recall fails, and UndoLog reports that honestly instead of pretending it undid it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    user_id TEXT PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'active', deleted_at REAL
);
CREATE TABLE IF NOT EXISTS orders (
    order_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, total REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    message_id TEXT PRIMARY KEY, idempotency_key TEXT UNIQUE, user_id TEXT NOT NULL, to_addr TEXT NOT NULL,
    subject TEXT NOT NULL, body TEXT NOT NULL, amount REAL NOT NULL, order_id TEXT NOT NULL,
    queued_at REAL NOT NULL, deliver_at REAL NOT NULL, status TEXT NOT NULL, recalled_at REAL
);
CREATE TABLE IF NOT EXISTS operations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, args TEXT NOT NULL, outcome TEXT NOT NULL, at REAL NOT NULL
);
"""

KNOWLEDGE_BASE = [
    {
        "id": "kb-12",
        "title": "Refunds for damaged items",
        "text": "Damaged items are refunded in full to the original payment method; send the customer a "
        "refund confirmation email.",
    },
    {
        "id": "kb-31",
        "title": "Account deletion (GDPR erasure)",
        "text": "Deleting an account erases every record of the customer and cannot be undone; it needs a "
        "supervisor's approval.",
    },
    {
        "id": "kb-07",
        "title": "Refund limits",
        "text": "A refund can never exceed the order total.",
    },
]

SEED_ACCOUNTS = [
    ("u-1042", "Dana Ortiz", "dana@example.com"),
    ("u-2002", "Sam Lee", "sam@example.com"),
    ("u-3003", "Ravi Patel", "ravi@example.com"),
]
SEED_ORDERS = [
    ("A-1042", "u-1042", 42.50),
    ("B-7", "u-2002", 19.00),
    ("B-8", "u-2002", 25.00),
    ("B-9", "u-2002", 90.00),
    ("C-1", "u-3003", 12.00),
]


class WorldError(Exception):
    """A refusal by the outside world (unknown account, refund over the order total...)."""


class TooLateToRecall(WorldError):
    """The email has already been delivered: nothing can take it back."""


@dataclass(frozen=True)
class Email:
    message_id: str
    user_id: str
    to_addr: str
    subject: str
    amount: float
    order_id: str
    status: str  # queued | delivered | recalled
    deliver_at: float


class SupportWorld:
    """Email outbox plus account store, persisted in one SQLite file.

    Args:
        path: the SQLite file; created and seeded if new.
        delivery_delay: seconds an email waits in the outbox before delivery.
        clock: time source, ``time.time`` unless a test wants another.

    Example:
        >>> world = SupportWorld("/tmp/support_world.sqlite", delivery_delay=5.0)  # doctest: +SKIP
        >>> msg = world.send_refund_email("u-1042", 42.5, "A-1042")                  # doctest: +SKIP
        >>> world.recall(msg["message_id"])["status"]                               # doctest: +SKIP
        'recalled'
    """

    def __init__(self, path: str | Path, *, delivery_delay: float = 5.0, clock: Callable[[], float] = time.time):
        self.path = str(path)
        self.delivery_delay = float(delivery_delay)
        self.clock = clock
        self._lock = threading.Lock()
        with self._conn() as c:
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                c.execute(stmt)
            if c.execute("SELECT COUNT(*) FROM accounts").fetchone()[0] == 0:
                c.executemany("INSERT INTO accounts (user_id, name, email) VALUES (?, ?, ?)", SEED_ACCOUNTS)
                c.executemany("INSERT INTO orders VALUES (?, ?, ?)", SEED_ORDERS)

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        # A connection per operation: tools run on LangGraph's worker threads and in other processes.
        with self._lock:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            conn.row_factory = sqlite3.Row
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            finally:
                conn.close()

    def _settle(self, c: sqlite3.Connection) -> None:
        """Deliver every queued email whose delay has passed (delivery is computed, not scheduled)."""
        c.execute("UPDATE outbox SET status = 'delivered' WHERE status = 'queued' AND deliver_at <= ?", (self.clock(),))

    def _log(self, c: sqlite3.Connection, op: str, args: dict[str, Any], outcome: str) -> None:
        c.execute(
            "INSERT INTO operations (op, args, outcome, at) VALUES (?, ?, ?, ?)",
            (op, json.dumps(args, sort_keys=True), outcome, self.clock()),
        )

    # -- the three systems the tools talk to -------------------------------------------------------

    def search(self, query: str) -> list[dict[str, str]]:
        words = {w.strip(".,?!").lower() for w in query.split() if len(w) > 3}
        hits = [a for a in KNOWLEDGE_BASE if words & set((a["title"] + " " + a["text"]).lower().split())]
        with self._conn() as c:
            self._log(c, "search", {"query": query}, f"{len(hits)} hits")
        return [{"id": a["id"], "title": a["title"], "text": a["text"]} for a in hits]

    def send_refund_email(
        self, user_id: str, amount: float, order_id: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Queue a refund confirmation. The same ``idempotency_key`` never queues a second email."""
        args = {"user_id": user_id, "amount": amount, "order_id": order_id}
        with self._conn() as c:
            self._settle(c)
            if idempotency_key:
                row = c.execute("SELECT * FROM outbox WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
                if row is not None:
                    return self._email_dict(row)
            acct = c.execute("SELECT * FROM accounts WHERE user_id = ?", (user_id,)).fetchone()
            order = c.execute("SELECT * FROM orders WHERE order_id = ?", (order_id,)).fetchone()
            problem = None
            if acct is None or acct["status"] != "active":
                problem = f"no active account {user_id!r}"
            elif order is None or order["user_id"] != user_id:
                problem = f"order {order_id!r} does not belong to {user_id!r}"
            elif amount > order["total"] + 1e-9:
                problem = f"refund of ${amount:.2f} exceeds the total of order {order_id} (${order['total']:.2f})"
            if problem:
                self._log(c, "send_refund_email", args, "refused: " + problem)
            else:
                now = self.clock()
                message_id = "m-" + uuid.uuid4().hex[:8]
                c.execute(
                    "INSERT INTO outbox VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', NULL)",
                    (
                        message_id, idempotency_key, user_id, acct["email"],
                        f"Your refund for order {order_id}",
                        f"Hi {acct['name']}, we refunded ${amount:.2f} for order {order_id}.",
                        amount, order_id, now, now + self.delivery_delay,
                    ),
                )
                self._log(c, "send_refund_email", args, f"queued {message_id}")
                row = c.execute("SELECT * FROM outbox WHERE message_id = ?", (message_id,)).fetchone()
        if problem:
            raise WorldError(problem)
        return self._email_dict(row)

    def recall(self, message_id: str) -> dict[str, Any]:
        """Take a queued email back. Recalling twice is fine; recalling a delivered one raises."""
        with self._conn() as c:
            self._settle(c)
            row = c.execute("SELECT * FROM outbox WHERE message_id = ?", (message_id,)).fetchone()
            if row is None:
                self._log(c, "recall", {"message_id": message_id}, "unknown message")
                outcome: Exception | None = WorldError(f"no email {message_id!r} in the outbox")
            elif row["status"] == "delivered":
                self._log(c, "recall", {"message_id": message_id}, "too late: delivered")
                outcome = TooLateToRecall(
                    f"email {message_id} to {row['to_addr']} was already delivered; it cannot be recalled"
                )
            else:
                if row["status"] == "queued":
                    c.execute(
                        "UPDATE outbox SET status = 'recalled', recalled_at = ? WHERE message_id = ?",
                        (self.clock(), message_id),
                    )
                self._log(c, "recall", {"message_id": message_id}, "recalled")
                outcome = None
                row = c.execute("SELECT * FROM outbox WHERE message_id = ?", (message_id,)).fetchone()
        if outcome is not None:
            raise outcome
        return self._email_dict(row)

    def find_by_key(self, idempotency_key: str) -> dict[str, Any] | None:
        with self._conn() as c:
            self._settle(c)
            row = c.execute("SELECT * FROM outbox WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
        return None if row is None else self._email_dict(row)

    def delete_account(self, user_id: str) -> dict[str, Any]:
        with self._conn() as c:
            acct = c.execute("SELECT * FROM accounts WHERE user_id = ?", (user_id,)).fetchone()
            if acct is None or acct["status"] != "active":
                self._log(c, "delete_account", {"user_id": user_id}, "refused")
                problem = f"no active account {user_id!r}"
            else:
                c.execute(
                    "UPDATE accounts SET status = 'deleted', deleted_at = ? WHERE user_id = ?", (self.clock(), user_id)
                )
                self._log(c, "delete_account", {"user_id": user_id}, "deleted")
                problem = None
        if problem:
            raise WorldError(problem)
        return {"user_id": user_id, "status": "deleted"}

    # -- what tests and the demo look at ------------------------------------------------------------

    def reset(self) -> None:
        """Back to the seeded start: every account active, no email, no operation (``check_undo``'s reset)."""
        with self._conn() as c:
            for table in ("outbox", "operations", "accounts", "orders"):
                c.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed table names
            c.executemany("INSERT INTO accounts (user_id, name, email) VALUES (?, ?, ?)", SEED_ACCOUNTS)
            c.executemany("INSERT INTO orders VALUES (?, ?, ?)", SEED_ORDERS)

    def snapshot(self) -> dict[str, Any]:
        """What a correct compensation restores (``check_undo``'s snapshot): each account's status and the emails
        that are on their way or delivered. A recalled email is left out: the recall is the compensation's
        trace, on purpose (a compensation is a second action, not time travel), as is the operation log."""
        with self._conn() as c:
            self._settle(c)
            accounts = {r["user_id"]: r["status"] for r in c.execute("SELECT user_id, status FROM accounts")}
            emails = {r["message_id"]: {"to": r["to_addr"], "order_id": r["order_id"], "amount": r["amount"],
                                        "status": r["status"]}
                      for r in c.execute("SELECT * FROM outbox WHERE status != 'recalled' ORDER BY message_id")}
        return {"accounts": accounts, "emails": emails}

    def emails(self) -> list[Email]:
        with self._conn() as c:
            self._settle(c)
            rows = c.execute("SELECT * FROM outbox ORDER BY queued_at, message_id").fetchall()
        return [
            Email(r["message_id"], r["user_id"], r["to_addr"], r["subject"], r["amount"], r["order_id"], r["status"],
                  r["deliver_at"])
            for r in rows
        ]

    def account_status(self, user_id: str) -> str | None:
        with self._conn() as c:
            row = c.execute("SELECT status FROM accounts WHERE user_id = ?", (user_id,)).fetchone()
        return None if row is None else str(row["status"])

    def operations(self, op: str | None = None) -> list[dict[str, Any]]:
        """Every call the world received, in order: how tests prove a tool ran exactly once."""
        with self._conn() as c:
            q = "SELECT op, args, outcome FROM operations" + (" WHERE op = ?" if op else "") + " ORDER BY seq"
            rows = c.execute(q, (op,) if op else ()).fetchall()
        return [{"op": r["op"], "args": json.loads(r["args"]), "outcome": r["outcome"]} for r in rows]

    def deliver_now(self) -> None:
        """Let every queued email go out now, as if the delay had passed (tests of the too-late path)."""
        with self._conn() as c:
            c.execute("UPDATE outbox SET deliver_at = ? WHERE status = 'queued'", (self.clock(),))
            self._settle(c)

    @staticmethod
    def _email_dict(row: sqlite3.Row) -> dict[str, Any]:
        return {
            "message_id": row["message_id"],
            "to": row["to_addr"],
            "order_id": row["order_id"],
            "amount": row["amount"],
            "status": row["status"],
        }
