"""Argument validation: a tool's arguments model, its JSON Schema check, and the fast paths for simple schemas.

What a call's arguments are checked against once the tool is declared (``ToolSpec.checked`` in ``_tools`` drives
it): the pydantic model built from the signature or the schema, the compiled Draft 2020-12 validator, and the
checks that let the arguments of the schemas most tools have skip both.

Example:
    >>> from undolog_core._validation import simple_checker
    >>> simple_checker({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})({"n": 1})
    True
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

from ._json import canonical_json
from .errors import ArgumentsInvalid, InvalidDeclaration
from .limits import depth_error


def build_args_model(name: str, fn: Callable[..., Any] | None, schema: Any = None) -> type[BaseModel]:
    """A pydantic model validating a call's keyword arguments, from the signature or a given schema."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema
    if isinstance(schema, Mapping):
        return _model_from_json_schema(name, schema)
    if fn is None:
        raise InvalidDeclaration(f"tool {name!r}: needs a function or an argument schema")
    sig = inspect.signature(fn)
    fields: dict[str, Any] = {}
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if pname in ("self", "cls"):
            continue
        ann = p.annotation if p.annotation is not inspect.Parameter.empty else Any
        default = p.default if p.default is not inspect.Parameter.empty else ...
        fields[pname] = (ann, default)
    hints = _resolved_hints(fn)
    for k in fields:
        if k in hints:
            fields[k] = (hints[k], fields[k][1])
    model: type[BaseModel] = create_model(
        f"{name}_args",
        __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True, ser_json_inf_nan="strings"),
        **fields,
    )
    return model


def _resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    try:
        # include_extras: Annotated[int, Field(ge=1)] keeps its bounds (stripped, they were silently not enforced).
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:
        return {}


_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}


@functools.lru_cache(maxsize=1024)
def _compiled(schema_text: str) -> Any:
    import jsonschema

    schema = json.loads(schema_text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_validator(name: str, schema: Mapping[str, Any]) -> Any:
    """The compiled Draft 2020-12 validator of a tool's JSON Schema, built once per schema (cached).

    Raises:
        InvalidDeclaration: the schema itself is not a valid JSON Schema.

    Example:
        >>> schema_validator("refund", {"type": "object"}).is_valid({"amount": 1})
        True
    """
    import jsonschema

    try:
        return _compiled(canonical_json(schema))
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidDeclaration(f"tool {name!r}: its args_schema is not a valid JSON Schema at {where}: "
                                 f"{exc.message}") from None


# Keywords a simple schema may use: what :func:`simply_valid` decides exactly. Anything else goes to jsonschema.
_SIMPLE_ROOT = frozenset({"type", "properties", "required", "additionalProperties", "title", "description",
                          "$schema", "default", "examples", "$comment"})
_SIMPLE_PROPERTY = frozenset({"type", "title", "description", "default", "examples", "$comment"})
_SIMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "null": (type(None),), "object": (dict,), "array": (list,),
    "number": (int, float), "integer": (int,),
}


def _simple_kinds(schema: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, tuple[type, ...] | None], bool] | None:
    """A simple schema's required properties, each property's Python types (None: anything goes) and whether extras
    are allowed; None when the schema uses anything else."""
    if schema.get("type", "object") != "object" or not set(schema) <= _SIMPLE_ROOT:
        return None
    extras = schema.get("additionalProperties", True)
    if not isinstance(extras, bool):
        return None
    required = schema.get("required", [])
    props = schema.get("properties", {})
    if not isinstance(required, list) or not isinstance(props, Mapping):
        return None
    kinds: dict[str, tuple[type, ...] | None] = {}
    for pname, p in props.items():
        if not isinstance(p, Mapping) or not set(p) <= _SIMPLE_PROPERTY:
            return None
        t = p.get("type")
        if t is None:
            kinds[pname] = None  # anything goes
            continue
        names = t if isinstance(t, list) else [t]
        if not all(isinstance(n, str) and n in _SIMPLE_TYPES for n in names):
            return None
        kinds[pname] = tuple(c for n in names for c in _SIMPLE_TYPES[n])
    return tuple(required), kinds, extras


def simple_checker(schema: Mapping[str, Any]) -> Callable[[Any], bool] | None:
    """A fast validity check for the schemas most tools have (typed properties, ``required``, extras allowed or
    not), or None when the schema uses anything else.

    It answers True only when jsonschema would (Draft 2020-12); False means "ask jsonschema", which also names
    the failing path. jsonschema itself costs tens to hundreds of microseconds a call; this, a few.

    Example:
        >>> simple_checker({"type": "object", "properties": {"n": {"type": "integer"}}})({"n": 1})
        True
    """
    parts = _simple_kinds(schema)
    if parts is None:
        return None
    needed, kinds, extras = parts

    def valid(args: Any) -> bool:
        if type(args) is not dict:
            return False
        for key in needed:
            if key not in args:
                return False
        for key, value in args.items():
            if key not in kinds:
                if not extras:
                    return False
                continue
            if not _of_kind(value, kinds[key]):
                return False
        return True

    return valid


def _typed_only(schema: Mapping[str, Any]) -> bool:
    """Whether every property of a simple schema names one JSON type (an ``as_is_copier`` then accepts only values
    of exact str/int/float/bool/None types: a loose property, no type or several, may hold any object)."""
    props = schema.get("properties", {})
    return all(isinstance(p, Mapping) and isinstance(p.get("type"), str) for p in props.values())


def _of_kind(value: Any, allowed: tuple[type, ...] | None) -> bool:
    """Whether ``value`` is of a simple schema property's JSON types (``allowed``: their Python types; None: any).
    bool is an int to Python but not a number to JSON Schema; a float integer (1.0) is left to jsonschema."""
    return allowed is None or (isinstance(value, allowed) and (type(value) is not bool or bool in allowed))


# The field types of an args model built from a simple schema (_model_from_json_schema, by _JSON_TYPES) that give a
# value of these exact types back unchanged. A float field converts an int, a dict or list field copies its value;
# an Any field (no type, or several) keeps whatever the schema allows.
_KEPT_AS_IS: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (float,), bool: (bool,),
                                            type(None): (type(None),)}


# dict subclasses, by class: whether they read as a dict (see _reads_as_dict). A program has few such classes.
_READS_AS_DICT: dict[type, bool] = {}
_DICT_READERS = ("items", "keys", "values", "__iter__", "__contains__", "__getitem__", "__len__")


# The dict subclasses known to read as a dict (those of _READS_AS_DICT that do): a set, so that the SAFE hot path asks
# with ``in``, not a method call.
_AS_DICT: set[type] = set()


def _reads_as_dict(cls: type) -> bool:
    """Whether a dict subclass overrides none of what reads its items (a framework's arguments, like Semantic
    Kernel's ``KernelArguments``): what :func:`as_is_checker` checks is then what a copy of it (``dict(args)``) holds."""
    known = _READS_AS_DICT.get(cls)
    if known is None:
        known = _READS_AS_DICT[cls] = all(getattr(cls, n) is getattr(dict, n) for n in _DICT_READERS)
        if known:
            _AS_DICT.add(cls)
    return known


def as_is_checker(schema: Mapping[str, Any]) -> Callable[[Any], bool] | None:
    """For a simple schema (see :func:`simple_checker`), a check that ``args`` are valid and that the args model built
    from the schema would give them back unchanged: the same keys, each value of a type its field keeps as it is.
    Such arguments need no model (see ``ToolSpec.checked``); any others (an int for a ``number``, an object, an
    array, an extra key...) say False and take the model. None when the schema is not simple.

    Example:
        >>> as_is_checker({"type": "object", "properties": {"x": {"type": "number"}}})({"x": 1})
        False
    """
    copier = as_is_copier(schema)
    if copier is None:
        return None
    return lambda args: copier(args) is not None


def as_is_copier(schema: Mapping[str, Any]) -> Callable[[Any], dict[str, Any] | None] | None:
    """:func:`as_is_checker` and the copy in one: a plain dict of ``args`` when the check says True, else None (the
    SAFE hot path's one call for it; see ``ToolSpec.as_is_copy``). None when the schema is not simple.

    Example:
        >>> as_is_copier({"type": "object", "properties": {"x": {"type": "string"}}})({"x": "a"})
        {'x': 'a'}
    """
    parts = _simple_kinds(schema)
    if parts is None:
        return None
    needed, kinds, _ = parts
    props = schema.get("properties", {})
    # Per property: the exact types kept as they are, or (an Any field: no type, or several) whatever the JSON
    # check allows (as in simple_checker). A key the schema does not name is in neither: the model decides (extras).
    exact: dict[str, tuple[type, ...]] = {}
    loose: dict[str, tuple[type, ...] | None] = {}
    for pname in kinds:
        t = props[pname].get("type")
        py = _JSON_TYPES.get(t, Any) if isinstance(t, str) else Any
        if py is Any:
            loose[pname] = kinds[pname]
        else:
            exact[pname] = _KEPT_AS_IS.get(py, ())
    required = frozenset(needed)
    as_dict = _AS_DICT  # (closure cells, not global look-ups: this is the SAFE hot path)
    no_type: tuple[type, ...] = ()
    # Most tools: every property required, each of exact types. Then arguments with as many keys as there are
    # properties, each property among them, hold exactly the properties: checked by looking each property up,
    # without an items view, a key view or a set comparison (the general loop below costs three times as much).
    fields = tuple(exact.items()) if required == frozenset(kinds) and not loose else None
    count = len(required)

    def as_is_copy(args: Any) -> dict[str, Any] | None:
        cls = type(args)
        # A dict subclass that reads as a dict (known by class after its first sight, see _reads_as_dict).
        if cls is not dict and cls not in as_dict and not (isinstance(args, dict) and _reads_as_dict(cls)):
            return None
        if fields is not None:
            if len(args) != count:
                return None
            for key, types in fields:
                try:
                    # (args[key], not ``key in args``: a dict subclass answers ``in`` through a Python-level slot)
                    if type(args[key]) not in types:
                        return None
                except KeyError:
                    return None
            return {**args}
        if required and not args.keys() >= required:
            return None
        for key, value in args.items():
            if type(value) not in exact.get(key, no_type) and (key not in loose or not _of_kind(value, loose[key])):
                return None
        # {**args}, not dict(args): for a dict subclass, dict() looks its ``keys`` attribute up first; both copy the
        # items as a dict holds them (what was just checked: the class overrides none of its readers).
        return {**args}

    return as_is_copy


def check_json_schema(name: str, schema: Mapping[str, Any], args: Any, validator: Any = None) -> None:
    """Validate ``args`` against the tool's full JSON Schema (Draft 2020-12); every failure names its path.

    Raises:
        ArgumentsInvalid: one entry per failing path (``loc``), with the schema keyword that failed (``type``).
    """
    validator = validator or schema_validator(name, schema)
    try:
        found = sorted(validator.iter_errors(args), key=lambda e: [str(p) for p in e.absolute_path])
    except RecursionError:
        raise ArgumentsInvalid(name, [depth_error([])]) from None
    if found:
        raise ArgumentsInvalid(name, [
            {"loc": [*e.absolute_path, *_missing(e)], "msg": e.message, "type": f"schema.{e.validator}"}
            for e in found
        ])


def _missing(e: Any) -> list[Any]:
    # A missing required property is reported on its parent; name the property itself.
    if e.validator == "required" and isinstance(e.instance, Mapping):
        missing = [p for p in e.validator_value if p not in e.instance]
        return missing[:1]
    return []


def _model_from_json_schema(name: str, schema: Mapping[str, Any]) -> type[BaseModel]:
    """Enough of JSON Schema for tool arguments: typed properties, required, no extras.

    The full schema is still stored in the contract, so the fingerprint covers all of it.
    """
    props = schema.get("properties", {}) or {}
    required = set(schema.get("required", []) or [])
    fields: dict[str, Any] = {}
    for pname, pschema in props.items():
        t = pschema.get("type") if isinstance(pschema, Mapping) else None
        py: Any = _JSON_TYPES.get(t, Any) if isinstance(t, str) else Any
        # An optional property may be left out; it is never invented as null (see ToolSpec.sparse).
        fields[pname] = (py, ...) if pname in required else (py | None, None)
    extra: Literal["allow", "forbid"] = "allow" if schema.get("additionalProperties", False) else "forbid"
    model: type[BaseModel] = create_model(
        f"{name}_args", __config__=ConfigDict(extra=extra, strict=False, ser_json_inf_nan="strings"), **fields
    )
    model.__undolog_json_schema__ = dict(schema)  # type: ignore[attr-defined]
    # The model only types the properties; the compiled JSON Schema checks everything else (enum, bounds, pattern,
    # items, nested objects...), on agent input and on every edit.
    model.__undolog_validator__ = schema_validator(name, schema)  # type: ignore[attr-defined]
    return model


def json_schema_of(model: type[BaseModel]) -> dict[str, Any]:
    given = getattr(model, "__undolog_json_schema__", None)
    if isinstance(given, dict):
        return given
    try:
        return model.model_json_schema()
    except Exception:
        # Arbitrary types have no JSON schema; the field names still go into the fingerprint.
        return {"title": model.__name__, "properties": {k: {} for k in model.model_fields}}
