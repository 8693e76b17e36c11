"""Reading a tool's JSON Schema into form fields: local ``$ref`` s followed, nullable unions unwrapped, each
property given the input its kind allows (or a JSON field, with the reason); and a request's schema from the registry.

Example:
    >>> [(f.name, f.kind) for f in object_fields({}, {"properties": {"n": {"type": "integer"}}}, (), {}, 1, 3)]
    [('/n', 'integer')]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .fields import (
    ABSENT,
    FieldKind,
    FormField,
    int_or_none,
    item_text,
    json_text,
    label_of,
    num,
    pointer,
    scalar_text,
)

__all__ = ["object_fields", "request_schema", "resolve", "type_of"]


def object_fields(root: Mapping[str, Any], schema: Mapping[str, Any], path: tuple[str, ...],
                  values: Mapping[str, Any], depth: int, max_depth: int) -> list[FormField]:
    """The fields of an object schema's properties (in their order), then a JSON field per value it does not name.

    Example:
        >>> [f.name for f in object_fields({}, {"properties": {"a": {"type": "string"}}}, (), {"b": 1}, 1, 3)]
        ['/a', '/b']
    """
    props: Mapping[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    out = [_field(root, sub if isinstance(sub, Mapping) else {}, (*path, str(key)), key in required,
                  values.get(key, ABSENT), depth, max_depth)
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
        schema = resolve(root, raw)
    except _Unrenderable as exc:
        return _json_field(root, raw, path, required, value, str(exc))
    schema, nullable = _unwrap_nullable(root, schema)
    kind, why = _kind(schema, depth, max_depth)
    if kind == "json":
        return _json_field(root, schema, path, required, value, why, nullable=nullable)
    present = value is not ABSENT
    base: dict[str, Any] = {
        "name": pointer(path), "path": path, "label": str(schema.get("title") or " › ".join(path)),
        "kind": kind, "required": required, "nullable": nullable,
        "description": schema.get("description") if isinstance(schema.get("description"), str) else None,
        "present": present, "schema": schema,
    }
    if kind == "object":
        children = object_fields(root, schema, path, value if isinstance(value, Mapping) else {}, depth + 1,
                                 max_depth)
        return FormField(**base, children=tuple(children))
    if kind == "array":
        items = resolve(root, schema.get("items") or {})
        item_kind = _scalar_kind(items)
        shown = "\n".join(item_text(v) for v in value) if present and isinstance(value, list) else ""
        return FormField(**base, value=shown, item_kind=item_kind,
                         item_options=tuple(item_text(v) for v in items.get("enum", ())) if item_kind == "enum" else (),
                         min_items=int_or_none(schema.get("minItems")), max_items=int_or_none(schema.get("maxItems")),
                         min_length=int_or_none(items.get("minLength")), max_length=int_or_none(items.get("maxLength")),
                         pattern=items.get("pattern") if isinstance(items.get("pattern"), str) else None)
    shown = scalar_text(kind, value) if present else ""
    if kind == "enum":
        choices = list(schema["enum"]) if "enum" in schema else [schema["const"]]
        return FormField(**base, value=shown, options=tuple((json_text(c), label_of(c)) for c in choices))
    if kind == "boolean":
        return FormField(**base, value=shown, options=(("true", "true"), ("false", "false")))
    if kind in ("integer", "number"):
        return FormField(**base, value=shown, minimum=num(schema.get("minimum")), maximum=num(schema.get("maximum")),
                         exclusive_minimum=num(schema.get("exclusiveMinimum")),
                         exclusive_maximum=num(schema.get("exclusiveMaximum")),
                         multiple_of=num(schema.get("multipleOf")))
    return FormField(**base, value=shown, pattern=schema.get("pattern") if isinstance(schema.get("pattern"), str) else None,
                     min_length=int_or_none(schema.get("minLength")), max_length=int_or_none(schema.get("maxLength")))


def _json_field(root: Mapping[str, Any], schema: Mapping[str, Any], path: tuple[str, ...], required: bool,
                value: Any, why: str, *, nullable: bool = False) -> FormField:
    present = value is not ABSENT
    title = schema.get("title") if isinstance(schema, Mapping) else None
    return FormField(
        name=pointer(path), path=path, label=str(title or " › ".join(path)), kind="json", required=required,
        nullable=nullable, description=schema.get("description") if isinstance(schema.get("description"), str) else None,
        value=json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) if present else "", present=present,
        schema=schema, fallback_reason=why,
    )


class _Unrenderable(Exception):
    pass


def resolve(root: Mapping[str, Any], schema: Any, seen: int = 0) -> dict[str, Any]:
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
    merged = {**resolve(root, target, seen + 1), **{k: v for k, v in schema.items() if k != "$ref"}}
    return merged


def _unwrap_nullable(root: Mapping[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``anyOf: [X, {type: null}]`` and ``type: [T, "null"]`` are X (or T), nullable."""
    any_of = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(any_of, list) and len(any_of) == 2:
        nulls = [s for s in any_of if isinstance(s, Mapping) and s.get("type") == "null"]
        others = [s for s in any_of if not (isinstance(s, Mapping) and s.get("type") == "null")]
        if len(nulls) == 1 and len(others) == 1:
            try:
                inner = resolve(root, others[0])
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


def type_of(schema: Mapping[str, Any]) -> tuple[str | None, bool]:
    """The schema's one ``type`` (an object when it only has ``properties``), and False when it has several.

    Example:
        >>> type_of({"properties": {}}), type_of({"type": ["string", "integer"]})
        (('object', True), (None, False))
    """
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
    t, _ = type_of(schema)
    return t if t in ("integer", "number", "boolean", "string") else None


def _kind(schema: Mapping[str, Any], depth: int, max_depth: int) -> tuple[FieldKind, str]:
    scalar = _scalar_kind(schema)
    if scalar is not None:
        return scalar, ""  # type: ignore[return-value]
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "if")):
        return "json", "a choice of schemas (anyOf/oneOf/allOf) has no single input"
    t, _ = type_of(schema)
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
        >>> from undolog_server.forms import build
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
