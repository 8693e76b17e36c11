"""Canonical JSON: the one text a value is digested, fingerprinted and stored as, the same on both databases.

A leaf: it imports nothing of UndoLog, so the declarations, the validation, the storage and the audit chain can all
use it without an import circle (``tests/test_import_graph.py``).

Example:
    >>> from undolog_core._json import canonical_json, jsonable
    >>> canonical_json(jsonable({"amount": float("nan"), "id": 7}))
    '{"amount":"NaN","id":7}'
"""

from __future__ import annotations

import hashlib
import json
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any

from pydantic_core import to_json, to_jsonable_python


def canonical_json(value: Any) -> str:
    """The one JSON text of a value that digests and fingerprints are taken over: sorted keys, no spaces, UTF-8.

    Example:
        >>> canonical_json({"b": 1, "a": [1.5, "é"]})
        '{"a":[1.5,"é"],"b":1}'
    """
    # allow_nan=False: a NaN must have been turned into a string before (see jsonable), never stored raw.
    return json.dumps(to_jsonable_python(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def sha256_hex(text: str) -> str:
    """The SHA-256 of a text's UTF-8 bytes, in hex (action digests, fingerprints, the audit chain).

    Example:
        >>> sha256_hex("")[:12]
        'e3b0c44298fc'
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def jsonable(value: Any) -> Any:
    # NaN and infinities become "NaN"/"Infinity" strings: PostgreSQL's json refuses them, and both databases
    # must store the same thing. Only the Python-mode converter is needed when no float is special.
    out = to_jsonable_python(value, fallback=repr)
    if _has_special_float(out):
        return json.loads(to_json(value, fallback=repr, inf_nan_mode="strings"))
    return out


def json_safe(value: Any) -> Any:
    """A JSON-mode value (from model_dump(mode="json")) with NaN and infinities made strings, as ``jsonable``."""
    return json.loads(to_json(value, inf_nan_mode="strings")) if _has_special_float(value) else value


# json.dumps builds a new encoder on every call, and so does JSONEncoder.encode (its C encoder, inside
# iterencode): about half of the cost of encoding a call's few arguments. This C encoder is built once, with the
# same settings, so its text is byte for byte JSONEncoder's (digests stored before compare equal). No circular
# check (it keeps a shared dict of the ids on the current path): a JSON-mode value has no cycles.
_canonical_default = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                      allow_nan=False).default
_canonical_encode = (
    c_make_encoder(None, _canonical_default, encode_basestring, None, ":", ",", True, False, False)
    if c_make_encoder is not None else None
)
_canonical_fallback = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def canonical_text(value: Any) -> str:
    """``canonical_json`` for a value that is already JSON-safe (as ``model_dump(mode="json")`` gives: no cycles,
    no NaN): the digest and the stored snapshot in one go."""
    if _canonical_encode is None:  # a Python without the C accelerator
        return _canonical_fallback(value)
    return "".join(_canonical_encode(value, 0))


def _has_special_float(value: Any) -> bool:
    if isinstance(value, float):
        return value != value or value in (_INF, -_INF)
    if isinstance(value, dict):
        return any(_has_special_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_special_float(v) for v in value)
    return False


_INF = float("inf")
