"""A client's own idempotency key (``_meta`` ``dev.undolog/idempotency-key``) as the call's id.

On a COMPENSABLE or IRREVERSIBLE call the key names the call: the same key with the same arguments is the same
call (its recorded result, or the running call joined), with other arguments a clear error. The scope:

- over HTTP, (API key, tool, key): the call id ``ck:<digest>``, unique across every session by the effect log's
  partial unique index ``ux_undolog_effect_client_key``, which the pre-write's own insert meets (no statement
  more); a later session of the same API key finds the call there;
- over stdio and the local socket, (UndoLog session, tool, key): the call id ``cs:<digest>``, unique within the
  session as every call id is; two clients in two sessions never see each other's results.

A SAFE call's key is forwarded to the upstream as it came, and nothing is recorded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from undolog_core.errors import UndoLogError

# Where a client's key rides in a request's _meta (the very name the gateway sends its own key upstream under).
CLIENT_KEY_META = "dev.undolog/idempotency-key"
_MAX = 200


class ClientKeyInvalid(UndoLogError):
    """A client's own idempotency key (``_meta`` ``dev.undolog/idempotency-key``) is not a usable key.

    Fix:
        Send a non-empty string of at most 200 characters, one key per call you mean to run once, or send none.
    """

    code = "idempotency_key_invalid"


class ClientKeyReused(UndoLogError):
    """A client's idempotency key was used before for this tool with other arguments.

    Fix:
        Use a new key for a new call; resend the same arguments to get the first call's recorded result.
    """

    code = "idempotency_key_reused"


def checked_key(value: Any) -> str:
    """The client's key, or a clear error naming what a key must be.

    Raises:
        ClientKeyInvalid: not a non-empty string of at most 200 characters.
    """
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX:
        raise ClientKeyInvalid(
            f"_meta {CLIENT_KEY_META!r} must be a non-empty string of at most {_MAX} characters (got "
            f"{json.dumps(value, default=str)[:60]}); send one key per call you mean to run once")
    return value


def client_call_id(key: str, tool: str, *, principal: str | None, session_id: str) -> str:
    """The call id a client's key gives a call: ``ck:`` over HTTP (scoped by API key), ``cs:`` over stdio
    (scoped by session).

    Example:
        >>> client_call_id("k1", "create_ticket", principal="key:4f2a", session_id="s1")[:3]
        'ck:'
    """
    scope = f"key\x00{principal}" if principal is not None else f"session\x00{session_id}"
    digest = hashlib.sha256(f"{scope}\x00{tool}\x00{key}".encode("utf-8", "surrogatepass")).hexdigest()[:48]
    return ("ck:" if principal is not None else "cs:") + digest


def reused(key: str, tool: str) -> ClientKeyReused:
    return ClientKeyReused(f"idempotency key {key!r} was already used for {tool} with other arguments: a key names "
                           "one call; send a new key for a new call (or the same arguments to get its result)")
