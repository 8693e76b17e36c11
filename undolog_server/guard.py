"""The checks every request body passes at the door (and the dashboard's edited arguments, which are JSON in a form).

NUL characters, JSON nested deeper than :data:`undolog_core.limits.MAX_JSON_DEPTH`, lone surrogates and numbers JSON
cannot hold (``1e999``, ``NaN``, ``Infinity``) are refused with the path to what is wrong. The walks are iterative
(no depth raises a ``RecursionError``) and run only when a byte scan finds something to look at.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from undolog_core import limits


def body_problem(body: bytes, content_type: str) -> tuple[str, str, list[dict[str, str]]] | None:
    """Why a request body is refused at the door (code, detail, field errors), or None.

    Example:
        >>> body_problem(b'{"a": "\\ud800"}', "application/json")[0]
        'invalid_unicode'
    """
    if b"\x00" in body:
        return "nul_character", "NUL characters are not accepted", []
    # The media type itself, not a word anywhere in the header: FastAPI parses ``application/json; x=form-urlencoded``
    # as JSON, so such a body must get the JSON checks too.
    if content_type.split(";", 1)[0].strip().lower() == "application/x-www-form-urlencoded":
        return ("nul_character", "NUL characters are not accepted", []) if b"%00" in body.lower() else None
    lowered = body.lower()
    suspicious = b"\\u0000" in lowered or b"\\ud" in lowered or (
        body.count(b"{") + body.count(b"[") > limits.MAX_JSON_DEPTH) or _BIG_EXPONENT.search(body) is not None or (
        _CONSTANT.search(body) is not None) or _LONG_NUMBER.search(body) is not None
    if not suspicious:
        return None
    try:
        data = json.loads(body, parse_float=_finite, parse_constant=_NotFinite)
    except RecursionError:
        return _field("json_too_deep", f"the JSON body is nested deeper than {limits.MAX_JSON_DEPTH} levels", [])
    except ValueError:
        return None  # invalid JSON is answered by the validation error
    path = limits.too_deep(data)
    if path is not None:
        return _field("json_too_deep", f"the JSON body is nested deeper than {limits.MAX_JSON_DEPTH} levels", path)
    found = limits.first_leaf(data, lambda v: isinstance(v, _NotFinite))
    if found is not None:
        return _field("number_out_of_range", f"the number {found[1].text} in the JSON body is not a finite number",
                      found[0])
    nul = _nul_path(data)
    if nul is not None:
        return _field("nul_character", "NUL characters are not accepted", nul)
    bad = limits.bad_string(data)
    if bad is not None:
        return _field("invalid_unicode", "the JSON body holds a lone surrogate (\\ud800-\\udfff), which is not "
                      "valid Unicode", bad[0])
    return None


#: A number literal whose exponent has three digits or more: it may overflow to infinity (``1e999``).
_BIG_EXPONENT = re.compile(rb"[0-9.][eE][+-]?0*[0-9]{3,}")
#: 300 digits in a row: a float written without an exponent overflows to infinity from 309 digits (``1000...0.0``).
_LONG_NUMBER = re.compile(rb"[0-9]{300}")
#: ``NaN``, ``Infinity`` and ``-Infinity`` as values: Python's JSON reader takes them, JSON has none of them.
_CONSTANT = re.compile(rb"(?:^|[:,\[])\s*-?(?:NaN|Infinity)")


class _NotFinite(ValueError):
    """What a non-finite number is read as (``1e999``, ``NaN``, ``Infinity``), so the walk can name where it is."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text[:40]


def _finite(text: str) -> float | _NotFinite:
    # JSON numbers are finite; Python would read 1e999 as infinity, which no upstream can be sent as JSON.
    value = float(text)
    return value if math.isfinite(value) else _NotFinite(text)


def _field(code: str, detail: str, path: list[Any] | None) -> tuple[str, str, list[dict[str, str]]]:
    if path is None:  # where in the body is not known (the parser's own refusal)
        return code, detail, [{"field": "", "message": detail, "type": code}]
    where = ".".join(str(p) for p in path)
    shown = where if len(where) <= 200 else where[:197] + "..."
    return code, f"{detail} (at {shown or 'the top level'})", [{"field": shown, "message": detail, "type": code}]


def _nul_path(data: Any) -> list[Any] | None:
    stack: list[tuple[Any, list[Any]]] = [(data, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return path
        elif isinstance(v, dict):
            for k, x in v.items():
                if "\x00" in k:
                    return [*path, k]
                stack.append((x, [*path, k]))
        elif isinstance(v, list):
            stack.extend((x, [*path, i]) for i, x in enumerate(v))
    return None
