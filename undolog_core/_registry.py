"""The tool registry: in-process specs and compensations, and the durable, revisioned contract trail."""

from __future__ import annotations

import dataclasses
import getpass
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._tools import (
    CompensationDeclaration,
    CompensationDescriptor,
    ToolDeclaration,
    ToolSpec,
    ToolTier,
    build_spec,
    tool_name_of,
)
from .errors import InvalidDeclaration, ToolNotClassified, ToolNotRegistered
from .storage.base import utcnow
from .storage.records import ContractRevision

if TYPE_CHECKING:
    from .storage.contract import RegistryRepository


def default_actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class Registry:
    """The tools and compensations of this process, and their durable contract revisions.

    Example:
        >>> registry = Registry(storage.registry, note_state=lambda session_id, state: None)
        >>> registry.register([search_knowledge_base])[0].revision
        1
    """

    def __init__(self, storage: RegistryRepository, *, note_state: Callable[[str, str], None]) -> None:
        """``note_state(session_id, state)``: keeps the in-memory session caches in step when a contract change
        cancels the approvals a session was waiting for."""
        self._storage = storage
        self._note_state = note_state
        self.tools: dict[str, ToolSpec] = {}
        self.by_fn: dict[Any, ToolSpec] = {}
        self.compensations: dict[str, tuple[Callable[..., Any], int]] = {}

    def spec_for(self, tool: Any) -> ToolSpec:
        if isinstance(tool, str):
            spec = self.tools.get(tool)
            if spec is None:
                raise ToolNotRegistered(tool)
            return spec
        try:
            return self.by_fn[tool]
        except (KeyError, TypeError):
            name = tool_name_of(tool)
            if name in self.tools:
                return self.tools[name]
            if getattr(tool, "__undolog_spec__", None) is None:
                raise ToolNotClassified(name) from None
            raise ToolNotRegistered(name) from None

    def add_compensation(self, fn: Callable[..., Any], name: str | None = None, version: int | None = None) -> None:
        decl = getattr(fn, "__undolog_compensation__", None)
        if name is None:
            if not isinstance(decl, CompensationDeclaration):
                raise InvalidDeclaration(f"{fn!r} is not an @compensation function")
            name, version = decl.name, decl.version
        desc = CompensationDescriptor.new(name, version or 1)
        self.compensations[desc.name] = (fn, desc.version)

    def register(self, objs: Iterable[Any], *, registered_by: str | None = None) -> list[ToolSpec]:
        pending: list[tuple[Any, ToolDeclaration, dict[str, Any]]] = []
        for obj in objs:
            if isinstance(obj, tuple):
                pending.append(obj)
                continue
            if isinstance(getattr(obj, "__undolog_compensation__", None), CompensationDeclaration):
                self.add_compensation(obj)
                continue
            decl = getattr(obj, "__undolog_spec__", None)
            if not isinstance(decl, ToolDeclaration):
                raise ToolNotClassified(tool_name_of(obj))
            pending.append((obj, decl, {}))
        # Members first, so a composite can inherit their tiers.
        pending.sort(key=lambda p: 1 if p[1].composite_of else 0)
        specs: list[ToolSpec] = []
        for fn, decl, kw in pending:
            decl = self._resolve_composite(decl, kw.get("name") or decl.name or tool_name_of(fn), specs)
            spec = build_spec(fn, decl, **kw)
            specs.append(spec)
        self._persist(specs, registered_by or default_actor())
        for spec in specs:
            old = self.tools.get(spec.name)
            if old is not None and old.fn is not None and old.fn is not spec.fn:
                # The name now means the new function: calls made with the old function object resolve by name,
                # so they meet the new contract (and a session pinned to the old one refuses them).
                try:
                    if self.by_fn.get(old.fn) is old:
                        del self.by_fn[old.fn]
                except TypeError:
                    pass
            self.tools[spec.name] = spec
            if spec.fn is not None:
                try:
                    self.by_fn[spec.fn] = spec
                except TypeError:
                    pass
        return specs

    def _resolve_composite(self, decl: ToolDeclaration, name: str, batch: list[ToolSpec]) -> ToolDeclaration:
        if not decl.composite_of:
            return decl
        known = {s.name: s for s in batch} | self.tools
        top = decl.tier
        for member in decl.composite_of:
            spec = known.get(member)
            if spec is None:
                raise InvalidDeclaration(f"composite {name!r}: member {member!r} is not registered")
            if spec.tier.rank > decl.tier.rank and not decl.inherit_tier:
                raise InvalidDeclaration(
                    f"composite {name!r} declares {decl.tier.value} but member {member!r} is {spec.tier.value}: "
                    "a composite inherits the highest tier of its members and may not declare a lower one"
                )
            if spec.tier.rank > top.rank:
                top = spec.tier
        if top is ToolTier.COMPENSABLE and decl.compensation is None:
            raise InvalidDeclaration(f"composite {name!r} inherits COMPENSABLE and must declare its compensation")
        if top is not ToolTier.COMPENSABLE and decl.compensation is not None:
            raise InvalidDeclaration(f"composite {name!r} is {top.value}; only COMPENSABLE tools take a compensation")
        return dataclasses.replace(decl, tier=top, inherit_tier=False)

    def _persist(self, specs: list[ToolSpec], actor: str) -> None:
        if not specs:
            return
        contracts = [
            ContractRevision(
                tool_name=spec.name,
                tier=spec.tier.value,
                fingerprint=spec.fingerprint,
                contract=spec.contract(),
                compensation_name=spec.compensation.name if spec.compensation else None,
                compensation_version=spec.compensation.version if spec.compensation else None,
            )
            for spec in specs
        ]
        revisions, changes = self._storage.register(contracts, actor=actor, now=utcnow())
        for spec, rev in zip(specs, revisions, strict=True):
            spec.revision = rev.revision
        for change in changes:
            self._note_state(change.session_id, change.state.value)

    def history(self, tool_name: str | None = None) -> list[dict[str, Any]]:
        """Every stored revision (of one tool, or of all), ordered by (tool, revision)."""
        return self._storage.history(tool_name)
