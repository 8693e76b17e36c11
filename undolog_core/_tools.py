"""Declarations: tiers, ``@undolog_tool``, ``@compensation`` and the contract fingerprint."""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any, Literal, TypeVar, cast

import pydantic
import pydantic_core
from pydantic import BaseModel, ConfigDict, create_model
from pydantic_core import to_json, to_jsonable_python

from .errors import ArgumentsInvalid, InvalidDeclaration
from .limits import MAX_ID_LENGTH, bad_string, depth_error, encodes, surrogate_error, too_deep

F = TypeVar("F", bound=Callable[..., Any])

RESERVED_PARAMS = frozenset({"call_id"})


class ToolTier(enum.StrEnum):
    """The three tiers. Values are what the database stores.

    Example:
        >>> ToolTier.from_risk_level("high")
        <ToolTier.IRREVERSIBLE: 'irreversible'>
    """

    SAFE = "safe"
    COMPENSABLE = "compensable"
    IRREVERSIBLE = "irreversible"

    @property
    def risk_level(self) -> str:
        return _TIER_TO_RISK[self]

    @property
    def rank(self) -> int:
        return _RANK[self]

    @classmethod
    def from_risk_level(cls, level: str) -> ToolTier:
        try:
            return _RISK_TO_TIER[level]
        except KeyError:
            raise InvalidDeclaration(
                f"unknown risk_level {level!r}: use 'low' (SAFE), 'medium' (COMPENSABLE) or 'high' (IRREVERSIBLE)"
            ) from None

    @classmethod
    def coerce(cls, value: ToolTier | str) -> ToolTier:
        if isinstance(value, ToolTier):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise InvalidDeclaration(
                f"unknown tier {value!r}: use 'safe', 'compensable' or 'irreversible'"
            ) from None


_NO_IRREVERSIBLE_RETRY = (
    "an IRREVERSIBLE tool takes no retry policy: a person approved one run, and a blind retry could do it twice "
    "(give the tool a probe, and let a person decide again)"
)

_TIER_TO_RISK = {ToolTier.SAFE: "low", ToolTier.COMPENSABLE: "medium", ToolTier.IRREVERSIBLE: "high"}
_RISK_TO_TIER = {v: k for k, v in _TIER_TO_RISK.items()}
_RANK = {ToolTier.SAFE: 0, ToolTier.COMPENSABLE: 1, ToolTier.IRREVERSIBLE: 2}


@dataclass(frozen=True)
class CompensationDescriptor:
    """Names the compensation of a COMPENSABLE tool; the version must match the registered one.

    Example:
        >>> CompensationDescriptor.new("cancel_refund_email")
        CompensationDescriptor(name='cancel_refund_email', version=1)
    """

    name: str
    version: int = 1

    @classmethod
    def new(cls, name: str, version: int = 1) -> CompensationDescriptor:
        if not name or not isinstance(name, str):
            raise InvalidDeclaration("a compensation needs a non-empty name")
        if not isinstance(version, int) or version < 1:
            raise InvalidDeclaration(f"compensation {name!r}: version must be a positive integer, got {version!r}")
        return cls(name, version)


@dataclass(frozen=True)
class RetryPolicy:
    """How often UndoLog retries a SAFE or COMPENSABLE tool that raised, before the call counts as failed.

    Every attempt runs under the same effect and the same idempotency key (``do-{effect_id}``), so an API that
    honours the key applies the call once however many attempts it took; ``current_call().attempt`` says which
    attempt is running. Only the exceptions in ``on`` are retried; after the last attempt the call fails as usual
    (recorded, the session rolled back per its policy). IRREVERSIBLE tools take no retry policy: a person approved
    one run, and a blind second one could do the irreversible thing twice.

    Args:
        attempts: attempts in all, the first one included (``1`` = no retry).
        backoff: seconds before the first retry; each later wait is ``factor`` times longer, at most ``max_backoff``.
        on: the exception classes worth retrying (default: any ``Exception``).

    Example:
        >>> @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="cancel_refund_email",
        ...               retry=RetryPolicy(attempts=3, backoff=0.2, on=(TimeoutError, ConnectionError)))
        ... def send_refund_email(user_id: str, amount: float) -> dict: ...
    """

    attempts: int = 3
    backoff: float = 0.5
    factor: float = 2.0
    max_backoff: float = 30.0
    on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise InvalidDeclaration(f"retry: attempts must be a positive integer (the first included), "
                                     f"got {self.attempts!r}")
        for fname in ("backoff", "factor", "max_backoff"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidDeclaration(f"retry: {fname} must be a number of seconds >= 0, got {value!r}")
        if self.factor < 1:
            raise InvalidDeclaration(f"retry: factor must be >= 1 (waits never shrink), got {self.factor!r}")
        on = (self.on,) if isinstance(self.on, type) else tuple(self.on)
        if not on or not all(isinstance(c, type) and issubclass(c, BaseException) for c in on):
            raise InvalidDeclaration(f"retry: on must be exception classes, got {self.on!r}")
        object.__setattr__(self, "on", on)

    @classmethod
    def coerce(cls, value: RetryPolicy | int | None) -> RetryPolicy | None:
        """A ``RetryPolicy``, or ``retry=3`` as shorthand for three attempts with the default backoff."""
        if value is None or isinstance(value, RetryPolicy):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(attempts=value)
        raise InvalidDeclaration(f"retry must be a RetryPolicy or a number of attempts, got {value!r}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the second attempt)."""
        return float(min(self.max_backoff, self.backoff * self.factor ** (retry - 1)))

    def retries(self, exc: BaseException, attempt: int) -> bool:
        """Whether attempt number ``attempt`` (1-based), which raised ``exc``, is followed by another."""
        return attempt < self.attempts and isinstance(exc, self.on)


@dataclass(frozen=True)
class ToolDeclaration:
    """What ``@undolog_tool`` attaches to a function (``fn.__undolog_spec__``)."""

    tier: ToolTier
    compensation: CompensationDescriptor | None = None
    reason: str | None = None
    risk_tags: tuple[str, ...] = ()
    composite_of: tuple[str, ...] = ()
    probe: Callable[..., Any] | None = None
    name: str | None = None
    inherit_tier: bool = False
    retry: RetryPolicy | None = None


@dataclass(frozen=True)
class CompensationDeclaration:
    name: str
    version: int


def _as_descriptor(value: CompensationDescriptor | str | Callable[..., Any] | None) -> CompensationDescriptor | None:
    if value is None or isinstance(value, CompensationDescriptor):
        return value
    if isinstance(value, str):
        return CompensationDescriptor.new(value)
    decl = getattr(value, "__undolog_compensation__", None)
    if isinstance(decl, CompensationDeclaration):
        return CompensationDescriptor(decl.name, decl.version)
    raise InvalidDeclaration(
        f"compensation must be a CompensationDescriptor, a name or an @compensation function, got {value!r}"
    )


def make_declaration(
    *,
    tier: ToolTier | str | None = None,
    risk_level: str | None = None,
    compensation: CompensationDescriptor | str | Callable[..., Any] | None = None,
    reason: str | None = None,
    risk_tags: Iterable[str] = (),
    composite_of: Iterable[Any] = (),
    probe: Callable[..., Any] | None = None,
    name: str | None = None,
    retry: RetryPolicy | int | None = None,
) -> ToolDeclaration:
    members = tuple(m if isinstance(m, str) else tool_name_of(m) for m in composite_of)
    inherit = tier is None and risk_level is None and bool(members)
    if inherit:
        tier = ToolTier.SAFE  # replaced by the highest member tier at registration
    if tier is None and risk_level is None:
        raise InvalidDeclaration("a tool needs a tier (tier=ToolTier.X) or a risk_level ('low'|'medium'|'high')")
    resolved = ToolTier.coerce(tier) if tier is not None else ToolTier.from_risk_level(cast(str, risk_level))
    if tier is not None and risk_level is not None and ToolTier.from_risk_level(risk_level) != resolved:
        raise InvalidDeclaration(f"tier {resolved.value!r} contradicts risk_level {risk_level!r}")
    desc = _as_descriptor(compensation)
    if isinstance(risk_tags, str):
        raise InvalidDeclaration("risk_tags must be a list of strings, not one string")
    # An inheriting composite's compensation is checked once its tier is known, at registration.
    if not inherit and resolved is ToolTier.COMPENSABLE and desc is None:
        raise InvalidDeclaration("a COMPENSABLE tool must declare its compensation")
    if not inherit and resolved is not ToolTier.COMPENSABLE and desc is not None:
        raise InvalidDeclaration(f"only COMPENSABLE tools take a compensation (this one is {resolved.value})")
    policy = RetryPolicy.coerce(retry)
    if policy is not None and not inherit and resolved is ToolTier.IRREVERSIBLE:
        raise InvalidDeclaration(_NO_IRREVERSIBLE_RETRY)
    return ToolDeclaration(
        tier=resolved,
        compensation=desc,
        reason=reason,
        risk_tags=tuple(sorted({str(t) for t in risk_tags})),
        composite_of=members,
        probe=probe,
        name=name,
        inherit_tier=inherit,
        retry=policy,
    )


def undolog_tool(
    *,
    tier: ToolTier | str | None = None,
    risk_level: str | None = None,
    compensation: CompensationDescriptor | str | Callable[..., Any] | None = None,
    reason: str | None = None,
    risk_tags: Iterable[str] = (),
    composite_of: Iterable[Any] = (),
    probe: Callable[..., Any] | None = None,
    name: str | None = None,
    retry: RetryPolicy | int | None = None,
) -> Callable[[F], F]:
    """Classify a tool. The function is returned unchanged but for ``__undolog_spec__``.

    Args:
        tier: ``ToolTier.SAFE``, ``COMPENSABLE`` or ``IRREVERSIBLE``.
        risk_level: the same declaration in the contract vocabulary: ``low``, ``medium``, ``high``.
        compensation: for COMPENSABLE tools, the undo (a ``CompensationDescriptor`` or its name).
        reason: why the tool is irreversible; shown to the approver.
        risk_tags: labels used for routing approvals (``["pii", "billing"]``).
        composite_of: tools this one may call; it inherits the highest of their tiers.
        probe: an idempotent status check ``probe(ctx) -> bool | result`` used by recovery.
        name: the tool name, if not the function's.
        retry: a ``RetryPolicy`` (or a number of attempts) for a SAFE or COMPENSABLE tool that raises.

    Example:
        >>> @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes the account", risk_tags=["pii"])
        ... def delete_user_account(user_id: str) -> dict: ...
    """

    decl = make_declaration(
        tier=tier,
        risk_level=risk_level,
        compensation=compensation,
        reason=reason,
        risk_tags=risk_tags,
        composite_of=composite_of,
        probe=probe,
        name=name,
        retry=retry,
    )

    def wrap(fn: F) -> F:
        _check_params(str(decl.name or getattr(fn, "__name__", "tool")), fn)
        # The function object itself is kept so frameworks still see its signature and docstring.
        fn.__undolog_spec__ = decl  # type: ignore[attr-defined]
        return fn

    return wrap


def compensation(name: str, *, version: int = 1) -> Callable[[F], F]:
    """Declare a compensation ``fn(ctx)``; ``ctx`` has ``args``, ``result``, ``idempotency_key``, ``attempt``.

    Example:
        >>> @compensation("cancel_refund_email")
        ... def cancel_refund_email(ctx) -> None: ...
    """

    desc = CompensationDescriptor.new(name, version)

    def wrap(fn: F) -> F:
        fn.__undolog_compensation__ = CompensationDeclaration(desc.name, desc.version)  # type: ignore[attr-defined]
        return fn

    return wrap


def tool_name_of(fn: Any) -> str:
    decl = getattr(fn, "__undolog_spec__", None)
    if isinstance(decl, ToolDeclaration) and decl.name:
        return decl.name
    name = getattr(fn, "name", None)
    if isinstance(name, str) and name:
        return name
    return str(getattr(fn, "__name__", repr(fn)))


def _check_params(name: str, fn: Callable[..., Any]) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if RESERVED_PARAMS & set(params):
        raise InvalidDeclaration(f"tool {name!r}: a parameter may not be named 'call_id' (reserved by UndoLog)")


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
        return typing.get_type_hints(fn)
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


def canonical_json(value: Any) -> str:
    # allow_nan=False: a NaN must have been turned into a string before (see _engine.jsonable), never stored raw.
    return json.dumps(to_jsonable_python(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class ToolSpec:
    """A registered tool: its contract, its validator, and the callable that runs it."""

    name: str
    tier: ToolTier
    fn: Callable[..., Any] | None
    args_model: type[BaseModel]
    compensation: CompensationDescriptor | None
    reason: str | None
    risk_tags: tuple[str, ...]
    composite_of: tuple[str, ...]
    probe: Callable[..., Any] | None
    json_schema: dict[str, Any]
    fingerprint: str = ""
    revision: int = 0
    is_async: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Not part of the contract: how often to try is this process's choice, not what the tool does.
    retry: RetryPolicy | None = None
    sparse: bool = False  # schema-declared: pass on only the arguments given, never defaults invented as null
    # Where a tool that UndoLog forwards is bound (an MCP upstream's tool and its annotations, the compensation's
    # argument template): part of the contract, so a change is a new revision. None for in-process tools, whose
    # contract (and fingerprint) stays what it was.
    binding: dict[str, Any] | None = None
    # The compensation is built from the call's result (an MCP template naming {result.x}): a call whose result
    # was never seen cannot be undone, so recovery marks it unknown and halts the session for a person.
    compensation_needs_result: bool = False

    def __post_init__(self) -> None:
        self.sparse = hasattr(self.args_model, "__undolog_json_schema__")
        self._schema_validator = getattr(self.args_model, "__undolog_validator__", None)
        # Most tools' schemas are simple: checked in a few microseconds, jsonschema asked only when that says no.
        self._simply_valid = simple_checker(self.json_schema) if self._schema_validator is not None else None
        # The validator itself, without model_validate's keyword plumbing: this is the SAFE hot path.
        self._model_validate = self.args_model.__pydantic_validator__.validate_python
        # A simple schema-declared contract: arguments its model would give back unchanged skip it (see checked).
        self._as_is_copy = as_is_copier(self.json_schema) if self.sparse else None
        copy = self._as_is_copy
        self._as_is = None if copy is None else (lambda args: copy(args) is not None)  # (as_is_checker's answer)
        # The same copy where every property has one JSON type of its own (no Any field): arguments it accepts hold
        # only str/int/float/bool/None values, which are their own JSON form too, so the copy is also the snapshot
        # a logged call stores (``snapshot(validate(args))``; see Engine.intercept_spec). None otherwise.
        self._as_is_json = copy if copy is not None and _typed_only(self.json_schema) else None

    def contract(self) -> dict[str, Any]:
        contract = {
            "name": self.name,
            "tier": self.tier.value,
            "compensation": (
                {"name": self.compensation.name, "version": self.compensation.version} if self.compensation else None
            ),
            "args_schema": self.json_schema,
            "reason": self.reason,
            "risk_tags": list(self.risk_tags),
            "composite_of": sorted(self.composite_of),
        }
        if self.binding is not None:
            contract["binding"] = self.binding
        return contract

    def compute_fingerprint(self) -> str:
        return sha256_hex(canonical_json(self.contract()))

    def values(self, model: BaseModel) -> dict[str, Any]:
        # A validated model keeps its fields in __dict__ (extra="forbid"): copying it is the cheap way out.
        return model.model_dump(exclude_unset=True) if self.sparse else model.__dict__.copy()

    def checked(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The values to run the tool with: ``values(validate(args))``, the arguments validated and converted by the
        contract (``ArgumentsInvalid`` when they break it). Arguments that the contract's model would give back
        unchanged (see :func:`as_is_checker`) are not run through it: their copy is the same values."""
        values = self.as_is_copy(args)
        return values if values is not None else self.values(self.validate(args))

    def as_is_copy(self, args: Mapping[str, Any]) -> dict[str, Any] | None:
        """``checked(args)`` when the contract's model would give ``args`` back unchanged (a copy of them: valid, each
        value of the exact type its field keeps; a dict or a dict subclass that reads as one), else None: the caller
        then converts them as it would for the model and calls :meth:`checked`.

        Example:
            >>> spec.as_is_copy({"order_id": "A-17"})           # doctest: +SKIP
            {'order_id': 'A-17'}
        """
        copy = self._as_is_copy
        return copy(args) if copy is not None else None

    def snapshot(self, model: BaseModel) -> dict[str, Any]:
        """The arguments as JSON, as logged for undo and approval; refused clearly when they have no JSON form."""
        try:
            return model.model_dump(mode="json", exclude_unset=self.sparse)
        except (ValueError, RecursionError) as exc:
            # Nesting past the serialiser's limit, or a string that is not valid Unicode: name where.
            values = {**model.__dict__, **(model.__pydantic_extra__ or {})}
            path = too_deep(values)
            if path is not None:
                raise ArgumentsInvalid(self.name, [depth_error(path)]) from None
            found = bad_string(values)
            if found is not None:
                raise ArgumentsInvalid(self.name, [surrogate_error(found[0])]) from None
            if not isinstance(exc, pydantic_core.PydanticSerializationError):
                raise ArgumentsInvalid(self.name, [depth_error([])]) from None
            bad = []
            for fname in model.model_fields_set | set(type(model).model_fields):
                try:
                    model.model_dump(mode="json", include={fname})
                except pydantic_core.PydanticSerializationError as exc:
                    bad.append({"loc": [fname], "msg": f"has no JSON form to log for undo or approval ({exc})",
                                "type": "not_serializable"})
            raise ArgumentsInvalid(self.name, bad or [{"loc": [], "msg": "arguments have no JSON form"}]) from None

    def validate(self, args: Mapping[str, Any]) -> BaseModel:
        if self._schema_validator is not None and not (self._simply_valid is not None and self._simply_valid(args)):
            check_json_schema(self.name, self.json_schema, args, self._schema_validator)
        try:
            return self._model_validate(args)  # type: ignore[no-any-return]
        except pydantic.ValidationError as exc:
            raise ArgumentsInvalid(
                self.name,
                [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()],
            ) from None

    def action_digest(self, args_json: str) -> str:
        return sha256_hex(self.fingerprint + "\n" + args_json)


def _declared_text_problem(value: object, *, name: bool) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if "\x00" in value:
        return "contains NUL"
    if not encodes(value):
        return "contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode"
    if name and (not value.strip() or len(value) > MAX_ID_LENGTH):
        return f"must be a non-empty name of at most {MAX_ID_LENGTH} characters"
    return None


def _check_declared(tool_name: object, decl: ToolDeclaration, shown: object) -> None:
    """What is stored of a declaration fits the store on both databases, checked at registration: names fit their
    columns, and no text holds NUL (PostgreSQL's text refuses it: the approval request's reason) or a lone surrogate
    (not UTF-8). Without it, SQLite took what PostgreSQL refused with a raw database error, at start or on each call.
    """
    checks: list[tuple[str, object, bool]] = [("tool name", tool_name, True)]
    if decl.compensation is not None:
        checks.append(("compensation name", decl.compensation.name, True))
    if decl.reason is not None:
        checks.append(("reason", decl.reason, False))
    checks += [("risk tag", tag, False) for tag in decl.risk_tags]
    for what, value, is_name in checks:
        problem = _declared_text_problem(value, name=is_name)
        if problem is not None:
            raise InvalidDeclaration(f"tool {shown!r}: its {what} {value!r:.80} {problem}")


def build_spec(
    fn: Callable[..., Any] | None,
    decl: ToolDeclaration,
    *,
    name: str | None = None,
    args_schema: Any = None,
    binding: Mapping[str, Any] | None = None,
    compensation_needs_result: bool = False,
) -> ToolSpec:
    tool_name = name or decl.name or (tool_name_of(fn) if fn is not None else None)
    if not tool_name:
        raise InvalidDeclaration("a tool needs a name")
    _check_declared(tool_name, decl, tool_name)
    if fn is not None:
        _check_params(tool_name, fn)
    model = build_args_model(tool_name, fn, args_schema)
    if "call_id" in model.model_fields:
        raise InvalidDeclaration(f"tool {tool_name!r}: a parameter may not be named 'call_id' (reserved by UndoLog)")
    target = fn
    is_async = bool(target is not None and inspect.iscoroutinefunction(_unwrap(target)))
    spec = ToolSpec(
        name=tool_name,
        tier=decl.tier,
        fn=fn,
        args_model=model,
        compensation=decl.compensation,
        reason=decl.reason,
        risk_tags=decl.risk_tags,
        composite_of=decl.composite_of,
        probe=decl.probe,
        json_schema=json_schema_of(model),
        is_async=is_async,
        retry=decl.retry,
        binding=dict(binding) if binding is not None else None,
        compensation_needs_result=compensation_needs_result,
    )
    if decl.retry is not None and decl.tier is ToolTier.IRREVERSIBLE:
        raise InvalidDeclaration(f"tool {tool_name!r}: {_NO_IRREVERSIBLE_RETRY}")
    spec.fingerprint = spec.compute_fingerprint()
    return spec


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    unwrapped: Callable[..., Any] = inspect.unwrap(fn)
    return unwrapped


def is_async_callable(fn: Callable[..., Any]) -> bool:
    f = _unwrap(fn)
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__)


# -- JSON snapshots, the same on both databases --------------------------------------------------------

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
