"""What an edit changes against the proposed arguments (:func:`diff`), as the approver reviews it before approving.

Example:
    >>> [(c.name, c.kind, c.before_text, c.after_text) for c in diff({"n": 1}, {"n": 2})]
    [('/n', 'changed', '1', '2')]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .fields import json_text, pointer

__all__ = ["Change", "diff"]


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
        return "" if self.kind == "added" else json_text(self.before)

    @property
    def after_text(self) -> str:
        """The edited value as JSON text (``""`` when removed)."""
        return "" if self.kind == "removed" else json_text(self.after)


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
