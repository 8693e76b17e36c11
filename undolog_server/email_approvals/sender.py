"""The mail fan-out and sender: the outbox consumer queuing a request's mail, and the SMTP loop sending it.

1. The core writes ``approval.requested`` to its outbox; the webhook fan-out hands it to :func:`queue_fanout`,
   which queues one *fan-out* row in the same transaction (at least once, never lost).
2. :class:`EmailSender` expands a fan-out into one link token and one mail per approver address that may decide the
   request (admin-mapped addresses of keys in the request's approver groups, never the key that raised it), and
   sends the mails over SMTP with retries and backoff. A mail is built when it is sent: its link is signed then,
   with the key outside the database.

Example:
    >>> sender = EmailSender(state, load_token_key(state.settings.email))
    >>> sender.send_due()   # one pass: what the background loop does every ``email_interval``
    2
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import smtplib
import ssl
import time
import uuid
from collections.abc import Sequence
from email.message import EmailMessage
from email.utils import make_msgid
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from undolog_core import errors
from undolog_core.records import OutboxEvent

from ..identity import owns
from ..storage.email import EmailStore
from ..views import groups_for, may_see
from .tokens import code_for, sign_token

if TYPE_CHECKING:
    from ..state import EmailSettings, ServerState

__all__ = ["EmailSender", "email_store", "queue_fanout"]

log = logging.getLogger("undolog.server.email")


def queue_fanout(state: ServerState, conn: Any, event: OutboxEvent) -> None:
    """Outbox consumer: queue a request's mails in the claiming transaction (so the event is never lost).

    Registered among the webhook dispatcher's ``consumers`` by :func:`~undolog_server.email_approvals.install` when email is configured.
    """
    if event.event_type != "approval.requested":
        return
    rid = event.payload.get("approval_request_id")
    if isinstance(rid, str) and rid:
        email_store(state).queue_in(conn, "fanout", f"fanout:{rid}", rid)


def _header_text(value: Any, limit: int = 200) -> str:
    """A header-safe one-line text (no CR/LF: a tool name or reason cannot add headers)."""
    return re.sub(r"[\x00-\x1f\x7f]+", " ", str(value))[:limit]


def email_store(state: Any) -> EmailStore:
    """The email tables, on the desk store's handle: they live on the core's store (one pool, one migration run)."""
    return EmailStore(state.store.core)


class EmailSender:
    """Sends due mail from the desk's mail outbox over SMTP, with retries and backoff; expands fan-outs first.

    Args:
        state: The server state (its settings carry :class:`~undolog_server.state.EmailSettings`).
        key: The link-signing key (:func:`load_token_key`).

    Example:
        >>> sender = EmailSender(state, load_token_key(state.settings.email))
        >>> sender.send_due()   # one pass: what the background loop does every ``email_interval``
        2
    """

    def __init__(self, state: ServerState, key: bytes) -> None:
        assert state.settings.email is not None and state.settings.public_url
        self.state = state
        self.settings: EmailSettings = state.settings.email
        self.key = key
        self.store = email_store(state)

    def link(self, token: str) -> str:
        """The confirmation page's address for a token, built from ``public_url``."""
        return f"{(self.state.settings.public_url or '').rstrip('/')}/ui/email/{quote(token, safe='')}"

    def send_due(self, limit: int = 20) -> int:
        """Claim due messages and handle each (expand a fan-out, or send a mail); returns how many were handled."""
        lease = time.time() + self.settings.timeout * 6 + 10
        rows = self.store.claim_due(limit, lease)
        for row in rows:
            attempts = int(row["attempts"]) + 1
            try:
                if row["kind"] == "fanout":
                    self._expand(row)
                    continue
                msg = self._message(row)
                if msg is None:
                    self.store.record(row["message_id"], attempts=attempts - 1, status="dropped")
                    continue
                self._smtp(msg)
                self.store.record(row["message_id"], attempts=attempts, status="sent")
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the others
                self._retry(row["message_id"], attempts, exc)
        return len(rows)

    def _retry(self, message_id: str, attempts: int, exc: BaseException) -> None:
        s = self.settings
        # Generic text in the outbox (no SMTP conversation); the details go to the server log.
        error = f"{type(exc).__name__}"
        log.info("email message %s not sent (attempt %d): %s: %s", message_id, attempts, type(exc).__name__, exc)
        try:
            if attempts >= s.max_attempts:
                self.store.record(message_id, attempts=attempts, status="failed", error=error)
            else:
                delay = min(s.backoff_base * 2 ** (attempts - 1), s.backoff_max)
                self.store.record(message_id, attempts=attempts, error=error,
                                  next_attempt_at=time.time() + delay * random.uniform(0.8, 1.2))
        except Exception:
            # The lease runs out and the message is tried again: at least once, never lost.
            log.exception("could not record email message %s; it is retried after its lease", message_id)

    def _expand(self, row: dict[str, Any]) -> None:
        """One link token and one queued mail per address that may decide the request."""
        st = self.state
        rid = row["approval_request_id"]
        try:
            rec = st.undolog.approvals.get(rid)
        except errors.ApprovalNotFound:
            self.store.record(row["message_id"], attempts=1, status="dropped")
            return
        if rec.state.value != "pending":
            self.store.record(row["message_id"], attempts=1, status="dropped")
            return
        owner = (st.views.session_row(rec.session_id) or {}).get("created_by")
        groups = groups_for(st.store.groups(), rec.tool_name, rec.risk_tags)
        keys = [k for k in st.store.list_keys()
                if k.revoked_at is None and may_see(k, groups) and not owns(k, owner)]
        addresses = self.store.addresses_of([k.key_id for k in keys])
        tokens = [
            {"token_id": uuid.uuid4().hex, "approval_request_id": rid, "key_id": k.key_id, "address": address,
             "action_digest": rec.action_digest, "expires_at": rec.timeout_at}
            for k in keys for address in addresses.get(k.key_id, ())
        ]
        self.store.expand(row["message_id"], rid, tokens)

    def _message(self, row: dict[str, Any]) -> EmailMessage | None:
        """Build a mail at send time (the link is signed now, with the key outside the database); None: drop it."""
        tok = self.store.token(row["token_id"]) if row["token_id"] else None
        if tok is None or tok.used_at is not None or tok.void_at is not None:
            return None
        st = self.state
        try:
            rec = st.undolog.approvals.get(tok.approval_request_id)
        except errors.ApprovalNotFound:
            return None
        if rec.state.value != "pending":
            return None  # nothing left to decide: no mail about it
        token = sign_token(self.key, token_id=tok.token_id, approval_request_id=tok.approval_request_id,
                           key_id=tok.key_id, action_digest=tok.action_digest, expires_at=tok.expires_at)
        msg = EmailMessage()
        msg["From"] = self.settings.sender
        msg["To"] = tok.address
        msg["Message-ID"] = make_msgid(domain=self.settings.sender.rsplit("@", 1)[-1])
        # Auto-replies stay away; replies are not read anyway.
        msg["Auto-Submitted"] = "auto-generated"
        if row["kind"] == "code":
            nonce = str(row["dedupe"]).rsplit(":", 1)[-1]
            if tok.code_nonce != nonce:
                return None  # a newer code replaced this one
            msg["Subject"] = f"UndoLog code for approval request {_header_text(rec.approval_request_id)}"
            minutes = max(1, int(self.settings.code_ttl // 60))
            msg.set_content(
                f"Your one-time code: {code_for(self.key, tok.token_id, nonce)}\n\n"
                f"Enter it on the page that asked for it, within {minutes} minutes.\n"
                "If you did not ask for a code, someone else opened the link sent to you: do not pass the code on.\n"
            )
            return msg
        groups = groups_for(st.store.groups(), rec.tool_name, rec.risk_tags)
        include = self._include_arguments(groups)
        lines = [
            f"An agent asks to run {rec.tool_name}; it waits for a person's decision.",
            "",
            f"Request:  {rec.approval_request_id}",
            f"Reason:   {rec.reason or '-'}",
            f"Risk:     {', '.join(rec.risk_tags) or '-'}",
            f"Deadline: {rec.timeout_at.strftime('%Y-%m-%d %H:%M:%S')} UTC",
        ]
        if include:
            lines += ["", "Arguments:", json.dumps(rec.proposed_args, indent=2, sort_keys=True, ensure_ascii=False)]
        else:
            lines += ["", "The arguments are shown on the desk only (this approver group's mail carries none)."]
        lines += [
            "",
            "Review and decide:",
            self.link(token),
            "",
            "Opening the link decides nothing: the page shows the request after you log in to the desk or enter a "
            "code sent to this address, and only its Approve or Reject button decides. The link works once and "
            "expires with the request. Replies to this mail are not read.",
        ]
        msg["Subject"] = f"Approval needed: {_header_text(rec.tool_name, 100)} ({_header_text(rec.approval_request_id)})"
        msg.set_content("\n".join(lines) + "\n")
        return msg

    def _include_arguments(self, groups: Sequence[str]) -> bool:
        """Arguments go in the mail only when every group the request is routed to allows it ("*": no group)."""
        allowed = self.store.group_settings()
        return all(allowed.get(g, False) for g in groups) if groups else allowed.get("*", False)

    def _smtp(self, msg: EmailMessage) -> None:
        """One SMTP delivery, TLS as configured; the password is read from the environment now."""
        s = self.settings
        context = ssl.create_default_context(cafile=s.ca_file)
        client: smtplib.SMTP
        if s.security == "tls":
            client = smtplib.SMTP_SSL(s.smtp_host, s.smtp_port, timeout=s.timeout, context=context)
        else:
            client = smtplib.SMTP(s.smtp_host, s.smtp_port, timeout=s.timeout)
        with client:
            client.ehlo()
            if s.security == "starttls":
                client.starttls(context=context)  # raises when the server does not offer it: never plain text
                client.ehlo()
            if s.username:
                password = os.environ.get(s.password_env)
                if password is None:
                    raise smtplib.SMTPAuthenticationError(0, f"{s.password_env} is not set".encode())
                client.login(s.username, password)
            client.send_message(msg)

    async def loop(self, stop: asyncio.Event) -> None:
        """Send due mail every ``email_interval`` until ``stop`` is set (the desk's background loop)."""
        interval = self.state.settings.email_interval
        while not stop.is_set():
            handled = 0
            try:
                handled = await asyncio.to_thread(self.send_due)
            except Exception:
                log.exception("email pass failed; retrying")
            if not handled:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=interval)
                except TimeoutError:
                    pass
