"""The tool registry: in-process specs and compensations, and the durable, revisioned contract trail."""

from __future__ import annotations

import dataclasses
import getpass
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from . import _schema as t
from ._store import utcnow
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

if TYPE_CHECKING:
    from ._undolog import UndoLog


def default_actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class Registry:
    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog
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
        for attempt in range(3):
            try:
                self._persist_once(specs, actor)
                return
            except IntegrityError:
                # Another process registered the same revision number first; read again and retry.
                if attempt == 2:
                    raise

    def _persist_once(self, specs: list[ToolSpec], actor: str) -> None:
        reg = t.tool_registry
        now = utcnow()
        with self._u.store.tx() as conn:
            for spec in specs:
                latest = conn.execute(
                    sa.select(reg.c.revision, reg.c.fingerprint).where(reg.c.tool_name == spec.name)
                    .order_by(reg.c.revision.desc()).limit(1)
                ).first()
                if latest is not None and latest.fingerprint == spec.fingerprint:
                    spec.revision = int(latest.revision)
                    continue
                spec.revision = 1 if latest is None else int(latest.revision) + 1
                conn.execute(
                    reg.insert().values(
                        tool_name=spec.name,
                        revision=spec.revision,
                        tier=spec.tier.value,
                        fingerprint=spec.fingerprint,
                        previous_fingerprint=None if latest is None else latest.fingerprint,
                        contract=spec.contract(),
                        compensation_name=spec.compensation.name if spec.compensation else None,
                        compensation_version=spec.compensation.version if spec.compensation else None,
                        registered_at=now,
                        registered_by=actor,
                    )
                )
                if latest is not None:
                    self._cancel_bound(conn, spec, now)

    def _cancel_bound(self, conn: Any, spec: ToolSpec, now: Any) -> None:
        """Approvals are bound to (fingerprint, arguments): a contract change cancels the ones not yet run."""
        r = t.approval_requests
        rows = conn.execute(
            sa.select(r.c.approval_request_id, r.c.effect_id, r.c.session_id).where(
                r.c.tool_name == spec.name, r.c.tool_fingerprint != spec.fingerprint,
                r.c.state.in_(("pending", "approved", "auto_approved")),
            )
        ).all()
        for row in rows:
            self._u.approvals.cancel(
                conn, row.approval_request_id, row.effect_id,
                f"the contract of {spec.name!r} changed (revision {spec.revision}); re-request approval", now,
            )
            self._u.engine.refresh_awaiting(conn, row.session_id, now=now)

    def history(self, tool_name: str | None = None) -> list[dict[str, Any]]:
        reg = t.tool_registry
        q = sa.select(reg).order_by(reg.c.tool_name, reg.c.revision)
        if tool_name:
            q = q.where(reg.c.tool_name == tool_name)
        with self._u.store.read() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]
