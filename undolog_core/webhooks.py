"""Signing and verifying UndoLog webhooks, with the standard library only.

A receiver verifies what the approval desk (``undolog serve``) sends with only the core installed:
nothing here needs the ``[server]`` extra. The server signs with the same functions, so the two cannot
drift apart.

Header: ``UndoLog-Signature: t=<unix seconds>,v2=<hex HMAC-SHA256(secret, signed string)>`` where the
signed string is ``"<t>.<delivery id>." + raw body`` (the delivery id is the ``UndoLog-Delivery`` header).
Covering the delivery id means the id a receiver deduplicates on cannot be swapped by whoever replays a
request: a replay with a fresh id fails verification, and one with the old id is dropped as a repeat.

Example:
    >>> from undolog_core.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, verify_signature
    >>> def receive(headers, raw_body):
    ...     if not verify_signature(SECRET, headers[SIGNATURE_HEADER], raw_body,
    ...                             delivery_id=headers[DELIVERY_HEADER], tolerance=300):
    ...         return 401
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = ["DELIVERY_HEADER", "SIGNATURE_HEADER", "SIGNATURE_SCHEME", "sign", "signed_string", "verify_signature"]

SIGNATURE_HEADER = "UndoLog-Signature"
DELIVERY_HEADER = "UndoLog-Delivery"

#: The header's name for the digest; ``v1`` (which left the delivery id unsigned) is no longer sent or accepted.
SIGNATURE_SCHEME = "v2"


def signed_string(timestamp: int, delivery_id: str, body: bytes) -> bytes:
    """The exact bytes the HMAC covers: ``b"<timestamp>.<delivery id>." + body``.

    Example:
        >>> signed_string(1767052800, "dl_1", b"{}")
        b'1767052800.dl_1.{}'
    """
    return f"{timestamp}.{delivery_id}.".encode() + body


def sign(secret: str, timestamp: int, body: bytes, *, delivery_id: str) -> str:
    """Compute the ``UndoLog-Signature`` header value.

    Args:
        secret: The target's shared secret.
        timestamp: Unix seconds, also sent in the header (bounds replay).
        body: The exact request body.
        delivery_id: The delivery's id, sent as ``UndoLog-Delivery`` (receivers deduplicate on it).

    Returns:
        ``t=<timestamp>,v2=<hex digest>``.

    Example:
        >>> sign("s3cret", 1767052800, b"{}", delivery_id="dl_1")[:13]
        't=1767052800,'
    """
    mac = hmac.new(secret.encode(), signed_string(timestamp, delivery_id, body), hashlib.sha256).hexdigest()
    return f"t={timestamp},{SIGNATURE_SCHEME}={mac}"


def verify_signature(
    secret: str,
    header: str,
    body: bytes,
    *,
    delivery_id: str,
    tolerance: float = 300,
    now: float | None = None,
) -> bool:
    """Check a received ``UndoLog-Signature``: what a receiver does before trusting the body.

    Never raises on what a sender controls: a malformed, non-ASCII or missing header is simply not valid.

    Args:
        secret: The shared secret.
        header: The ``UndoLog-Signature`` header value.
        body: The raw body received (before any JSON parsing).
        delivery_id: The ``UndoLog-Delivery`` header value (signed too).
        tolerance: Largest accepted clock difference, in seconds (stale timestamps are refused).
        now: Current unix time (for tests).

    Returns:
        True when the signature is valid and fresh.

    Example:
        >>> h = sign("s3cret", 1767052800, b"{}", delivery_id="dl_1")
        >>> verify_signature("s3cret", h, b"{}", delivery_id="dl_1", now=1767052801)
        True
        >>> verify_signature("s3cret", h, b"{}", delivery_id="dl_2", now=1767052801)
        False
    """
    if not isinstance(header, str) or not isinstance(delivery_id, str) or not isinstance(body, bytes | bytearray):
        return False
    try:
        parts = dict(p.strip().split("=", 1) for p in header.split(","))
        ts = int(parts["t"])
        given = parts[SIGNATURE_SCHEME].encode("ascii")
    except (ValueError, KeyError, UnicodeEncodeError):
        return False
    if abs((now if now is not None else time.time()) - ts) > tolerance:
        return False
    expected = sign(secret, ts, bytes(body), delivery_id=delivery_id).split("=")[-1].encode("ascii")
    # Bytes, not str: compare_digest raises TypeError on non-ASCII str, which a sender controls.
    return hmac.compare_digest(expected, given)
