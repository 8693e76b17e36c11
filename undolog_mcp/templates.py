"""Compensation templates: how a COMPENSABLE tool's undo is built from what the call took, answered and found.

A template names another tool of the same upstream and its arguments, built from placeholders:

- ``{args.NAME}``: the call's arguments (with the tool's pinned values);
- ``{result.NAME}``: its result (its structured content, else its text parsed as JSON);
- ``{before.NAME}``: what ``capture`` read before the call (a SAFE call of the same upstream, stored with the undo
  entry), e.g. a file's text before it was overwritten;
- ``{item}``, ``{item.NAME}``: with ``for_each = "{result.entities}"``, one element of that list: one compensation
  call per element, each with its own key (``undo-{id}.{index}``), newest element first;
- ``{forward_key}``: the call's own ``do-`` key; ``{undo_key}``: the compensation call's key;
- ``{idempotency_key}``: the compensation call's key, as before (kept for one release; it warns at load: write
  ``{undo_key}``).

``skip_if_empty = true``: a call that changed nothing needs no undo: an empty (or absent) ``for_each`` list, or an
empty result, or a ``{result...}`` placeholder that finds nothing, makes the compensation do nothing.

A value that is exactly one placeholder keeps its JSON type; a placeholder inside a longer string is formatted in.

Example::

    [tools.memory.create_entities]
    tier = "compensable"
    compensation = { tool = "delete_entities", args = { entityNames = ["{item.name}"] },
                     for_each = "{result.entities}", skip_if_empty = true }
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from undolog_core.errors import ConfigurationError

log = logging.getLogger("undolog.mcp")

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
# Sources read by path (``{args.x}``), and whole values (``{forward_key}``).
_PATHED = ("args", "result", "before", "item")
_WHOLE = ("forward_key", "undo_key", "idempotency_key", "item", "result", "before")
# Where a captured value rides in the undo entry's stored arguments (the compensation takes it out again): a name
# no tool's argument has (a "/" in a property name would be a strange schema).
BEFORE_KEY = "dev.undolog/before"


class _Missing(ConfigurationError):
    """A placeholder found nothing (what ``skip_if_empty`` forgives in a result)."""

    def __init__(self, path: str) -> None:
        head = path.split(".", 1)[0]
        super().__init__(f"compensation template: {{{path}}} is not in the call's {head}")
        self.path = path


@dataclass(frozen=True)
class Capture:
    """A SAFE call of the same upstream made before the call, whose result the undo reads as ``{before...}``."""

    tool: str
    args: Mapping[str, Any]

    def render(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The capture's arguments for a call taking ``args``.

        Raises:
            ConfigurationError: a placeholder names an argument the call does not have.
        """
        out = _render(self.args, {"args": args})
        assert isinstance(out, dict)
        return out

    def describe(self) -> dict[str, Any]:
        return {"tool": self.tool, "args": dict(self.args)}


@dataclass(frozen=True)
class CompensationTemplate:
    """The compensation of a COMPENSABLE tool: another tool of the same upstream, with arguments built from the
    call (see the module's docstring for the placeholders).

    Example:
        >>> t = CompensationTemplate("close_ticket", {"id": "{result.id}"})
        >>> t.render({"title": "x"}, {"id": 7}, "undo-1")
        {'id': 7}
        >>> t = CompensationTemplate("delete_entities", {"entityNames": ["{item.name}"]}, for_each="{result.entities}")
        >>> t.calls({}, {"entities": [{"name": "a"}, {"name": "b"}]}, undo_key="undo-3", forward_key="do-e")
        [({'entityNames': ['b']}, 'undo-3.1'), ({'entityNames': ['a']}, 'undo-3.0')]
    """

    tool: str
    args: Mapping[str, Any]
    for_each: str | None = None  # "{result.NAME}": one compensation call per element
    skip_if_empty: bool = False
    capture: Capture | None = None

    def fields(self) -> list[tuple[str, str, str]]:
        """Each ``{args.NAME...}`` and ``{result.NAME...}`` placeholder (also in ``for_each`` and the capture's
        arguments) as (source, NAME, placeholder): what the tool must take or answer for the undo to be built."""
        out = []
        phs = _placeholders(self.args) + _placeholders(self.for_each or "")
        if self.capture is not None:
            phs += _placeholders(self.capture.args)
        for ph in phs:
            parts = ph.split(".")
            if parts[0] in ("args", "result") and len(parts) > 1:
                out.append((parts[0], parts[1], ph))
        return out

    @property
    def needs_result(self) -> bool:
        return any(p.split(".", 1)[0] == "result" for p in _placeholders(self.args) + _placeholders(self.for_each or ""))

    def render(self, args: Mapping[str, Any], result: Any, idempotency_key: str) -> dict[str, Any]:
        """The compensation's arguments for one call without ``for_each`` (the earlier API).

        Raises:
            ConfigurationError: a placeholder names something the call's arguments or result do not have.
        """
        out = _render(self.args, {"args": args, "result": result, "idempotency_key": idempotency_key,
                                  "undo_key": idempotency_key})
        assert isinstance(out, dict)
        return out

    def calls(self, args: Mapping[str, Any], result: Any, *, undo_key: str, forward_key: str,
              before: Any = None) -> list[tuple[dict[str, Any], str]]:
        """The compensation calls for one call, in the order to run them: (arguments, idempotency key) each.

        Raises:
            ConfigurationError: a placeholder names something the call does not have (unless ``skip_if_empty``
                forgives a result that holds nothing).
        """
        sources: dict[str, Any] = {"args": args, "result": result, "before": before, "forward_key": forward_key}
        if self.skip_if_empty and _empty(result):
            return []
        if self.for_each is None:
            try:
                out = _render(self.args, {**sources, "undo_key": undo_key, "idempotency_key": undo_key})
            except _Missing as exc:
                if self.skip_if_empty and exc.path.startswith("result"):
                    return []
                raise
            assert isinstance(out, dict)
            return [(out, undo_key)]
        try:
            items = _render(self.for_each, sources)
        except _Missing as exc:
            if self.skip_if_empty:
                return []
            raise ConfigurationError(f"compensation template: for_each {self.for_each} is not in the call's "
                                     "result") from exc
        if items is None and self.skip_if_empty:
            return []
        if not isinstance(items, list):
            raise ConfigurationError(f"compensation template: for_each {self.for_each} is not a list in the call's "
                                     f"result (it is {type(items).__name__})")
        out_calls = []
        # Newest first, as the saga undoes calls: the last element made is the first undone.
        for i in reversed(range(len(items))):
            key = f"{undo_key}.{i}"
            try:
                rendered = _render(self.args, {**sources, "item": items[i], "undo_key": key, "idempotency_key": key})
            except _Missing as exc:
                raise ConfigurationError(f"compensation template: {{{exc.path}}} is not in element {i} of "
                                         f"{self.for_each}") from None
            assert isinstance(rendered, dict)
            out_calls.append((rendered, key))
        return out_calls

    def describe(self) -> dict[str, Any]:
        """What goes into the tool's contract (its fingerprint): the whole template."""
        out: dict[str, Any] = {"tool": self.tool, "args": dict(self.args)}
        if self.for_each is not None:
            out["for_each"] = self.for_each
        if self.skip_if_empty:
            out["skip_if_empty"] = True
        if self.capture is not None:
            out["capture"] = self.capture.describe()
        return out


def parse_template(where: str, raw: Any, capture_raw: Any) -> CompensationTemplate:
    """A compensation table (and the tool's ``capture`` table) from gateway.toml, checked.

    Raises:
        ConfigurationError: naming the key that is wrong and what it should be.
    """
    if not isinstance(raw, Mapping) or not isinstance(raw.get("tool"), str):
        raise ConfigurationError(
            f"gateway config: {where} is compensable: it needs compensation = {{ tool = \"...\", args = {{...}} }} "
            "naming the upstream tool that undoes it"
        )
    unknown = set(raw) - {"tool", "args", "for_each", "skip_if_empty"}
    if unknown:
        raise ConfigurationError(f"gateway config: {where} compensation has unknown key(s) "
                                 f"{', '.join(sorted(unknown))} (known: tool, args, for_each, skip_if_empty)")
    args = raw.get("args", {})
    if not isinstance(args, Mapping):
        raise ConfigurationError(f"gateway config: {where} compensation.args must be a table")
    for_each = raw.get("for_each")
    if for_each is not None and not (isinstance(for_each, str) and _PLACEHOLDER.fullmatch(for_each)
                                     and for_each[1:-1].split(".")[0] == "result" and "." in for_each):
        raise ConfigurationError(f"gateway config: {where} compensation.for_each must be one placeholder naming a "
                                 f"list in the result, like \"{{result.entities}}\"; got {for_each!r}")
    skip = raw.get("skip_if_empty", False)
    if not isinstance(skip, bool):
        raise ConfigurationError(f"gateway config: {where} compensation.skip_if_empty must be true or false")
    capture = None
    if capture_raw is not None:
        if (not isinstance(capture_raw, Mapping) or not isinstance(capture_raw.get("tool"), str)
                or not isinstance(capture_raw.get("args", {}), Mapping) or set(capture_raw) - {"tool", "args"}):
            raise ConfigurationError(f"gateway config: {where} capture must be {{ tool = \"...\", args = {{...}} }}: "
                                     "a read-only tool of the same upstream run before the call")
        for ph in _placeholders(capture_raw.get("args", {})):
            if not (ph.startswith("args.") and all(ph.split("."))):
                raise ConfigurationError(f"gateway config: {where} capture.args uses {{{ph}}}; it runs before the "
                                         "call, so only {args.NAME} placeholders")
        capture = Capture(str(capture_raw["tool"]), dict(capture_raw.get("args", {})))
    allowed = {"args", "result", "forward_key", "undo_key", "idempotency_key"}
    if capture is not None:
        allowed.add("before")
    if for_each is not None:
        allowed.add("item")
    for ph in _placeholders(args):
        head = ph.split(".", 1)[0]
        ok = head in allowed and (("." in ph and all(ph.split(".")) and head in _PATHED) or
                                  (ph == head and head in _WHOLE))
        if not ok:
            extra = "" if capture is not None else " ({before.NAME} needs a capture)"
            extra += "" if for_each is not None else " ({item} needs for_each)"
            raise ConfigurationError(
                f"gateway config: {where} compensation.args uses {{{ph}}}; placeholders are {{args.NAME}}, "
                f"{{result.NAME}}, {{before.NAME}}, {{item.NAME}}, {{forward_key}} and {{undo_key}}{extra}"
            )
        if head == "idempotency_key":
            log.warning("gateway config: %s compensation uses {idempotency_key}: it is the compensation call's own "
                        "key, and is kept for one release; write {undo_key} (or {forward_key} for the call's "
                        "do- key)", where)
    return CompensationTemplate(str(raw["tool"]), dict(args), for_each, skip, capture)


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def _placeholders(value: Any) -> list[str]:
    if isinstance(value, str):
        return _PLACEHOLDER.findall(value)
    if isinstance(value, Mapping):
        return [p for v in value.values() for p in _placeholders(v)]
    if isinstance(value, list):
        return [p for v in value for p in _placeholders(v)]
    return []


def _lookup(path: str, sources: Mapping[str, Any]) -> Any:
    head, _, rest = path.partition(".")
    if head not in sources:
        raise ConfigurationError(f"compensation template: unknown placeholder {{{path}}}")
    value = sources[head]
    for part in rest.split(".") if rest else ():
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise _Missing(path)
    return value


def _render(value: Any, sources: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole:
            return _lookup(whole.group(1), sources)
        return _PLACEHOLDER.sub(lambda m: str(_lookup(m.group(1), sources)), value)
    if isinstance(value, Mapping):
        return {k: _render(v, sources) for k, v in value.items()}
    if isinstance(value, list):
        return [_render(v, sources) for v in value]
    return value
