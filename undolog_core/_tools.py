"""Declarations: tiers, ``@undolog_tool``, ``@compensation``, the registered ``ToolSpec`` and its fingerprint.

Argument validation lives in ``_validation`` and canonical JSON in ``_json``; a ``ToolSpec`` ties them to one tool.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import pydantic
import pydantic_core
from pydantic import BaseModel

from ._json import canonical_json, sha256_hex
from ._validation import (
    _typed_only,
    as_is_copier,
    build_args_model,
    check_json_schema,
    json_schema_of,
    simple_checker,
)
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
