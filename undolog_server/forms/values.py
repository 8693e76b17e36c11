"""Reading submitted values back: each field's text into its value (numbers, booleans, choices, lines, JSON), then
the arguments validated against the schema with ``jsonschema``, every error named by its field.

Example:
    >>> f = FormField(name="/n", path=("n",), label="n", kind="integer", required=True)
    >>> problems = []
    >>> parse_field(f, {"/n": "7"}, problems), problems
    (7, [])
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from .fields import ABSENT, FieldError, FormField, FormInvalid, json_text, pointer

__all__ = ["parse_field", "text_of", "validate"]


def text_of(v: Any) -> str | None:
    """A submitted value as one text: a list counts as its last item (a repeated form field); None stays None.

    Example:
        >>> text_of(["1", "2"]), text_of(3), text_of(None)
        ('2', '3', None)
    """
    if isinstance(v, list | tuple):
        v = v[-1] if v else None
    if v is None:
        return None
    return str(v)


def parse_field(f: FormField, texts: Mapping[str, str | None], problems: list[FieldError]) -> Any:
    """The field's value read from ``texts`` (an object's from its children), or ``ABSENT`` when it is left out;
    a text that does not read as the field's kind adds its error to ``problems``."""
    if f.kind == "object":
        obj: dict[str, Any] = {}
        for child in f.children:
            v = parse_field(child, texts, problems)
            if v is not ABSENT:
                obj[child.path[-1]] = v
        if not obj and not f.required and not f.present:
            return ABSENT
        return obj
    text = texts.get(f.name)
    raw = "" if text is None else text
    stripped = raw.strip() if f.kind not in ("string",) else raw
    if stripped == "" and f.kind != "string" or (f.kind == "string" and raw == "" and not f.required):
        return _empty(f)
    try:
        return _convert(f.kind, stripped, f)
    except ValueError as exc:
        problems.append(FieldError(f.name, f.path, f"{f.label}: {exc}"))
        return ABSENT


def _empty(f: FormField) -> Any:
    """An empty input: null when nullable (and required or present before), ``""``/``[]`` for a string or an
    array the arguments held or require, else the field is left out."""
    if f.nullable and (f.required or f.present):
        return None
    if f.kind == "string" and (f.required or (f.present and f.value == "")):
        return ""
    if f.kind == "array" and (f.required or f.present):
        return []
    return ABSENT


def _convert(kind: str, text: str, f: FormField | None) -> Any:
    if kind == "string":
        return text
    if kind == "boolean":
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        raise ValueError(f"must be true or false, not {text}")
    if kind == "integer":
        try:
            n = int(text, 10)
        except ValueError:
            try:
                x = float(text)
            except ValueError:
                raise ValueError(f"must be a whole number, not {text}") from None
            if not math.isfinite(x) or x != int(x):
                raise ValueError(f"must be a whole number, not {text}") from None
            n = int(x)
        return n
    if kind == "number":
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, bool) or not isinstance(value, int | float):
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"must be a number, not {text}") from None
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, not {text}")
        return value
    if kind == "enum":
        choices = {o[0]: o for o in f.options} if f is not None and f.options else None
        try:
            value = json.loads(text)
        except ValueError:
            # A bare string typed where the option texts are JSON (an array line, a hand-made POST).
            value = text
        if choices is not None and json_text(value) not in choices:
            raise ValueError(f"must be one of {', '.join(o[1] for o in f.options) if f else ''}, not {text}")
        return value
    if kind == "array":
        assert f is not None and f.item_kind is not None
        items = []
        for i, line in enumerate(text.replace("\r\n", "\n").split("\n")):
            if f.item_kind != "string":
                line = line.strip()
                if line == "":
                    continue
            try:
                items.append(_convert(f.item_kind, line, None))
            except ValueError as exc:
                raise ValueError(f"line {i + 1}: {exc}") from None
        if f.item_kind == "string" and items and items[-1] == "":
            items.pop()  # the newline a textarea keeps after the last line
        return items
    if kind == "json":
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise ValueError(f"is not valid JSON ({exc})") from None
    raise ValueError(f"cannot be read as {kind}")  # pragma: no cover - every kind is handled above


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def validate(fields: tuple[FormField, ...], schema: Mapping[str, Any], args: dict[str, Any]) -> None:
    """Check the arguments read from ``fields`` against ``schema``; each error is named by the field holding it."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema)
    names = {tuple(f.path): f for f in _all_fields(fields)}
    problems = []
    for err in sorted(validator.iter_errors(args), key=lambda e: [str(p) for p in e.absolute_path]):
        path = tuple(str(p) for p in err.absolute_path)
        if err.validator == "required" and isinstance(err.instance, dict):
            missing = re.match(r"'(.*)' is a required property", err.message)
            if missing:
                path = (*path, missing.group(1))
        owner = _owner(names, path)
        label = owner.label if owner is not None else (" › ".join(path) or "arguments")
        name = owner.name if owner is not None else pointer(path)
        problems.append(FieldError(name, owner.path if owner is not None else path, f"{label}: {err.message}"))
    if problems:
        raise FormInvalid(problems)


def _all_fields(fields: tuple[FormField, ...]) -> Iterator[FormField]:
    for f in fields:
        yield f
        yield from _all_fields(f.children)


def _owner(names: Mapping[tuple[str, ...], FormField], path: tuple[str, ...]) -> FormField | None:
    """The field whose input holds ``path`` (an array item belongs to its array, a JSON field's inside to it)."""
    for n in range(len(path), -1, -1):
        f = names.get(path[:n])
        if f is not None:
            return f
    return None
