"""Edit forms generated from a tool's JSON Schema: one generator for the dashboard, Slack modals and email pages.

An approver who modifies a request edits the tool's arguments. Instead of raw JSON, :func:`build` turns the tool's
arguments schema into form fields, :func:`parse` turns what was submitted back into arguments (validated against
the same schema with ``jsonschema``; every error names its field), and :func:`diff` lists what the edit changes
against the proposed arguments, so the approver sees the change before submitting it.

What gets an input of its own:

- ``enum`` (and ``const``): a choice among the listed values (each option's value is the value's JSON text);
- ``integer`` / ``number``: a number input, with ``minimum``, ``maximum`` (and exclusive ones) and ``multipleOf``;
- ``boolean``: a choice of ``true`` / ``false`` (and "not set" when the field is optional);
- ``string``: a text input, with ``pattern``, ``minLength`` and ``maxLength`` shown and checked;
- an ``object`` with ``properties``, nested up to ``max_depth`` levels: a group of the fields above;
- an ``array`` of one of the scalars above: one item per line.

Anything else (``oneOf``, tuples, arrays of objects, objects deeper than ``max_depth`` or without properties,
a ``$ref`` that is not local) falls back to a JSON text field, validated against its part of the schema. A field
whose schema is ``anyOf`` / a type list of one kind and ``null`` is that kind, nullable (what pydantic writes for
``Optional[X]``); local ``$ref`` s (``#/$defs/...``) are followed.

Every field's input is named by a JSON Pointer to the argument (``/amount``, ``/address/city``), so a submitted
mapping ``{name: text}`` is all :func:`parse` needs, whatever the channel: an HTML form's fields, a Slack modal's
``view.state.values`` flattened to ``{block_id: value}``, an email confirmation page's POST.

Example:
    >>> schema = {"type": "object", "required": ["to", "amount"], "properties": {
    ...     "to": {"type": "string", "pattern": "^[a-z]+$"},
    ...     "amount": {"type": "number", "minimum": 0, "maximum": 100},
    ...     "currency": {"enum": ["EUR", "USD"]}}}
    >>> form = build(schema, {"to": "acme", "amount": 10.0, "currency": "EUR"})
    >>> [(f.name, f.kind, f.value) for f in form.fields]
    [('/to', 'string', 'acme'), ('/amount', 'number', '10.0'), ('/currency', 'enum', '"EUR"')]
    >>> edited = parse(schema, {"/to": "acme", "/amount": "90", "/currency": '"USD"'})
    >>> edited
    {'to': 'acme', 'amount': 90, 'currency': 'USD'}
    >>> [(c.name, c.before, c.after) for c in diff({"to": "acme", "amount": 10.0, "currency": "EUR"}, edited)]
    [('/amount', 10.0, 90), ('/currency', 'EUR', 'USD')]
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from undolog_core.errors import UndoLogError

__all__ = [
    "MAX_DEPTH",
    "WHOLE",
    "Change",
    "FieldError",
    "FieldKind",
    "Form",
    "FormField",
    "FormInvalid",
    "build",
    "diff",
    "dom_id",
    "parse",
    "pointer",
]

#: How many levels of nested objects get fields of their own (the arguments object itself is level 0); a deeper
#: object is edited as JSON.
MAX_DEPTH = 3

#: The input name of the one JSON field a form falls back to when the arguments schema is not an object with
#: properties (a pointer to the whole would be ``""``, a name an HTML form does not submit).
WHOLE = "args"

FieldKind = Literal["enum", "integer", "number", "boolean", "string", "array", "object", "json"]

_SCALARS = ("enum", "integer", "number", "boolean", "string")
#: The absent marker of :func:`_parse_field` (None is a value: JSON null).
_ABSENT: Any = object()


class FormInvalid(UndoLogError):
    """Values submitted through a generated edit form (dashboard, Slack modal, email page) do not fit the tool's
    arguments schema: a number that is not one, a value outside its bounds, a string not matching its pattern, a
    JSON field that does not parse.

    Fix:
        Read ``errors``: each names the field (its label and its ``name``, a JSON Pointer to the argument) and what
        is wrong with it. Correct those fields and submit again; nothing was decided.

    Example:
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
            return _num_text(self.multiple_of)
        return "1" if self.kind == "integer" else "any"

    @property
    def hint(self) -> str:
        """The constraints in words (bounds, pattern, lengths, items), for a help text under the input."""
        parts: list[str] = []
        if self.minimum is not None:
            parts.append(f"at least {_num_text(self.minimum)}")
        if self.exclusive_minimum is not None:
            parts.append(f"more than {_num_text(self.exclusive_minimum)}")
        if self.maximum is not None:
            parts.append(f"at most {_num_text(self.maximum)}")
        if self.exclusive_maximum is not None:
            parts.append(f"less than {_num_text(self.exclusive_maximum)}")
        if self.multiple_of is not None:
            parts.append(f"a multiple of {_num_text(self.multiple_of)}")
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


@dataclass(frozen=True)
class Form:
    """A generated form: its top-level fields and the schema it came from.

    Example:
        >>> form = build({"type": "object", "properties": {"a": {"type": "object", "properties": {
        ...     "b": {"type": "boolean"}}}}}, {"a": {"b": True}})
        >>> [(f.name, f.kind, f.value) for f in form.leaves()]
        [('/a/b', 'boolean', 'true')]
    """

    fields: tuple[FormField, ...]
    schema: Mapping[str, Any]
    max_depth: int = MAX_DEPTH

    def leaves(self) -> list[FormField]:
        """Every field that has an input (objects replaced by their children, depth first): a flat form's fields,
        e.g. a Slack modal's input blocks."""
        out: list[FormField] = []

        def walk(fs: tuple[FormField, ...]) -> None:
            for f in fs:
                if f.kind == "object":
                    walk(f.children)
                else:
                    out.append(f)

        walk(self.fields)
        return out

    def parse(self, submitted: Mapping[str, Any], original: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """:func:`parse` with this form's schema and depth."""
        return parse(self.schema, submitted, original=original, max_depth=self.max_depth)


@dataclass(frozen=True)
class Change:
    """One difference between the proposed and the edited arguments.

    Attributes:
        path: The argument's path (keys).
        name: Its JSON Pointer (the form field's name when it has one).
        kind: ``changed``, ``added`` or ``removed``.
        before: The proposed value (None when added).
        after: The edited value (None when removed).
    """

    path: tuple[str, ...]
    name: str
    kind: Literal["changed", "added", "removed"]
    before: Any = None
    after: Any = None

    @property
    def before_text(self) -> str:
        """The proposed value as JSON text (``""`` when added)."""
        return "" if self.kind == "added" else _json_text(self.before)

    @property
    def after_text(self) -> str:
        """The edited value as JSON text (``""`` when removed)."""
        return "" if self.kind == "removed" else _json_text(self.after)


# ------------------------------------------------------------------------------------------------ names


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


# ------------------------------------------------------------------------------------------------ build


def build(schema: Mapping[str, Any], values: Mapping[str, Any] | None = None, *, max_depth: int = MAX_DEPTH) -> Form:
    """Turn a tool's arguments schema into form fields, filled with ``values``.

    Args:
        schema: The tool's JSON Schema for its arguments (an ``object``; anything else gives one JSON field for
            the whole arguments object).
        values: The arguments to show (the proposed ones, or an edit being corrected).
        max_depth: Levels of nested objects that get fields of their own; deeper ones are JSON fields.

    Returns:
        The form; its fields follow the schema's ``properties`` order, then any argument in ``values`` the schema
        does not name (as a JSON field, so nothing proposed is hidden from the approver).

    Example:
        >>> build({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}},
        ...       {"tags": ["a", "b"]}).fields[0].value
        'a\\nb'
    """
    values = dict(values or {})
    root = dict(schema or {})
    resolved = _resolve(root, root)
    if _type_of(resolved)[0] != "object" or not isinstance(resolved.get("properties"), Mapping):
        whole = FormField(name=WHOLE, path=(), label="arguments", kind="json", required=True, value=_json_text(values),
                          present=True, schema=resolved, fallback_reason="the arguments schema is not an object with "
                          "properties")
        return Form((whole,), root, max_depth)
    return Form(tuple(_object_fields(root, resolved, (), values, 1, max_depth)), root, max_depth)


def _object_fields(root: Mapping[str, Any], schema: Mapping[str, Any], path: tuple[str, ...],
                   values: Mapping[str, Any], depth: int, max_depth: int) -> list[FormField]:
    props: Mapping[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    out = [_field(root, sub if isinstance(sub, Mapping) else {}, (*path, str(key)), key in required,
                  values.get(key, _ABSENT), depth, max_depth)
           for key, sub in props.items()]
    extra = [k for k in values if k not in props]
    extra_schema = schema.get("additionalProperties")
    for key in extra:
        sub = extra_schema if isinstance(extra_schema, Mapping) else {}
        out.append(_json_field(root, sub, (*path, str(key)), False, values[key],
                               "an argument the schema does not name"))
    return out


def _field(root: Mapping[str, Any], raw: Mapping[str, Any], path: tuple[str, ...], required: bool, value: Any,
           depth: int, max_depth: int) -> FormField:
    try:
        schema = _resolve(root, raw)
    except _Unrenderable as exc:
        return _json_field(root, raw, path, required, value, str(exc))
    schema, nullable = _unwrap_nullable(root, schema)
    kind, why = _kind(schema, depth, max_depth)
    if kind == "json":
        return _json_field(root, schema, path, required, value, why, nullable=nullable)
    present = value is not _ABSENT
    base: dict[str, Any] = {
        "name": pointer(path), "path": path, "label": str(schema.get("title") or " › ".join(path)),
        "kind": kind, "required": required, "nullable": nullable,
        "description": schema.get("description") if isinstance(schema.get("description"), str) else None,
        "present": present, "schema": schema,
    }
    if kind == "object":
        children = _object_fields(root, schema, path, value if isinstance(value, Mapping) else {}, depth + 1,
                                  max_depth)
        return FormField(**base, children=tuple(children))
    if kind == "array":
        items = _resolve(root, schema.get("items") or {})
        item_kind = _scalar_kind(items)
        shown = "\n".join(_item_text(v) for v in value) if present and isinstance(value, list) else ""
        return FormField(**base, value=shown, item_kind=item_kind,
                         item_options=tuple(_item_text(v) for v in items.get("enum", ())) if item_kind == "enum" else (),
                         min_items=_int_or_none(schema.get("minItems")), max_items=_int_or_none(schema.get("maxItems")),
                         min_length=_int_or_none(items.get("minLength")), max_length=_int_or_none(items.get("maxLength")),
                         pattern=items.get("pattern") if isinstance(items.get("pattern"), str) else None)
    shown = _scalar_text(kind, value) if present else ""
    if kind == "enum":
        choices = list(schema["enum"]) if "enum" in schema else [schema["const"]]
        return FormField(**base, value=shown, options=tuple((_json_text(c), _label_of(c)) for c in choices))
    if kind == "boolean":
        return FormField(**base, value=shown, options=(("true", "true"), ("false", "false")))
    if kind in ("integer", "number"):
        return FormField(**base, value=shown, minimum=_num(schema.get("minimum")), maximum=_num(schema.get("maximum")),
                         exclusive_minimum=_num(schema.get("exclusiveMinimum")),
                         exclusive_maximum=_num(schema.get("exclusiveMaximum")),
                         multiple_of=_num(schema.get("multipleOf")))
    return FormField(**base, value=shown, pattern=schema.get("pattern") if isinstance(schema.get("pattern"), str) else None,
                     min_length=_int_or_none(schema.get("minLength")), max_length=_int_or_none(schema.get("maxLength")))


def _json_field(root: Mapping[str, Any], schema: Mapping[str, Any], path: tuple[str, ...], required: bool,
                value: Any, why: str, *, nullable: bool = False) -> FormField:
    present = value is not _ABSENT
    title = schema.get("title") if isinstance(schema, Mapping) else None
    return FormField(
        name=pointer(path), path=path, label=str(title or " › ".join(path)), kind="json", required=required,
        nullable=nullable, description=schema.get("description") if isinstance(schema.get("description"), str) else None,
        value=json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) if present else "", present=present,
        schema=schema, fallback_reason=why,
    )


class _Unrenderable(Exception):
    pass


def _resolve(root: Mapping[str, Any], schema: Any, seen: int = 0) -> dict[str, Any]:
    """Follow a local ``$ref`` (``#/...``); the referring schema's other keywords are laid over the target."""
    if not isinstance(schema, Mapping):
        return {}
    ref = schema.get("$ref")
    if ref is None:
        return dict(schema)
    if not isinstance(ref, str) or not ref.startswith("#") or seen > 16:
        raise _Unrenderable(f"the reference {ref!r} is not a local one the form can follow")
    target: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, Mapping) or part not in target:
            raise _Unrenderable(f"the reference {ref!r} names nothing in the schema")
        target = target[part]
    merged = {**_resolve(root, target, seen + 1), **{k: v for k, v in schema.items() if k != "$ref"}}
    return merged


def _unwrap_nullable(root: Mapping[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``anyOf: [X, {type: null}]`` and ``type: [T, "null"]`` are X (or T), nullable."""
    any_of = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(any_of, list) and len(any_of) == 2:
        nulls = [s for s in any_of if isinstance(s, Mapping) and s.get("type") == "null"]
        others = [s for s in any_of if not (isinstance(s, Mapping) and s.get("type") == "null")]
        if len(nulls) == 1 and len(others) == 1:
            try:
                inner = _resolve(root, others[0])
            except _Unrenderable:
                return schema, False
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            return {**inner, **rest}, True
    types = schema.get("type")
    if isinstance(types, list) and "null" in types and len(types) == 2:
        return {**schema, "type": next(t for t in types if t != "null")}, True
    if isinstance(schema.get("enum"), list) and None in schema["enum"] and len(schema["enum"]) > 1:
        return {**schema, "enum": [v for v in schema["enum"] if v is not None]}, True
    return schema, False


def _type_of(schema: Mapping[str, Any]) -> tuple[str | None, bool]:
    t = schema.get("type")
    if isinstance(t, str):
        return t, True
    if t is None:
        if isinstance(schema.get("properties"), Mapping):
            return "object", True
        return None, True
    return None, False


def _scalar_kind(schema: Mapping[str, Any]) -> str | None:
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "$ref", "if")):
        return None
    if "enum" in schema or "const" in schema:
        return "enum"
    t, _ = _type_of(schema)
    return t if t in ("integer", "number", "boolean", "string") else None


def _kind(schema: Mapping[str, Any], depth: int, max_depth: int) -> tuple[FieldKind, str]:
    scalar = _scalar_kind(schema)
    if scalar is not None:
        return scalar, ""  # type: ignore[return-value]
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "if")):
        return "json", "a choice of schemas (anyOf/oneOf/allOf) has no single input"
    t, _ = _type_of(schema)
    if t == "object":
        if not isinstance(schema.get("properties"), Mapping) or not schema["properties"]:
            return "json", "an object without named properties"
        if depth > max_depth:
            return "json", f"an object nested deeper than {max_depth} levels"
        return "object", ""
    if t == "array":
        items = schema.get("items")
        if not isinstance(items, Mapping) or "prefixItems" in schema:
            return "json", "an array without one item schema"
        if _scalar_kind(items) is None:
            return "json", "an array whose items are not numbers, strings, booleans or choices"
        return "array", ""
    return "json", "a value of no single type"


# ------------------------------------------------------------------------------------------------ parse


def parse(schema: Mapping[str, Any], submitted: Mapping[str, Any], *, original: Mapping[str, Any] | None = None,
          max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """Turn submitted form values back into arguments and validate them against the schema.

    Args:
        schema: The same schema the form was built from.
        submitted: ``{field name: text}`` (a list of texts counts as its last one). A field that is missing or
            empty is left out of the arguments when it is optional (null when it is nullable and was present);
            an optional boolean's ``""`` means "not set". Names the form does not have are ignored.
        original: The arguments the form was built from (the proposed ones): an optional field they held stays
            in the edit as an empty value rather than vanishing (an empty string stays ``""``, null stays null).
        max_depth: As given to :func:`build`.

    Returns:
        The edited arguments.

    Raises:
        FormInvalid: A value that does not parse (a number, a boolean, a choice, JSON) or the result does not
            validate against ``schema``; every error names its field.

    Example:
        >>> parse({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer",
        ...        "maximum": 5}}}, {"/ok": "true", "/n": "9"})
        Traceback (most recent call last):
        ...
        undolog_server.forms.FormInvalid: the edited arguments are invalid: n: 9 is greater than the maximum of 5. ...
    """
    original = dict(original or {})
    form = build(schema, original, max_depth=max_depth)
    texts = {str(k): _text_of(v) for k, v in submitted.items()}
    problems: list[FieldError] = []
    out: dict[str, Any] = {}
    for f in form.fields:
        value = _parse_field(f, texts, problems)
        if f.path == ():
            # The whole arguments object is one JSON field.
            if value is not _ABSENT:
                if isinstance(value, dict):
                    out = value
                else:
                    problems.append(FieldError(WHOLE, (), "arguments: must be a JSON object"))
            continue
        if value is not _ABSENT:
            out[f.path[-1]] = value
    if problems:
        raise FormInvalid(problems)
    _validate(form, schema, out)
    return out


def _text_of(v: Any) -> str | None:
    if isinstance(v, list | tuple):
        v = v[-1] if v else None
    if v is None:
        return None
    return str(v)


def _parse_field(f: FormField, texts: Mapping[str, str | None], problems: list[FieldError]) -> Any:
    if f.kind == "object":
        obj: dict[str, Any] = {}
        for child in f.children:
            v = _parse_field(child, texts, problems)
            if v is not _ABSENT:
                obj[child.path[-1]] = v
        if not obj and not f.required and not f.present:
            return _ABSENT
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
        return _ABSENT


def _empty(f: FormField) -> Any:
    """An empty input: null when nullable (and required or present before), ``""``/``[]`` for a string or an
    array the arguments held or require, else the field is left out."""
    if f.nullable and (f.required or f.present):
        return None
    if f.kind == "string" and (f.required or (f.present and f.value == "")):
        return ""
    if f.kind == "array" and (f.required or f.present):
        return []
    return _ABSENT


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
        if choices is not None and _json_text(value) not in choices:
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


def _validate(form: Form, schema: Mapping[str, Any], args: dict[str, Any]) -> None:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema)
    names = {tuple(f.path): f for f in _all_fields(form.fields)}
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


# ------------------------------------------------------------------------------------------------ diff


def diff(proposed: Mapping[str, Any], edited: Mapping[str, Any]) -> list[Change]:
    """What an edit changes against the proposed arguments, key by key (nested objects compared inside; arrays
    and other values as a whole), in the proposed arguments' key order, then added keys.

    Example:
        >>> [(c.name, c.kind) for c in diff({"a": 1, "b": {"c": 2}}, {"b": {"c": 3}, "d": True})]
        [('/a', 'removed'), ('/b/c', 'changed'), ('/d', 'added')]
    """
    out: list[Change] = []
    _diff((), proposed, edited, out)
    return out


def _diff(path: tuple[str, ...], before: Mapping[str, Any], after: Mapping[str, Any], out: list[Change]) -> None:
    for key in before:
        p = (*path, str(key))
        if key not in after:
            out.append(Change(p, pointer(p), "removed", before[key], None))
        elif isinstance(before[key], Mapping) and isinstance(after[key], Mapping):
            _diff(p, before[key], after[key], out)
        elif not _same(before[key], after[key]):
            out.append(Change(p, pointer(p), "changed", before[key], after[key]))
    for key in after:
        if key not in before:
            p = (*path, str(key))
            out.append(Change(p, pointer(p), "added", None, after[key]))


def _same(a: Any, b: Any) -> bool:
    # 1 and 1.0 are one JSON number, but True is not 1: compare by type family and value.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b) and (isinstance(a, int | float) == isinstance(b, int | float))


# ------------------------------------------------------------------------------------------------ text


def _json_text(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


def _label_of(v: Any) -> str:
    return v if isinstance(v, str) else _json_text(v)


def _item_text(v: Any) -> str:
    return v if isinstance(v, str) else _json_text(v)


def _scalar_text(kind: str, v: Any) -> str:
    if v is None:
        return ""
    if kind == "string":
        return v if isinstance(v, str) else _json_text(v)
    if kind == "boolean":
        return "true" if v is True else "false" if v is False else _json_text(v)
    return _json_text(v)


def _num(v: Any) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num_text(v: float) -> str:
    return str(int(v)) if isinstance(v, int) or float(v).is_integer() and abs(v) < 2**53 else repr(v)


# ------------------------------------------------------------------------------------------------ the request's schema


def request_schema(undolog: Any, tool_name: str, revision: int | None = None) -> dict[str, Any]:
    """The arguments schema a request's edit is checked against: that of the tool's revision the request was raised
    under (read from the registry, so a process without the tool loaded builds the same form).

    Args:
        undolog: The open ``UndoLog``.
        tool_name: The request's tool.
        revision: The request's ``tool_revision`` (the newest when None).

    Returns:
        The schema (``{}`` when the registry holds none: the form is then one JSON field).

    Example:
        >>> form = build(request_schema(undolog, rec.tool_name, rec.tool_revision), rec.proposed_args)
    """
    rows = undolog.registry.history(tool_name)
    rows = [r for r in rows if revision is None or int(r["revision"]) == int(revision)]
    if not rows:
        return {}
    row = max(rows, key=lambda r: int(r["revision"]))
    contract = row.get("contract") or {}
    schema = contract.get("args_schema") if isinstance(contract, Mapping) else None
    return dict(schema) if isinstance(schema, Mapping) else {}
