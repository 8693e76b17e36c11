"""Signing and verifying UndoLog webhooks, with the standard library only.

A receiver verifies what the approval desk (``undolog serve``) sends with only the core installed:
nothing here needs the ``[server]`` extra. The server signs with the same functions, so the two cannot
drift apart.

Header: ``UndoLog-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + raw body)>``.

Example:
    >>> from undolog_core.webhooks import SIGNATURE_HEADER, verify_signature
    >>> def receive(headers, raw_body):
    ...     if not verify_signature(SECRET, headers[SIGNATURE_HEADER], raw_body, tolerance=300):
    ...         return 401
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = ["SIGNATURE_HEADER", "sign", "verify_signature"]

SIGNATURE_HEADER = "UndoLog-Signature"


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """Compute the ``UndoLog-Signature`` header value.

    Args:
        secret: The target's shared secret.
        timestamp: Unix seconds, also sent in the header (bounds replay).
        body: The exact request body.

    Returns:
        ``t=<timestamp>,v1=<hex digest>``.

    Example:
        >>> sign("s3cret", 1767052800, b"{}")[:13]
        't=1767052800,'
    """
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify_signature(secret: str, header: str, body: bytes, *, tolerance: float = 300, now: float | None = None) -> bool:
    """Check a received ``UndoLog-Signature``: what a receiver does before trusting the body.

    Args:
        secret: The shared secret.
        header: The header value.
        body: The raw body received (before any JSON parsing).
        tolerance: Largest accepted clock difference, in seconds (stale timestamps are refused).
        now: Current unix time (for tests).

    Returns:
        True when the signature is valid and fresh.

    Example:
        >>> verify_signature("s3cret", sign("s3cret", 1767052800, b"{}"), b"{}", now=1767052801)
        True
    """
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        ts = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if abs((now if now is not None else time.time()) - ts) > tolerance:
        return False
    expected = sign(secret, ts, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))
