"""A generated form: :func:`build` (a schema and values into fields) and :func:`parse` (submitted texts back into
validated arguments), the two ends of one edit.

Example:
    >>> schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
    >>> form = build(schema, {"n": 3})
    >>> [(f.name, f.value) for f in form.fields], parse(schema, {"/n": "4"})
    ([('/n', '3')], {'n': 4})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .fields import ABSENT, MAX_DEPTH, WHOLE, FieldError, FormField, FormInvalid, json_text
from .schema import object_fields, resolve, type_of
from .values import parse_field, text_of, validate

__all__ = ["Form", "build", "parse"]


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
    resolved = resolve(root, root)
    if type_of(resolved)[0] != "object" or not isinstance(resolved.get("properties"), Mapping):
        whole = FormField(name=WHOLE, path=(), label="arguments", kind="json", required=True, value=json_text(values),
                          present=True, schema=resolved, fallback_reason="the arguments schema is not an object with "
                          "properties")
        return Form((whole,), root, max_depth)
    return Form(tuple(object_fields(root, resolved, (), values, 1, max_depth)), root, max_depth)


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
        undolog_server.forms.fields.FormInvalid: the edited arguments are invalid: n: 9 is greater than the maximum of 5. ...
    """
    original = dict(original or {})
    form = build(schema, original, max_depth=max_depth)
    texts = {str(k): text_of(v) for k, v in submitted.items()}
    problems: list[FieldError] = []
    out: dict[str, Any] = {}
    for f in form.fields:
        value = parse_field(f, texts, problems)
        if f.path == ():
            # The whole arguments object is one JSON field.
            if value is not ABSENT:
                if isinstance(value, dict):
                    out = value
                else:
                    problems.append(FieldError(WHOLE, (), "arguments: must be a JSON object"))
            continue
        if value is not ABSENT:
            out[f.path[-1]] = value
    if problems:
        raise FormInvalid(problems)
    validate(form.fields, schema, out)
    return out
