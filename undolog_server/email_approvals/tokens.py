"""The links' keys and tokens: the signing key read from outside the database, the signed link token, the one-time code.

Link tokens are ``<payload>.<HMAC-SHA256>``, signed with a key kept outside the database (``token_key_file`` or
``UNDOLOG_EMAIL_TOKEN_KEY``) and bound to (request, key, action digest); a code is derived from the same key and the
link's current nonce, so the database never holds a usable code. Pure functions: no database, no mail.

Example:
    >>> from datetime import UTC
    >>> t = sign_token(b"k" * 32, token_id="t1", approval_request_id="r1", key_id="ab12", action_digest="d",
    ...                expires_at=datetime.now(UTC))
    >>> read_token(b"k" * 32, t)["r"], len(code_for(b"k" * 32, "t1", "n1"))
    ('r1', 6)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..state import EmailSettings

__all__ = ["MAX_CODE_ATTEMPTS", "MIN_KEY_BYTES", "TOKEN_KEY_ENV", "code_for", "load_token_key", "read_token",
           "sign_token"]

#: The environment variable holding the link-signing key when no ``token_key_file`` is configured.
TOKEN_KEY_ENV = "UNDOLOG_EMAIL_TOKEN_KEY"
#: Wrong codes a link survives; the next makes it void for good.
MAX_CODE_ATTEMPTS = 5
#: The shortest signing key accepted (bytes).
MIN_KEY_BYTES = 32


def load_token_key(settings: EmailSettings) -> bytes:
    """Read the key that signs the links: ``token_key_file`` if set, else ``UNDOLOG_EMAIL_TOKEN_KEY``.

    Raises:
        ValueError: No key, or one shorter than 32 bytes; the message says where to put one.

    Example:
        >>> import secrets
        >>> from undolog_server.state import EmailSettings
        >>> os.environ["UNDOLOG_EMAIL_TOKEN_KEY"] = secrets.token_hex(32)
        >>> len(load_token_key(EmailSettings(smtp_host="localhost", sender="desk@example.com"))) >= 32
        True
    """
    if settings.token_key_file:
        path = Path(settings.token_key_file)
        try:
            raw = path.read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the email token key file {path}: {exc.strerror}; create it with "
                             f"`python -c 'import secrets; print(secrets.token_hex(32))' > {path}`") from None
    else:
        raw = os.environ.get(TOKEN_KEY_ENV, "").strip().encode()
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(
            f"email approvals need a link-signing key of at least {MIN_KEY_BYTES} bytes, kept outside the database: "
            f"set {TOKEN_KEY_ENV} or --email-token-key-file (e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`)")
    return raw


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, purpose: str, data: str) -> bytes:
    return hmac.new(key, f"undolog-email:{purpose}:{data}".encode(), hashlib.sha256).digest()


def sign_token(key: bytes, *, token_id: str, approval_request_id: str, key_id: str, action_digest: str,
               expires_at: datetime) -> str:
    """The link token: the binding in clear (it is no secret) and its HMAC under the link-signing key.

    Example:
        >>> from datetime import UTC
        >>> t = sign_token(b"k" * 32, token_id="t1", approval_request_id="r1", key_id="ab12", action_digest="d",
        ...                expires_at=datetime.now(UTC))
        >>> read_token(b"k" * 32, t)["r"]
        'r1'
    """
    payload = _b64(json.dumps({"t": token_id, "r": approval_request_id, "k": key_id, "d": action_digest,
                               "e": int(expires_at.timestamp())}, separators=(",", ":")).encode())
    return f"{payload}.{_b64(_mac(key, 'link', payload))}"


def read_token(key: bytes, token: str) -> dict[str, Any] | None:
    """The binding of a token whose signature holds, else None (nothing of a forged token is believed).

    Example:
        >>> read_token(b"k" * 32, "forged.token") is None
        True
    """
    if not token or len(token) > 1000 or token.count(".") != 1:
        return None
    payload, sig = token.split(".")
    try:
        # Compared as the text this desk sent, not as decoded bytes: base64 decoding ignores a last character's
        # unused bits, so four spellings of one signature would otherwise pass (the link is then not one this desk
        # sent, and a forged link's refusal would depend on which bits a forger touched).
        if not hmac.compare_digest(sig.encode("ascii"), _b64(_mac(key, "link", payload)).encode("ascii")):
            return None
        data = json.loads(_unb64(payload))
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in "trkd"):
        return None
    if not isinstance(data.get("e"), int):
        return None
    return data


def code_for(key: bytes, token_id: str, nonce: str) -> str:
    """The six-digit one-time code of a link's current nonce: derived from the key outside the database, so the
    database never holds a usable code.

    Example:
        >>> len(code_for(b"k" * 32, "t1", "n1"))
        6
    """
    return f"{int.from_bytes(_mac(key, 'code', f'{token_id}:{nonce}')[:8], 'big') % 1_000_000:06d}"
