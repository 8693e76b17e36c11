"""Approvals by email: a mail per approver through the desk's mail outbox, and a confirmation page its link opens.

The flow:

1. The core writes ``approval.requested`` to its outbox; the webhook fan-out hands it to :func:`queue_fanout`,
   which queues one *fan-out* row in the same transaction (at least once, never lost).
2. The mail loop (:class:`EmailSender`) expands a fan-out into one link token and one mail per approver address
   that may decide the request (admin-mapped addresses of keys in the request's approver groups, never the key
   that raised it), and sends the mails over SMTP with retries.
3. The link opens ``/ui/email/<token>``. A GET decides nothing and sends nothing (mail scanners follow links).
   The request is shown only to the key the link was sent for: logged in to the desk, or after a one-time code
   mailed to the same address (5 wrong codes void the link). A POST from that page decides, once, through the
   core's :class:`~undolog_core.ApprovalService` (self-decision and group checks as everywhere).

The package, by job: ``tokens`` (the signing key, link tokens, one-time codes), ``sender`` (the outbox consumer and
the SMTP loop), ``admin`` (the ``/v1/email`` routes), ``page`` (the confirmation page), ``wiring`` (``install``).

Link tokens are ``<payload>.<HMAC-SHA256>``, signed with a key kept outside the database
(``token_key_file`` or ``UNDOLOG_EMAIL_TOKEN_KEY``), bound to (request, key, action digest), expiring with the
request and spent by their one decision. Replies to the mail are not read.
"""

from .admin import ADDRESS_PATTERN, api
from .page import GRANT_COOKIE, ui
from .sender import EmailSender, queue_fanout
from .tokens import (
    MAX_CODE_ATTEMPTS,
    MIN_KEY_BYTES,
    TOKEN_KEY_ENV,
    code_for,
    load_token_key,
    read_token,
    sign_token,
)
from .wiring import install

__all__ = [
    "ADDRESS_PATTERN",
    "GRANT_COOKIE",
    "MAX_CODE_ATTEMPTS",
    "MIN_KEY_BYTES",
    "TOKEN_KEY_ENV",
    "EmailSender",
    "api",
    "code_for",
    "install",
    "load_token_key",
    "queue_fanout",
    "read_token",
    "sign_token",
    "ui",
]
