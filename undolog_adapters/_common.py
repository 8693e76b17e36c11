"""What every framework adapter shares: the tier vocabulary, registration, and the texts the model reads.

The adapters (``langgraph``, ``crewai``, ``semantic_kernel``) differ in where they hook into their
framework; they must not differ in what a tier mapping means, in which compensations get registered,
or in what the model is told when a call waits, is refused, fails or is rolled back. All of that lives
here, once. This module imports no framework (only ``undolog_core``), so every adapter can import it.

Example:
    >>> from undolog_adapters._common import UndoLogPolicy, Registrar
    >>> reg = Registrar(undolog, tiers={"send_refund_email": {"tier": "compensable",
    ...                                                       "compensation": cancel_refund_email}})  # doctest: +SKIP
    >>> reg.register("send_refund_email", vendor.send_refund_email)                    # doctest: +SKIP
    <ToolTier.COMPENSABLE: 'compensable'>
"""

from __future__ import annotations

import datetime as dt
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from undolog_core import CompensationDescriptor, RetryPolicy, ToolTier, compensation, errors

if TYPE_CHECKING:
    from undolog_core import RollbackReport, UndoLog
    from undolog_core.integration import ToolSpec

__all__ = [
    "Registrar",
    "TierValue",
    "UndoLogPolicy",
    "awaiting_text",
    "failure_text",
    "halted_text",
    "missing_extra",
    "policy_of",
    "refusal_text",
    "register_compensation",
    "register_compensations",
    "rollback_outcome",
    "tier_of",
]

CompensationRef: TypeAlias = "Callable[..., Any] | str | CompensationDescriptor | None"


# --------------------------------------------------------------------------------------------------
# The tier vocabulary
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UndoLogPolicy:
    """The tier of a third-party tool, given in ``tiers=`` where ``@undolog_tool`` cannot be applied.

    Every adapter takes the same ``tiers=`` mapping: tool name -> an ``UndoLogPolicy``, a bare
    ``ToolTier``, a tier or risk-level string (``"safe"``/``"low"``, ``"compensable"``/``"medium"``,
    ``"irreversible"``/``"high"``), or a dict with the fields below (``{"tier": ..., "compensation":
    ..., "reason": ..., "risk_tags": ...}``; ``"risk_level"`` may stand for ``"tier"``). A bare tier
    is enough for SAFE and IRREVERSIBLE tools; COMPENSABLE ones need their undo.

    Args:
        tier: ``ToolTier.SAFE``, ``COMPENSABLE`` or ``IRREVERSIBLE``, or its string value or risk level.
        compensation: for COMPENSABLE tools: a function ``fn(ctx)`` (an ``@compensation`` function, or a
            plain one, registered under its ``__name__``), or the name of a registered compensation. A
            function given here is registered with the UndoLog, so a rollback in this process finds it.
        reason: for IRREVERSIBLE tools, why; shown to the approver.
        risk_tags: labels used to route approvals, e.g. ``["pii"]``.
        probe: an idempotent status check ``probe(ctx)`` used by recovery (see ``@undolog_tool``).
        retry: for SAFE and COMPENSABLE tools, a ``RetryPolicy`` (or a number of attempts): UndoLog retries the
            tool under the same effect and idempotency key before the call counts as failed.

    Example:
        >>> tiers = {
        ...     "search": ToolTier.SAFE,
        ...     "send_refund_email": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=cancel_refund_email),
        ...     "delete_user_account": UndoLogPolicy(ToolTier.IRREVERSIBLE, reason="erases the customer"),
        ... }
        >>> node = UndoLogToolNode(tools, undolog=undolog, tiers=tiers)  # doctest: +SKIP
    """

    tier: ToolTier | str
    compensation: Callable[..., Any] | str | CompensationDescriptor | None = None
    reason: str | None = None
    risk_tags: Sequence[str] = ()
    probe: Callable[..., Any] | None = None
    retry: RetryPolicy | int | None = None

    @property
    def resolved_tier(self) -> ToolTier:
        """The tier as a ``ToolTier`` (a risk level such as ``"high"`` is accepted too)."""
        return tier_of(self.tier)


TierValue: TypeAlias = "UndoLogPolicy | ToolTier | str | Mapping[str, Any]"

_POLICY_KEYS = frozenset({"tier", "risk_level", "compensation", "reason", "risk_tags", "probe", "retry"})


def tier_of(value: ToolTier | str) -> ToolTier:
    """A ``ToolTier`` from a tier, its name, or a risk level (``low``/``medium``/``high``).

    Example:
        >>> tier_of("high")
        <ToolTier.IRREVERSIBLE: 'irreversible'>
    """
    if isinstance(value, ToolTier):
        return value
    text = str(value).lower()
    if text in ("low", "medium", "high"):
        return ToolTier.from_risk_level(text)
    return ToolTier.coerce(text)


def policy_of(value: TierValue) -> UndoLogPolicy:
    """Normalise one ``tiers=`` value to an :class:`UndoLogPolicy`; an unknown tier or key is refused.

    Example:
        >>> policy_of({"tier": "irreversible", "reason": "erases data"}).resolved_tier
        <ToolTier.IRREVERSIBLE: 'irreversible'>
    """
    if isinstance(value, UndoLogPolicy):
        tier_of(value.tier)  # an unknown tier is refused where it is given, not at the first call
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - _POLICY_KEYS)
        if unknown:
            raise errors.InvalidDeclaration(
                f"unknown key(s) {unknown} in a tier mapping: use {sorted(_POLICY_KEYS)}"
            )
        given = value.get("tier", value.get("risk_level"))
        if given is None:
            raise errors.InvalidDeclaration(f"a tier mapping needs 'tier' (or 'risk_level'): {dict(value)!r}")
        tags = value.get("risk_tags") or ()
        if isinstance(tags, str):
            raise errors.InvalidDeclaration("risk_tags must be a list of strings, not one string")
        policy = UndoLogPolicy(tier=tier_of(given), compensation=value.get("compensation"),
                               reason=value.get("reason"), risk_tags=tuple(tags), probe=value.get("probe"),
                               retry=value.get("retry"))
        if "tier" in value and "risk_level" in value and tier_of(value["risk_level"]) is not policy.tier:
            raise errors.InvalidDeclaration(
                f"tier {value['tier']!r} contradicts risk_level {value['risk_level']!r}"
            )
        return policy
    if isinstance(value, ToolTier | str):
        return UndoLogPolicy(tier_of(value))
    raise errors.InvalidDeclaration(
        f"a tier must be a ToolTier, a tier or risk-level string, an UndoLogPolicy or a dict, got {value!r}"
    )


# --------------------------------------------------------------------------------------------------
# Registration: compensations, then tools
# --------------------------------------------------------------------------------------------------


def register_compensation(undolog: UndoLog, comp: CompensationRef) -> CompensationDescriptor | str | None:
    """Register a compensation given as a function; return what ``register_tool(compensation=...)`` takes.

    An ``@compensation`` function is registered as declared. A plain function is registered under its
    ``__name__`` through a wrapper, so the user's own function is not modified. A name or a
    ``CompensationDescriptor`` passes through: it must be registered by whoever defines it.

    Example:
        >>> register_compensation(undolog, cancel_refund_email)   # doctest: +SKIP
        CompensationDescriptor(name='cancel_refund_email', version=1)
    """
    if comp is None or isinstance(comp, str | CompensationDescriptor):
        return comp
    if not callable(comp):
        raise errors.InvalidDeclaration(
            f"a compensation must be a function, its name or a CompensationDescriptor, got {comp!r}"
        )
    fn: Callable[..., Any] = comp
    decl = getattr(fn, "__undolog_compensation__", None)
    if decl is None:
        user_fn = fn
        name = str(getattr(user_fn, "__name__", "") or "compensation")
        wrapper: Callable[..., Any]
        if inspect.iscoroutinefunction(user_fn):

            async def awrapper(ctx: Any) -> Any:
                return await user_fn(ctx)

            wrapper = awrapper
        else:

            def swrapper(ctx: Any) -> Any:
                return user_fn(ctx)

            wrapper = swrapper
        fn = compensation(name)(wrapper)
        decl = getattr(fn, "__undolog_compensation__")  # noqa: B009 - set just above, untyped attribute
    undolog.register(fn)
    return CompensationDescriptor(str(decl.name), int(decl.version))


def register_compensations(undolog: UndoLog, compensations: Iterable[Callable[..., Any]]) -> None:
    """Register every function of an adapter's ``compensations=`` (``@compensation`` or plain)."""
    for fn in compensations:
        register_compensation(undolog, fn)


def _comp_key(comp: CompensationDescriptor | str | None) -> tuple[str, int] | None:
    if comp is None:
        return None
    if isinstance(comp, str):
        return (comp, 1)
    return (comp.name, comp.version)


class Registrar:
    """An adapter's ``tiers=`` and ``compensations=``, turned into registrations on one UndoLog.

    Every adapter builds one. The compensations are registered at once; the tier mapping is checked at
    once (an unknown tier fails here, not at the first call); each tool is registered by
    :meth:`register` when the adapter meets it.

    Example:
        >>> reg = Registrar(undolog, tiers={"lookup": "safe"}, compensations=[cancel_refund_email])  # doctest: +SKIP
        >>> reg.register("lookup", lookup)                                                            # doctest: +SKIP
        <ToolTier.SAFE: 'safe'>
    """

    def __init__(self, undolog: UndoLog, *, tiers: Mapping[str, TierValue] | None = None,
                 compensations: Iterable[Callable[..., Any]] = ()) -> None:
        if undolog is None:
            raise errors.ConfigurationError("pass the UndoLog instance: undolog=UndoLog.open(...)")
        self.undolog = undolog
        self.policies: dict[str, UndoLogPolicy] = {str(k): policy_of(v) for k, v in (tiers or {}).items()}
        register_compensations(undolog, compensations)
        self.names: list[str] = []  # the tools this adapter registered or found, in order

    def check_compensations(self, adapter: str, names: Iterable[str] | None = None) -> None:
        """Refuse an adapter whose COMPENSABLE tools name a compensation registered nowhere in this process.

        Found when the adapter is built (after its ``compensations=``), not at the first rollback, which would stop
        at that call with its effect still in the world. ``names``: the UndoLog names of the adapter's tools (default:
        those registered through :meth:`register`).

        Raises:
            errors.ConfigurationError: naming each tool and the compensation it names.
        """
        known = self.undolog.registry.compensations
        missing = []
        for name in dict.fromkeys(self.names if names is None else names):
            spec = self.known(name)
            comp = spec.compensation if spec is not None else None
            if comp is not None and comp.name not in known:
                missing.append(f"{name} -> {comp.name!r}")
        if missing:
            raise errors.ConfigurationError(
                f"{adapter}: compensations named but registered nowhere ({', '.join(missing)}): pass them in "
                "compensations=[...] or register them with undolog.register(...) before building it; a rollback "
                "would otherwise stop at the first such call")

    def policy(self, *names: str) -> UndoLogPolicy | None:
        """The policy given in ``tiers=`` under the first of ``names`` that has one."""
        for n in names:
            p = self.policies.get(n)
            if p is not None:
                return p
        return None

    def known(self, name: str) -> ToolSpec | None:
        """The spec registered in this process under ``name`` (by the app or an earlier adapter), if any."""
        try:
            return self.undolog.tool_spec(name)
        except errors.ToolNotRegistered:
            return None

    def register(self, name: str, fn: Callable[..., Any] | None, *, declared: Any = None,
                 args_schema: Any = None, aliases: Iterable[str] = ()) -> ToolTier:
        """Register tool ``name``; return its tier. Refuses (``ToolNotClassified``) a tool with no tier.

        The tier comes from ``tiers=`` (under ``name`` or one of ``aliases``), else from ``declared``
        (the ``@undolog_tool`` declaration found on the tool), else from what the app registered itself.
        A compensation given as a function is registered too. A tool already registered in this process
        with the same tier, compensation, reason and risk tags is left as it is: registering it again
        with a framework's own argument schema would be a new contract revision each time, and would
        cancel the approvals bound to the old one.
        """
        self.names.append(name)
        policy = self.policy(name, *aliases)
        if policy is None and declared is not None:
            policy = UndoLogPolicy(declared.tier, compensation=declared.compensation, reason=declared.reason,
                                   risk_tags=tuple(declared.risk_tags), probe=declared.probe,
                                   retry=getattr(declared, "retry", None))
        known = self.known(name)
        if policy is None:
            if known is None:
                raise errors.ToolNotClassified(name)
            return known.tier
        tier = policy.resolved_tier
        comp = register_compensation(self.undolog, policy.compensation)
        tags = tuple(sorted({str(t) for t in policy.risk_tags}))
        retry = RetryPolicy.coerce(policy.retry)
        if (known is not None and known.tier is tier and _comp_key(known.compensation) == _comp_key(comp)
                and known.reason == policy.reason and tuple(known.risk_tags) == tags and known.retry == retry):
            return tier
        with warnings.catch_warnings():
            # (register_tool's warning of a compensation not registered: the adapter refuses that itself, when it is
            # built, in check_compensations)
            warnings.filterwarnings("ignore", message=".*names the compensation.*", category=UserWarning)
            self.undolog.register_tool(fn, name=name, tier=tier, compensation=comp, reason=policy.reason,
                                       risk_tags=list(tags), probe=policy.probe, args_schema=args_schema, retry=retry)
        return tier


def missing_extra(module: str, needs: str, extra: str) -> str:
    """The message of the ``ImportError`` an adapter raises when its framework is not installed."""
    return f"{module} needs {needs}, which is not installed: pip install 'undolog[{extra}]'"


# --------------------------------------------------------------------------------------------------
# What the model reads
# --------------------------------------------------------------------------------------------------
#
# Every adapter tells the model the same things in the same words: that a call did NOT run (and must not
# be retried), what a person decided, and what a rollback undid. A model that reads "do not retry" stops
# asking; one that reads a bare error tends to call the tool again.


def _iso(value: Any) -> str | None:
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    return None if value is None else str(value)


def awaiting_text(tool: str, approval_request_id: str, reason: str | None = None) -> str:
    """An IRREVERSIBLE call is waiting for a person.

    Example:
        >>> awaiting_text("delete_user_account", "r-1")[:60]
        'UndoLog: delete_user_account is awaiting approval, request r'
    """
    why = f" ({reason})" if reason else ""
    return (
        f"UndoLog: {tool} is awaiting approval, request {approval_request_id}{why}. It has NOT run. "
        "Do not retry it now; tell the user it needs a person's approval and end your turn."
    )


def halted_text(session_id: str, reason: str | None) -> str:
    """The conversation is on hold: its session is halted until a person resumes or rolls it back."""
    return (
        f"UndoLog: this conversation is on hold. Session {session_id} is halted ({reason or 'no reason'}). "
        f"A person must resume it (`undolog sessions resume {session_id}`) or roll it back before the agent "
        "can act again."
    )


def refusal_text(tool: str, exc: errors.UndoLogError, *, timeout_at: Any = None) -> str:
    """Why a call was not run: rejected, timed out, cancelled, halted, rolled back, or refused.

    ``timeout_at`` (the request's deadline), when known, is named in a timeout.

    Example:
        >>> refusal_text("wire", errors.ApprovalRejected("r-1", "no", "ana"))[:40]
        'UndoLog: wire was NOT run. Approval requ'
    """
    if isinstance(exc, errors.ApprovalRejected):
        return (
            f"UndoLog: {tool} was NOT run. Approval request {exc.approval_request_id} was rejected by "
            f"{exc.approver or 'a person'}: {exc.reason or 'no reason given'}. Nothing was done (the call did NOT "
            "run); do not retry this action. The session is halted until a person resumes or rolls it back."
        )
    if isinstance(exc, errors.ApprovalTimedOut):
        when = f" at {_iso(timeout_at)}" if timeout_at is not None else ""
        return (
            f"UndoLog: {tool} was NOT run: approval request {exc.approval_request_id} timed out{when} without a "
            "decision from a person. The session is halted until a person resolves it; do not retry this action."
        )
    if isinstance(exc, errors.ApprovalCancelled):
        return f"UndoLog: {tool} was NOT run. {exc.message}."
    if isinstance(exc, errors.SessionClosed):
        return (
            f"UndoLog refused {tool}: {exc.message}. The earlier steps of this plan were undone, so this one "
            "was not run."
        )
    return f"UndoLog refused {tool}: {exc.message}"


_UNDONE = ("compensated", "already_compensated")


def rollback_outcome(report: RollbackReport | None, session_id: str, failed_effect_id: str | None) -> str:
    """One sentence on what UndoLog did after a COMPENSABLE/IRREVERSIBLE call failed (no final period).

    ``report`` is what ``engine.fail`` returned: the rollback's report, or None under policy "continue".
    The failed call's own compensation runs too (in case it partly happened); it is not counted as undoing
    an earlier success.
    """
    if report is None:
        return f"UndoLog recorded the failure; session {session_id} keeps its earlier steps (policy: continue)"
    if report.already_rolled_back:
        return f"session {session_id} was already rolled back"
    if not report.steps and not report.complete:
        # The rollback never started (a sibling call still running, a compensation missing in this process): saying
        # "rolled back" would tell the model its earlier steps were undone.
        return (f"UndoLog could NOT roll the session back ({report.halted_reason or 'it did not start'}): nothing was "
                f"undone, and the earlier steps of session {session_id} stay done; the session is halted and a person "
                "must check")
    undone = [s for s in report.steps if s.outcome in _UNDONE and s.effect_id != failed_effect_id]
    broken = [s for s in report.steps if s.outcome not in _UNDONE]
    text = f"UndoLog rolled the session back (undone: {', '.join(s.tool_name for s in undone) or 'nothing earlier'})"
    if undone:
        text += ", newest first: " + "; ".join(
            f"{s.compensation_name} undid {s.tool_name} (effect {s.effect_id[:8]})" for s in undone
        )
    for s in broken:
        text += f"; {s.compensation_name} could NOT undo {s.tool_name} (effect {s.effect_id[:8]}): {s.error or s.outcome}"
    if report.kept_irreversible:
        text += f"; irreversible steps stay done: {', '.join(report.kept_irreversible)}"
    if not report.complete:
        return (f"{text}. The rollback stopped ({report.halted_reason or 'a compensation failed'}); the session is "
                "halted and a person must check")
    return f"{text}. What could be undone is rolled back; do not continue the task or retry, tell the user plainly"


def failure_text(tool: str, error: str, outcome: str) -> str:
    """What the model reads when a COMPENSABLE/IRREVERSIBLE tool failed: the error, then ``outcome``.

    ``outcome`` is usually :func:`rollback_outcome` of the report ``engine.fail`` returned.

    Example:
        >>> failure_text("send_refund_email", "MailServerDown: refused", rollback_outcome(None, "s-1", "e-1"))
        'send_refund_email failed: MailServerDown: refused. UndoLog recorded the failure; session s-1 keeps its earlier steps (policy: continue).'
    """
    return f"{tool} failed: {error}. {outcome}."
