"""Evident inverses among an upstream's tools, for ``undolog mcp init`` to propose as compensations.

Only what the listing makes evident: a move undone by moving back (a tool named move/rename taking a source and a
destination), and a create undone by the matching delete (``create_X``/``add_X``/``insert_X`` and
``delete_X``/``remove_X`` of the same upstream), its arguments matched by name against what the create takes and
answers. Anything less evident is left to a person. Every proposal is printed as one, to review.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mcp import types

# (source, destination) argument pairs a move takes: moving back swaps them.
_MOVE_PAIRS = (("source", "destination"), ("from", "to"), ("src", "dst"), ("old_path", "new_path"),
               ("oldPath", "newPath"), ("old_name", "new_name"), ("oldName", "newName"), ("old", "new"))
_CREATE = re.compile(r"^(create|add|insert)([_\-]?)(.+)$", re.IGNORECASE)
_DELETE_VERBS = ("delete", "remove")


@dataclass(frozen=True)
class Inverse:
    """A proposed compensation: the tool, its argument templates, and how it was found (for the comment)."""

    tool: str
    args: Mapping[str, Any]
    why: str
    for_each: str | None = None
    unsure: tuple[str, ...] = field(default=())  # arguments it could not match: a person fills them in


def props(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The properties of a JSON Schema object (empty when it lists none)."""
    found = (schema or {}).get("properties")
    return dict(found) if isinstance(found, Mapping) else {}


def find_inverse(tool: types.Tool, tools: Mapping[str, types.Tool]) -> Inverse | None:
    """The evident inverse of ``tool`` among ``tools`` (the same upstream's, by name), or None.

    Example:
        >>> find_inverse(tools["move_file"], tools).args
        {'source': '{args.destination}', 'destination': '{args.source}'}
    """
    takes = props(tool.inputSchema)
    if re.search(r"move|rename", tool.name, re.IGNORECASE):
        for a, b in _MOVE_PAIRS:
            if a in takes and b in takes:
                return Inverse(tool.name, {a: f"{{args.{b}}}", b: f"{{args.{a}}}"},
                               f"moved back: {tool.name} again with {a} and {b} swapped")
    m = _CREATE.match(tool.name)
    if m is None:
        return None
    for verb in _DELETE_VERBS:
        for name, other in tools.items():
            if name.lower() == f"{verb}{m.group(2)}{m.group(3)}".lower():
                return _matched(tool, other)
    return None


def _matched(create: types.Tool, delete: types.Tool) -> Inverse:
    """The delete's arguments, each from what the create took or answered, matched by name."""
    takes, answers = props(create.inputSchema), props(create.outputSchema)
    wanted = props(delete.inputSchema)
    required = (delete.inputSchema or {}).get("required")
    names = [n for n in wanted if not isinstance(required, list) or n in required] or list(wanted)
    args: dict[str, Any] = {}
    for_each = None
    unsure: list[str] = []
    for n in names:
        if n in answers:
            args[n] = f"{{result.{n}}}"
        elif n in takes:
            args[n] = f"{{args.{n}}}"
        elif re.search(r"(^|_)id$|Id$", n) and "id" in answers:
            args[n] = "{result.id}"
        elif (listed := _named_list(wanted[n], answers)) is not None:
            # delete_entities(entityNames) after create_entities -> {entities: [{name, ...}]}: one per element.
            for_each, key = f"{{result.{listed[0]}}}", listed[1]
            args[n] = [f"{{item.{key}}}"]
        else:
            unsure.append(n)
    return Inverse(delete.name, args, f"the matching delete: {delete.name}", for_each, tuple(unsure))


def _named_list(wanted: Any, answers: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the answered list, the key of its elements) when the delete takes a list of strings (names or ids) and
    the create answers a list of objects with a name or an id."""
    if not (isinstance(wanted, Mapping) and wanted.get("type") == "array"):
        return None
    for name, schema in answers.items():
        if isinstance(schema, Mapping) and schema.get("type") == "array":
            item = props(schema.get("items") if isinstance(schema.get("items"), Mapping) else None)
            for key in ("name", "id"):
                if key in item:
                    return name, key
    return None
