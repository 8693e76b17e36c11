"""Pinned variants: one upstream tool exposed as two tools of different tiers, told apart by an argument.

The tier is a property of the tool, never of one call's arguments. An upstream tool whose argument decides
whether it changes anything (``edit_file`` with ``dryRun``) is split into tools that each pin that argument::

    [tools.fs.edit_file_preview]
    of = "edit_file"
    pin = { dryRun = true }
    tier = "safe"

    [tools.fs.edit_file]
    tier = "compensable"          # pins dryRun = false by itself: the other value of a boolean
    ...

A pinned property is dropped from the exposed input schema, and a call that sends it is refused (it would choose
the tier). The plain tool of a variant pins the other value of each boolean the variant pins; a pinned property
that is not a boolean must be pinned on the plain tool too, in its own ``pin``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from undolog_core.errors import ConfigurationError

if TYPE_CHECKING:
    from mcp import types


class _Pinnable(Protocol):
    """A tool entry of the config, as far as pinning reads it (``config.ToolConfig``; not imported: config
    imports this module)."""

    @property
    def of(self) -> str | None: ...

    @property
    def pin(self) -> Mapping[str, Any]: ...


T = TypeVar("T", bound=_Pinnable)


def pinning(where: str, raw: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A tool entry's ``of`` and ``pin``, checked.

    Raises:
        ConfigurationError: ``of`` without a ``pin`` (or the other way round for a variant), a pin that is no table.
    """
    of, pin = raw.get("of"), raw.get("pin")
    if of is not None and not (isinstance(of, str) and of):
        raise ConfigurationError(f"gateway config: {where} of must name a tool of the same upstream")
    if pin is not None and not (isinstance(pin, Mapping) and pin):
        raise ConfigurationError(f"gateway config: {where} pin must be a table of argument values, like "
                                 "pin = { dryRun = true }")
    if of is not None and pin is None:
        raise ConfigurationError(f"gateway config: {where} is a variant of {of}: it needs pin = {{ NAME = value }} "
                                 "saying which argument values make it this tool")
    return of, dict(pin or {})


def pin_plain_tools(tools: Mapping[tuple[str, str], T]) -> dict[tuple[str, str], T]:
    """The tools with each variant's plain tool pinning the other value of the variant's booleans.

    Raises:
        ConfigurationError: a variant of a variant, a variant named like the tool it pins, or a non-boolean pin the
            plain tool does not pin itself.
    """
    out = dict(tools)
    for (up, name), cfg in tools.items():
        if cfg.of is None:
            continue
        where = f"[tools.{up}.{name}]"
        if cfg.of == name:
            raise ConfigurationError(f"gateway config: {where} of = {cfg.of!r} names itself; a variant needs a name "
                                     "of its own (like edit_file_preview)")
        plain = out.get((up, cfg.of))
        if plain is not None and plain.of is not None:
            raise ConfigurationError(f"gateway config: {where} is a variant of {cfg.of}, which is a variant itself")
        if plain is None:
            continue  # the plain tool is not exposed: nothing to pin
        pins = dict(plain.pin)
        for key, value in cfg.pin.items():
            if key in pins:
                if pins[key] == value:
                    raise ConfigurationError(f"gateway config: {where} and [tools.{up}.{cfg.of}] both pin {key} = "
                                             f"{value!r}: one call would have two tiers")
                continue
            if not isinstance(value, bool):
                raise ConfigurationError(
                    f"gateway config: {where} pins {key} = {value!r}, which is not a boolean: pin the value "
                    f"[tools.{up}.{cfg.of}] calls with in its own pin = {{ {key} = ... }}")
            pins[key] = not value
        out[(up, cfg.of)] = dataclasses.replace(plain, pin=pins)  # type: ignore[type-var]
    return out


def pinned_tool(tool: types.Tool, pin: Mapping[str, Any]) -> types.Tool:
    """``tool`` as a pinned tool exposes it: the pinned properties gone from its input schema."""
    if not pin:
        return tool
    schema = dict(tool.inputSchema or {})
    props = dict(schema.get("properties") or {})
    for key in pin:
        props.pop(key, None)
    schema["properties"] = props
    if isinstance(schema.get("required"), list):
        schema["required"] = [r for r in schema["required"] if r not in pin]
    return tool.model_copy(update={"inputSchema": schema})


def pinned_sent(name: str, arguments: Mapping[str, Any], pin: Mapping[str, Any]) -> str | None:
    """Why a call of the tool exposed as ``name`` is refused because it sends a pinned argument (None: it does not).
    """
    if not pin:  # (every call of an unpinned tool: nothing to compare)
        return None
    sent = sorted(set(arguments) & set(pin))
    if not sent:
        return None
    fixed = ", ".join(f"{k} = {pin[k]!r}" for k in sent)
    return (f"{name} does not take {', '.join(sent)}: this tool always sends {fixed} (its tier depends on it). "
            "Leave it out, or call the tool exposed for the other value.")
