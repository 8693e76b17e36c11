"""JSON limits shared by the core and the desk: nesting depth, lone surrogates, identity lengths, snapshot size.

Arguments are *refused* when they break a limit (nothing is stored, ``ArgumentsInvalid`` names the path): the call
has not run yet. Results are *kept*: the tool has already run, so its result is always stored, made safe (lone
surrogates escaped, nesting and size capped, each cap noted in place as ``{"undolog_truncated": ...}``) and the
commit mark is never lost. The common case (small plain JSON) takes the fast encoder and one length check.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic_core import to_json, to_jsonable_python

from .errors import InvalidId

#: The deepest nesting accepted in arguments (and request bodies, by the desk); where a result is made safe, or a
#: listing shows one, nesting past it is cut. ``{"a": 1}`` is depth 1, ``{"a": [1]}`` depth 2.
MAX_JSON_DEPTH = 64

#: The one length rule for identities given as input: session ids, call ids, agent ids, ``created_by``, approvers and
#: actors (the desk derives its key-name limit from it, so ``name (key id)`` fits). Columns that add a prefix of
#: UndoLog's own (the audit actor ``agent:<session id>``) are wider than this.
MAX_ID_LENGTH = 200

#: A result's JSON larger than this (bytes of UTF-8) is stored as a preview, noted ``undolog_truncated``.
MAX_RESULT_BYTES = 1 << 20

#: How much of an oversized value a preview keeps (characters of its JSON text).
PREVIEW_CHARS = 2048

TRUNCATED = "undolog_truncated"


def _counted_depth_may_exceed(text: str, limit: int) -> bool:
    # A value nested deeper than `limit` needs more than `limit` opening brackets in its JSON text; counting them is
    # C-speed, so only texts that might be too deep are walked (a bracket inside a string only costs a walk).
    return len(text) > 2 * limit and text.count("{") + text.count("[") > limit


_PLAIN = (str, int, float, bool, type(None))


def _is_container(v: Any) -> bool:
    t = type(v)
    if t is dict or t is list or t is tuple:
        return True
    return t not in _PLAIN and isinstance(v, (Mapping, list, tuple))


def _path(node: Any) -> list[Any]:
    out: list[Any] = []
    while node is not None:
        key, node = node
        out.append(key)
    out.reverse()
    return out


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> list[Any] | None:
    """The path to the first container nested deeper than ``limit`` (iteratively: any depth is safe), or None.

    Example:
        >>> too_deep({"a": {"b": [1]}}, limit=2)
        ['a', 'b']
    """
    # Paths are linked (key, parent) pairs, made into a list only for the answer: the walk allocates little.
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        v, depth, node = stack.pop()
        if type(v) is dict or isinstance(v, Mapping):
            items: Any = v.items()
        elif isinstance(v, (list, tuple)):
            items = enumerate(v)
        else:
            continue
        if depth > limit:
            return _path(node)
        below = depth + 1
        for k, child in items:
            if _is_container(child):
                stack.append((child, below, (k, node)))
    return None


def bad_string(value: Any) -> tuple[list[Any], str] | None:
    """The path and text of the first string (key or value) that is not valid Unicode (a lone surrogate), or None."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not encodes(v):
                return path, v
        elif isinstance(v, Mapping):
            for k, child in v.items():
                if isinstance(k, str) and not encodes(k):
                    return [*path, k], k
                stack.append((child, [*path, k]))
        elif isinstance(v, (list, tuple)):
            stack.extend((child, [*path, i]) for i, child in enumerate(v))
    return None


def check_identity(what: str, value: object) -> None:
    """The one length rule, for identities given as input (an approver, an actor, an agent id, ...): a non-empty
    string of at most :data:`MAX_ID_LENGTH` characters, valid Unicode, without NUL, checked before any I/O so that
    both databases refuse the same values (PostgreSQL's ``VARCHAR(200)`` would otherwise fail mid-write).

    Example:
        >>> check_identity("approver", "x" * 201)
        Traceback (most recent call last):
        undolog_core.errors.InvalidId: approver must be a non-empty string of at most 200 characters ...
    """
    # (encodes' ASCII test inline: most identities are ASCII, and this runs on each new conversation's first sight.)
    if (not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_LENGTH or "\x00" in value
            or not (value.isascii() or encodes(value))):
        raise InvalidId(what, value, MAX_ID_LENGTH)


def encodes(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def escape_text(s: str) -> str:
    """``s`` with lone surrogates written as ``\\udXXX`` escapes, so it can be stored as UTF-8.

    Example:
        >>> escape_text("a\\ud800")
        'a\\\\ud800'
    """
    return s if encodes(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")


def clean_text(s: str, limit: int = 16_384) -> str:
    """Free text for a TEXT column (an error message, a reason): lone surrogates escaped, NUL written ``\\x00``
    (PostgreSQL text cannot hold it), at most ``limit`` characters.

    Example:
        >>> clean_text("bad\\x00byte")
        'bad\\\\x00byte'
    """
    s = escape_text(s)
    if "\x00" in s:
        s = s.replace("\x00", "\\x00")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def args_problem(value: Any, text: str) -> dict[str, Any] | None:
    """Why already-serialised arguments (``text`` is their canonical JSON) cannot be logged, as a field error.

    The fast checks (an ASCII flag, a bracket count) are all the common case pays; the walks run only when they
    find something.
    """
    if _counted_depth_may_exceed(text, MAX_JSON_DEPTH):
        path = too_deep(value)
        if path is not None:
            return depth_error(path)
    if not encodes(text):
        found = bad_string(value)
        return surrogate_error(found[0] if found else [])
    return None


def depth_error(path: list[Any]) -> dict[str, Any]:
    return {"loc": path, "msg": f"nested deeper than {MAX_JSON_DEPTH} levels (the limit)", "type": "json_too_deep"}


def surrogate_error(path: list[Any]) -> dict[str, Any]:
    return {"loc": path, "msg": "contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode",
            "type": "invalid_unicode"}


def input_problem(value: Any) -> dict[str, Any] | None:
    """:func:`args_problem` for a value not yet serialised (an edit, a request body); the walks bound their work.
    A person's input is also refused a NaN or an infinity (an agent's arguments store them as strings; an edit is
    run as it is stored).

    Example:
        >>> input_problem({"to": "\\ud800"})["loc"]
        ['to']
    """
    path = too_deep(value)
    if path is not None:
        return depth_error(path)
    found = bad_string(value)
    if found:
        return surrogate_error(found[0])
    path = non_finite(value)
    if path is not None:
        return {"loc": path, "msg": "is not a finite number (NaN and infinities have no JSON form)",
                "type": "not_finite"}
    return None


def non_finite(value: Any) -> list[Any] | None:
    """The path to the first float that is NaN or infinite, or None (iteratively: any depth is safe).

    Example:
        >>> non_finite({"a": [1.0, float("nan")]})
        ['a', 1]
    """
    found = first_leaf(value, lambda v: isinstance(v, float) and not math.isfinite(v))
    return None if found is None else found[0]


def first_leaf(value: Any, test: Callable[[Any], bool]) -> tuple[list[Any], Any] | None:
    """The path to, and the value of, the first leaf (not a mapping, list or tuple) of ``value`` that passes ``test``,
    or None. Iterative: any depth is safe. The desk's door finds what its JSON reader marked with it.

    Example:
        >>> first_leaf({"a": [1, "x"]}, lambda v: v == "x")
        (['a', 1], 'x')
    """
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, Mapping):
            stack.extend((child, [*path, k]) for k, child in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((child, [*path, i]) for i, child in enumerate(v))
        elif test(v):
            return path, v
    return None


# -- results: always stored --------------------------------------------------------------------------------------


def result_text(result: Any) -> str:
    """A result's JSON text as stored (NaN and infinities as strings), never failing: the tool has already run.

    Fast path: one Rust pass (``to_json``) and a length check, nothing more. A result that will not encode (a lone
    surrogate, a cycle, nesting past the encoder's own limit of 255 levels) or is larger than :data:`MAX_RESULT_BYTES`
    is made safe by :func:`safe_result` instead (nesting capped at :data:`MAX_JSON_DEPTH`).

    Example:
        >>> result_text({"id": 7})
        '{"id":7}'
    """
    try:
        raw = to_json(result, fallback=repr, inf_nan_mode="strings")
    except (ValueError, RecursionError):  # PydanticSerializationError is a ValueError
        return _dump(safe_result(result))
    if len(raw) > MAX_RESULT_BYTES or _deeper_than(raw, MAX_JSON_DEPTH):
        return _dump(safe_result(result))
    return raw.decode()


_ONLY_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"\\[]{}')


def _deeper_than(raw: bytes, limit: int) -> bool:
    """Whether encoded JSON nests more than ``limit`` levels, without walking the value in Python.

    A result with no more than ``limit`` brackets in all cannot (two ``bytes.count`` calls: the common case). Else
    everything but quotes, backslashes and brackets is deleted, escapes dropped, the strings' contents cut out, and
    the innermost pairs removed one level a pass: all in C (``translate``, ``replace``, ``split``), so a wide,
    shallow result costs a few passes over its brackets.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    kept = raw.translate(_ONLY_BRACKETS, _NOT_STRUCTURE)
    # An escaped backslash, then an escaped quote, then what is left of other escapes (\n, \u...): gone.
    if b"\\" in kept:
        kept = kept.replace(b"\\\\", b"").replace(b'\\"', b"").replace(b"\\", b"")
    # Strings with no bracket in them are now "" (each removal takes two quotes, so which side of a quote a bracket
    # is on stays the same); the rest are cut out: outside the strings are the even parts between quotes.
    kept = kept.replace(b'""', b"")
    brackets = b"".join(kept.split(b'"')[::2]) if b'"' in kept else kept
    for _ in range(limit):
        brackets = brackets.replace(b"[]", b"")
        if not brackets:
            return False
    return bool(brackets)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def safe_result(result: Any, *, max_bytes: int = MAX_RESULT_BYTES) -> Any:
    """A JSON value for ``result`` that can always be stored and served: strings escaped, nesting past
    :data:`MAX_JSON_DEPTH` (and cycles) replaced by ``{"undolog_truncated": ...}``, and, when the whole is larger
    than ``max_bytes``, a preview of its text instead (also marked ``undolog_truncated``).

    Example:
        >>> safe_result({"note": "\\ud800"})
        {'note': '\\\\ud800'}
    """
    value = _Safe().convert(result, 1)
    text = _dump(value)
    size = len(text.encode("utf-8"))
    if size <= max_bytes:
        return value
    return {TRUNCATED: {"reason": f"larger than {max_bytes} bytes", "bytes": size, "preview": text[:PREVIEW_CHARS]}}


_SCALARS = (str, int, float, bool, type(None))


class _Safe:
    """One conversion: the containers on the current path (cycles) and a budget of nodes (shared sub-trees)."""

    BUDGET = 1_000_000

    def __init__(self) -> None:
        self.on_path: set[int] = set()
        self.left = self.BUDGET

    def convert(self, v: Any, depth: int) -> Any:
        self.left -= 1
        if self.left < 0:
            return {TRUNCATED: f"more than {self.BUDGET} values"}
        if v is None or isinstance(v, (bool, int)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else ("NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))
        if isinstance(v, str):
            return escape_text(v)
        if isinstance(v, (Mapping, list, tuple, set, frozenset)):
            if depth > MAX_JSON_DEPTH:
                return {TRUNCATED: f"nested deeper than {MAX_JSON_DEPTH} levels"}
            if id(v) in self.on_path:
                return {TRUNCATED: "circular reference"}
            self.on_path.add(id(v))
            try:
                if isinstance(v, Mapping):
                    return {escape_text(k if isinstance(k, str) else str(k)): self.convert(x, depth + 1)
                            for k, x in v.items()}
                return [self.convert(x, depth + 1) for x in v]
            finally:
                self.on_path.discard(id(v))
        try:
            converted = to_jsonable_python(v, fallback=repr)
        except (ValueError, RecursionError):
            return escape_text(repr(v))
        if isinstance(converted, (dict, list)):
            return self.convert(converted, depth)
        return self.convert(converted, depth) if isinstance(converted, _SCALARS) else escape_text(repr(v))


def preview(value: Any, limit: int = PREVIEW_CHARS) -> Any:
    """``value`` itself when its JSON text is at most ``limit`` characters, else a marked preview of that text (for
    listings, which must never return unbounded blobs); nesting past :data:`MAX_JSON_DEPTH` is shown capped.

    Example:
        >>> preview({"blob": "x" * 5000}, limit=20)["undolog_truncated"]["chars"]
        5011
    """
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, dict) and TRUNCATED in value and len(value) == 1:
        return value  # already a preview (read as one from the database)
    try:
        text = _dump(value)
    except (ValueError, TypeError, RecursionError):
        value = safe_result(value)
        text = _dump(value)
    if _counted_depth_may_exceed(text, MAX_JSON_DEPTH) and too_deep(value) is not None:
        value = safe_result(value)  # shown capped at MAX_JSON_DEPTH, so an answer never nests past its encoder
        text = _dump(value)
    if len(text) <= limit:
        return value
    return {TRUNCATED: {"reason": "preview", "chars": len(text), "preview": text[:limit]}}


__all__ = [
    "MAX_ID_LENGTH",
    "MAX_JSON_DEPTH",
    "MAX_RESULT_BYTES",
    "PREVIEW_CHARS",
    "TRUNCATED",
    "args_problem",
    "bad_string",
    "check_identity",
    "clean_text",
    "encodes",
    "escape_text",
    "input_problem",
    "first_leaf",
    "non_finite",
    "preview",
    "result_text",
    "safe_result",
    "too_deep",
]
