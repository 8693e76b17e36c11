"""The desk's tables for email approvals: approver addresses, per-group mail settings, link tokens and the mail
outbox. Who changed what, and every refused link, go to the core's audit trail (``UndoLog.record_audit``).

The SQL of email approvals lives here, next to the rest of the desk's storage; what to send and when is decided
in :mod:`undolog_server.email_approvals`. No row holds anything that decides a request by itself: a token row is
only the server's memory of a link (used, void, code attempts); the link's signature comes from a key kept outside
the database, and a code is derived from that key, never stored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import CoreStore, UTCDateTime, aware, insert_ignore, metadata, utcnow

email_approvers = sa.Table(
    "undolog_email_approvers",
    metadata,
    # Lower-cased: one address maps to one key, whatever case an admin typed it in.
    sa.Column("address", sa.String(320), primary_key=True),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("created_by", sa.String(200), nullable=True),
    sa.Index("ix_undolog_email_approvers_key", "key_id"),
)

email_groups = sa.Table(
    "undolog_email_groups",
    metadata,
    # An approver group's name, or "*" for requests routed to no group.
    sa.Column("group_name", sa.String(100), primary_key=True),
    sa.Column("include_arguments", sa.Boolean, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

email_tokens = sa.Table(
    "undolog_email_tokens",
    metadata,
    sa.Column("token_id", sa.String(40), primary_key=True),
    sa.Column("approval_request_id", sa.String(64), nullable=False),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("address", sa.String(320), nullable=False),
    sa.Column("action_digest", sa.String(128), nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("used_at", UTCDateTime, nullable=True),
    sa.Column("void_at", UTCDateTime, nullable=True),
    sa.Column("void_reason", sa.String(200), nullable=True),
    # The current code is HMAC(token key, token id, nonce): a reader of the database cannot compute it.
    sa.Column("code_nonce", sa.String(40), nullable=True),
    sa.Column("code_expires_at", UTCDateTime, nullable=True),
    sa.Column("codes_sent", sa.Integer, nullable=False, default=0),
    sa.Column("code_attempts", sa.Integer, nullable=False, default=0),
    # SHA-256 of the browser cookie a correct code granted (the database never holds a usable cookie).
    sa.Column("grant_hash", sa.String(64), nullable=True),
    sa.UniqueConstraint("approval_request_id", "address", name="uq_undolog_email_tokens_request_address"),
)

email_outbox = sa.Table(
    "undolog_email_outbox",
    metadata,
    sa.Column("message_id", sa.String(40), primary_key=True),
    # "fanout" (a request to expand into one mail per approver), "approval" (the request's mail) or "code".
    sa.Column("kind", sa.String(20), nullable=False),
    # Makes a fan-out done twice (two servers, a retry) queue once.
    sa.Column("dedupe", sa.String(200), nullable=False, unique=True),
    sa.Column("approval_request_id", sa.String(64), nullable=False),
    sa.Column("token_id", sa.String(40), nullable=True),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_attempt_at", sa.Float, nullable=False),
    sa.Column("locked_until", sa.Float, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("sent_at", UTCDateTime, nullable=True),
    sa.Index("ix_undolog_email_outbox_due", "status", "next_attempt_at"),
)

@dataclass(frozen=True)
class EmailToken:
    """The server's memory of one emailed link (bound to a request, a key and the request's action digest)."""

    token_id: str
    approval_request_id: str
    key_id: str
    address: str
    action_digest: str
    expires_at: datetime
    used_at: datetime | None
    void_at: datetime | None
    void_reason: str | None
    code_nonce: str | None
    code_expires_at: datetime | None
    codes_sent: int
    code_attempts: int
    grant_hash: str | None


def _token(row: Any) -> EmailToken:
    return EmailToken(
        row["token_id"], row["approval_request_id"], row["key_id"], row["address"], row["action_digest"],
        aware(row["expires_at"]) or utcnow(), aware(row["used_at"]), aware(row["void_at"]), row["void_reason"],
        row["code_nonce"], aware(row["code_expires_at"]), int(row["codes_sent"] or 0), int(row["code_attempts"] or 0),
        row["grant_hash"],
    )


@dataclass
class EmailStore:
    """Data access for email approvals, on the core store's transaction helpers.

    Args:
        core: The UndoLog's store (``undolog.store``).

    Example:
        >>> EmailStore(undolog.store).map_address("ana@example.com", key.key_id, actor="admin (key 1a2b)")
    """

    core: CoreStore

    # ---- approver addresses (admin) ---------------------------------------------------------------

    def addresses(self) -> list[dict[str, Any]]:
        """Every address mapping, by address."""
        with self.core.read() as conn:
            rows = conn.execute(sa.select(email_approvers).order_by(email_approvers.c.address)).mappings().all()
        return [dict(r) | {"created_at": aware(r["created_at"])} for r in rows]

    def addresses_of(self, key_ids: Sequence[str]) -> dict[str, list[str]]:
        """The addresses mapped to each of these keys."""
        out: dict[str, list[str]] = {}
        if not key_ids:
            return out
        with self.core.read() as conn:
            rows = conn.execute(sa.select(email_approvers.c.address, email_approvers.c.key_id)
                                .where(email_approvers.c.key_id.in_(list(key_ids)))
                                .order_by(email_approvers.c.address)).all()
        for address, key_id in rows:
            out.setdefault(key_id, []).append(address)
        return out

    def map_address(self, address: str, key_id: str, *, actor: str) -> str | None:
        """Map ``address`` to a key (replacing a previous mapping); returns the key it was mapped to before."""
        e = email_approvers
        with self.core.tx() as conn:
            before = conn.execute(sa.select(e.c.key_id).where(e.c.address == address)).scalar()
            if before is None:
                conn.execute(e.insert().values(address=address, key_id=key_id, created_at=utcnow(), created_by=actor))
            else:
                conn.execute(e.update().where(e.c.address == address)
                             .values(key_id=key_id, created_at=utcnow(), created_by=actor))
        return str(before) if before is not None else None

    def unmap_address(self, address: str) -> str | None:
        """Remove an address mapping; returns the key it was mapped to (None: there was none)."""
        e = email_approvers
        with self.core.tx() as conn:
            before = conn.execute(sa.select(e.c.key_id).where(e.c.address == address)).scalar()
            if before is None:
                return None
            conn.execute(e.delete().where(e.c.address == address))
        return str(before)

    # ---- per-group settings (admin) ---------------------------------------------------------------

    def group_settings(self) -> dict[str, bool]:
        """``{group name or "*": include_arguments}``."""
        with self.core.read() as conn:
            rows = conn.execute(sa.select(email_groups.c.group_name, email_groups.c.include_arguments)).all()
        return {name: bool(v) for name, v in rows}

    def put_group_setting(self, group: str, include_arguments: bool) -> None:
        """Say whether mails of requests routed to ``group`` carry the arguments."""
        g = email_groups
        with self.core.tx() as conn:
            res = conn.execute(g.update().where(g.c.group_name == group)
                               .values(include_arguments=include_arguments, updated_at=utcnow()))
            if not res.rowcount:
                conn.execute(g.insert().values(group_name=group, include_arguments=include_arguments,
                                               updated_at=utcnow()))

    # ---- the mail outbox --------------------------------------------------------------------------

    def queue_in(self, conn: Connection, kind: str, dedupe: str, approval_request_id: str,
                 token_id: str | None = None) -> int:
        """Queue one message inside the caller's transaction; a repeat of ``dedupe`` is ignored."""
        return insert_ignore(conn, email_outbox, [{
            "message_id": "em_" + uuid.uuid4().hex[:20], "kind": kind, "dedupe": dedupe,
            "approval_request_id": approval_request_id, "token_id": token_id, "status": "pending", "attempts": 0,
            "next_attempt_at": time.time(), "created_at": utcnow(),
        }])

    def claim_due(self, limit: int, lease_until: float) -> list[dict[str, Any]]:
        """Lease due messages until ``lease_until`` so no other server sends them meanwhile."""
        o = email_outbox
        now = time.time()
        with self.core.tx() as conn:
            q = (sa.select(o).where(o.c.status == "pending", o.c.next_attempt_at <= now,
                                    sa.or_(o.c.locked_until.is_(None), o.c.locked_until < now))
                 .order_by(o.c.next_attempt_at).limit(limit))
            if self.core.is_postgres:
                q = q.with_for_update(skip_locked=True)
            rows = [dict(r) for r in conn.execute(q).mappings()]
            if rows:
                conn.execute(o.update().where(o.c.message_id.in_([r["message_id"] for r in rows]))
                             .values(locked_until=lease_until))
        return rows

    def record(self, message_id: str, *, attempts: int, status: str | None = None, error: str | None = None,
               next_attempt_at: float | None = None) -> None:
        """Store one attempt: ``status`` ``sent``/``failed``/``dropped``, or a retry at ``next_attempt_at``."""
        values: dict[str, Any] = {"attempts": attempts, "last_error": error, "locked_until": None}
        if status is not None:
            values["status"] = status
            if status == "sent":
                values["sent_at"] = utcnow()
        if next_attempt_at is not None:
            values["next_attempt_at"] = next_attempt_at
        with self.core.tx() as conn:
            conn.execute(email_outbox.update().where(email_outbox.c.message_id == message_id).values(**values))

    def messages(self, approval_request_id: str | None = None) -> list[dict[str, Any]]:
        """The outbox rows (newest first), for the admin API and tests."""
        q = sa.select(email_outbox).order_by(email_outbox.c.created_at.desc())
        if approval_request_id is not None:
            q = q.where(email_outbox.c.approval_request_id == approval_request_id)
        with self.core.read() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def expand(self, fanout_id: str, approval_request_id: str, tokens: Sequence[dict[str, Any]]) -> None:
        """Turn a fan-out row into one token and one queued mail per recipient, and close the fan-out, at once."""
        with self.core.tx() as conn:
            for t in tokens:
                # One link per (request, address): a fan-out repeated after a crash reuses the first one's token.
                insert_ignore(conn, email_tokens, [dict(t, created_at=utcnow(), codes_sent=0, code_attempts=0)])
                token_id = conn.execute(sa.select(email_tokens.c.token_id).where(
                    email_tokens.c.approval_request_id == approval_request_id,
                    email_tokens.c.address == t["address"])).scalar_one()
                self.queue_in(conn, "approval", f"approval:{approval_request_id}:{t['address']}", approval_request_id,
                              token_id)
            conn.execute(email_outbox.update().where(email_outbox.c.message_id == fanout_id)
                         .values(status="sent", sent_at=utcnow(), locked_until=None))

    # ---- tokens -----------------------------------------------------------------------------------

    def token(self, token_id: str) -> EmailToken | None:
        """A token row, or None."""
        with self.core.read() as conn:
            row = conn.execute(sa.select(email_tokens).where(email_tokens.c.token_id == token_id)).mappings().first()
        return _token(row) if row else None

    def start_code(self, token_id: str, nonce: str, expires_at: datetime, max_codes: int) -> bool:
        """Issue a new code (a new nonce) and queue its mail, unless the token is spent or sent ``max_codes``."""
        t = email_tokens
        with self.core.tx() as conn:
            res = conn.execute(
                t.update().where(t.c.token_id == token_id, t.c.used_at.is_(None), t.c.void_at.is_(None),
                                 t.c.codes_sent < max_codes)
                .values(code_nonce=nonce, code_expires_at=expires_at, codes_sent=t.c.codes_sent + 1))
            if not res.rowcount:
                return False
            row = conn.execute(sa.select(t.c.approval_request_id).where(t.c.token_id == token_id)).one()
            self.queue_in(conn, "code", f"code:{token_id}:{nonce}", row.approval_request_id, token_id)
        return True

    def count_attempt(self, token_id: str, max_attempts: int) -> int | None:
        """Count one code attempt before the code is compared; returns the attempt's number, or None when the
        token is spent or has had its ``max_attempts`` (counting first: concurrent guesses cannot exceed it)."""
        t = email_tokens
        with self.core.tx() as conn:
            res = conn.execute(
                t.update().where(t.c.token_id == token_id, t.c.used_at.is_(None), t.c.void_at.is_(None),
                                 t.c.code_attempts < max_attempts)
                .values(code_attempts=t.c.code_attempts + 1))
            if not res.rowcount:
                return None
            return int(conn.execute(sa.select(t.c.code_attempts).where(t.c.token_id == token_id)).scalar_one())

    def grant(self, token_id: str, grant_hash: str) -> bool:
        """Remember the browser a correct code was entered in (and spend the code)."""
        t = email_tokens
        with self.core.tx() as conn:
            return bool(conn.execute(
                t.update().where(t.c.token_id == token_id, t.c.used_at.is_(None), t.c.void_at.is_(None))
                .values(grant_hash=grant_hash, code_nonce=None, code_expires_at=None)).rowcount)

    def void(self, token_id: str, reason: str) -> None:
        """Void a token for good (too many wrong codes)."""
        t = email_tokens
        with self.core.tx() as conn:
            conn.execute(t.update().where(t.c.token_id == token_id, t.c.void_at.is_(None), t.c.used_at.is_(None))
                         .values(void_at=utcnow(), void_reason=reason))

    def use(self, token_id: str) -> bool:
        """Spend a token, once: True for the one caller that spent it."""
        t = email_tokens
        with self.core.tx() as conn:
            return bool(conn.execute(
                t.update().where(t.c.token_id == token_id, t.c.used_at.is_(None), t.c.void_at.is_(None))
                .values(used_at=utcnow())).rowcount)

    def unuse(self, token_id: str) -> None:
        """Give a spent link back when the core refused its decision and the request stayed pending (a bad edit)."""
        t = email_tokens
        with self.core.tx() as conn:
            conn.execute(t.update().where(t.c.token_id == token_id, t.c.void_at.is_(None)).values(used_at=None))
