"""The pieces of a generated form: its fields, their errors, their names (JSON Pointers) and the texts they show.

A leaf of :mod:`undolog_server.forms`: what building (``schema``, ``form``), reading back (``values``) and the diff
(``changes``) share. No schema is read here.

Example:
    >>> f = FormField(name=pointer(("amount",)), path=("amount",), label="amount", kind="number", minimum=0)
    >>> f.id, f.step, f.hint
    ('arg-amount', 'any', 'at least 0')
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from undolog_core.errors import UndoLogError

__all__ = ["ABSENT", "MAX_DEPTH", "WHOLE", "FieldError", "FieldKind", "FormField", "FormInvalid", "dom_id",
           "int_or_none", "item_text", "json_text", "label_of", "num", "num_text", "pointer", "scalar_text"]

#: How many levels of nested objects get fields of their own (the arguments object itself is level 0); a deeper
#: object is edited as JSON.
MAX_DEPTH = 3

#: The input name of the one JSON field a form falls back to when the arguments schema is not an object with
#: properties (a pointer to the whole would be ``""``, a name an HTML form does not submit).
WHOLE = "args"

FieldKind = Literal["enum", "integer", "number", "boolean", "string", "array", "object", "json"]

#: The absent marker of a field with no value (None is a value: JSON null).
ABSENT: Any = object()


class FormInvalid(UndoLogError):
    """Values submitted through a generated edit form (dashboard, Slack modal, email page) do not fit the tool's
    arguments schema: a number that is not one, a value outside its bounds, a string not matching its pattern, a
    JSON field that does not parse.

    Fix:
        Read ``errors``: each names the field (its label and its ``name``, a JSON Pointer to the argument) and what
        is wrong with it. Correct those fields and submit again; nothing was decided.

    Example:
        >>> from undolog_server.forms import parse
        >>> try:
        ...     parse({"type": "object", "properties": {"n": {"type": "integer"}}}, {"/n": "ten"})
        ... except FormInvalid as exc:
        ...     exc.errors[0].message
        'n: must be a whole number, not ten'
    """

    code = "form_invalid"

    def __init__(self, errors: list[FieldError]) -> None:
        first = "; ".join(e.message for e in errors[:3]) + ("; ..." if len(errors) > 3 else "")
        super().__init__(
            f"the edited arguments are invalid: {first}. Correct the named fields and submit again; nothing was decided",
            errors=[{"name": e.name, "loc": list(e.path), "msg": e.message} for e in errors],
        )
        self.errors = errors


@dataclass(frozen=True)
class FieldError:
    """One field's problem.

    Attributes:
        name: The field's input name (a JSON Pointer to the argument; :data:`WHOLE` for the arguments as a whole).
        path: The argument's path (keys).
        message: What is wrong, starting with the field's label.
    """

    name: str
    path: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class FormField:
    """One field of a generated form.

    Attributes:
        name: The input's name: a JSON Pointer to the argument (``/address/city``).
        path: The argument's path (the keys from the arguments object down).
        label: What to call it (the schema's ``title``, else the path joined with `` › ``).
        kind: ``enum``, ``integer``, ``number``, ``boolean``, ``string``, ``array`` (of scalars: one item per
            line), ``object`` (a group of :attr:`children`) or ``json`` (the fallback).
        required: The parent object requires it.
        nullable: ``null`` is allowed (an empty input then means null).
        description: The schema's ``description``.
        value: The current value as the input shows it (text; an enum option's value; ``""`` when absent).
        present: Whether the current values hold it.
        options: ``(value, label)`` pairs of an enum (values are JSON texts) or a boolean (``true``/``false``).
        minimum: Inclusive lower bound of a number.
        maximum: Inclusive upper bound of a number.
        exclusive_minimum: Exclusive lower bound of a number.
        exclusive_maximum: Exclusive upper bound of a number.
        multiple_of: A number's ``multipleOf``.
        pattern: A string's ``pattern`` (a regular expression searched in the value, as JSON Schema does).
        min_length: A string's ``minLength``.
        max_length: A string's ``maxLength``.
        item_kind: An array's item kind (one of the scalar kinds).
        item_options: An array of enum items: the allowed items' texts.
        min_items: An array's ``minItems``.
        max_items: An array's ``maxItems``.
        children: An object's fields.
        schema: The field's schema (``$ref`` followed).
        fallback_reason: Why a ``json`` field is JSON (what the generator cannot render).
    """

    name: str
    path: tuple[str, ...]
    label: str
    kind: FieldKind
    required: bool = False
    nullable: bool = False
    description: str | None = None
    value: str = ""
    present: bool = False
    options: tuple[tuple[str, str], ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    multiple_of: float | None = None
    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None
    item_kind: str | None = None
    item_options: tuple[str, ...] = ()
    min_items: int | None = None
    max_items: int | None = None
    children: tuple[FormField, ...] = ()
    schema: Mapping[str, Any] = field(default_factory=dict, repr=False)
    fallback_reason: str | None = None

    @property
    def id(self) -> str:
        """An HTML id for the input (see :func:`dom_id`)."""
        return dom_id(self.name)

    @property
    def step(self) -> str:
        """The HTML ``step`` of a number input: ``1`` for integers (or the ``multipleOf``), else ``any``."""
        if self.multiple_of is not None:
            return num_text(self.multiple_of)
        return "1" if self.kind == "integer" else "any"

    @property
    def hint(self) -> str:
        """The constraints in words (bounds, pattern, lengths, items), for a help text under the input."""
        parts: list[str] = []
        if self.minimum is not None:
            parts.append(f"at least {num_text(self.minimum)}")
        if self.exclusive_minimum is not None:
            parts.append(f"more than {num_text(self.exclusive_minimum)}")
        if self.maximum is not None:
            parts.append(f"at most {num_text(self.maximum)}")
        if self.exclusive_maximum is not None:
            parts.append(f"less than {num_text(self.exclusive_maximum)}")
        if self.multiple_of is not None:
            parts.append(f"a multiple of {num_text(self.multiple_of)}")
        if self.pattern is not None:
            parts.append(f"matching {self.pattern}")
        if self.min_length is not None:
            parts.append(f"at least {self.min_length} characters")
        if self.max_length is not None:
            parts.append(f"at most {self.max_length} characters")
        if self.kind == "array":
            parts.append(f"one {self.item_kind} per line")
            if self.min_items is not None:
                parts.append(f"at least {self.min_items} items")
            if self.max_items is not None:
                parts.append(f"at most {self.max_items} items")
        if self.kind == "json":
            parts.append("JSON")
        if self.nullable:
            parts.append("empty for null")
        return ", ".join(parts)


def pointer(path: tuple[str, ...] | list[str]) -> str:
    """The JSON Pointer (RFC 6901) of an argument path: a field's input name.

    Example:
        >>> pointer(("address", "city")), pointer(("a/b", "c~d"))
        ('/address/city', '/a~1b/c~0d')
    """
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def dom_id(name: str) -> str:
    """An HTML id for a field named ``name``: ``arg`` then each path segment after a ``-``, any character other
    than ASCII letters, digits and ``_`` written as ``.xx`` (its code point in hex).

    Example:
        >>> dom_id("/address/city"), dom_id("/a b")
        ('arg-address-city', 'arg-a.20b')
    """
    segments = [s.replace("~1", "/").replace("~0", "~") for s in name.split("/")[1:]]
    safe = ["".join(c if (c.isascii() and (c.isalnum() or c == "_")) else f".{ord(c):x}" for c in s) for s in segments]
    return "arg" + "".join("-" + s for s in safe)


def json_text(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


def label_of(v: Any) -> str:
    return v if isinstance(v, str) else json_text(v)


def item_text(v: Any) -> str:
    return v if isinstance(v, str) else json_text(v)


def scalar_text(kind: str, v: Any) -> str:
    if v is None:
        return ""
    if kind == "string":
        return v if isinstance(v, str) else json_text(v)
    if kind == "boolean":
        return "true" if v is True else "false" if v is False else json_text(v)
    return json_text(v)


def num(v: Any) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def num_text(v: float) -> str:
    return str(int(v)) if isinstance(v, int) or float(v).is_integer() and abs(v) < 2**53 else repr(v)


# ------------------------------------------------------------------------------------------------ the request's schema
