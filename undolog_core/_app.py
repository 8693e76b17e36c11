"""The one ``--app`` loader: the CLI, the server and anything else that must load an app's compensations use it.

``--app`` (or ``$UNDOLOG_APP``) names where the app's tools and compensations live, so a rollback or a
recovery run outside the app's own process can call them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._plugins import GATEWAY, plugin
from .errors import ConfigurationError

if TYPE_CHECKING:
    from ._undolog import UndoLog


def is_gateway_config(spec: str) -> bool:
    """An ``--app`` that names an MCP gateway's config file (``gateway.toml``) rather than a module."""
    return spec.endswith(".toml")


def _load_gateway(spec: str, into: UndoLog | None) -> UndoLog:
    # The gateway lives in its own package (the mcp extra), found by its entry point (the core imports no package
    # built on it) and loaded only when a config file is named.
    register_gateway = _gateway(spec, "register")
    from ._undolog import UndoLog

    loaded: UndoLog = register_gateway(spec, into if into is not None else UndoLog.open())
    return loaded


def gateway_database(spec: str) -> str | None:
    """The database an MCP gateway's config names (``database = "..."``), or None when it names none.

    Raises:
        ConfigurationError: the mcp extra is missing, or the config's ``database`` is refused.
    """
    found: str | None = _gateway(spec, "database")(spec)
    return found


def _gateway(spec: str, name: str) -> Callable[..., Any]:
    """What the MCP gateway declares under ``name`` in the ``undolog.gateway`` entry-point group."""
    try:
        found = plugin(GATEWAY, name)
    except ImportError as exc:
        raise ConfigurationError(f"--app {spec} is an MCP gateway config: {exc}") from exc
    if found is None:
        raise ConfigurationError(f"--app {spec} is an MCP gateway config, and no installed package provides the "
                                 "gateway: pip install 'undolog[mcp]'")
    return found


def load_app(spec: str | None = None, *, into: UndoLog | None = None) -> UndoLog:
    """Load the app's UndoLog from ``module:attribute`` (or ``$UNDOLOG_APP``), so compensations are registered.

    The attribute may be the app's ``UndoLog`` or a zero-argument callable returning one: that instance, with
    everything it registered, is returned. With ``into`` (an UndoLog already open, such as the server's), the
    spec may instead name what to register into it: a function taking the UndoLog, a list of decorated tools
    and compensations, one of them, or a bare ``module`` (every decorated tool and compensation it defines).

    Args:
        spec: ``module:attribute`` (or ``module`` with ``into``); default ``$UNDOLOG_APP``.
        into: The UndoLog to register into when the spec does not name an UndoLog of its own.

    Returns:
        The app's UndoLog, or ``into`` after registering into it.

    Raises:
        ConfigurationError: No spec, a module or attribute that cannot be found, or something unusable.

    A path ending in ``.toml`` is an MCP gateway's config: its upstreams' classified tools and their
    compensations are registered (into ``into``, or an UndoLog on ``$UNDOLOG_DATABASE_URL``).

    Example:
        >>> undolog = load_app("support.app:undolog")        # the app's own UndoLog
        >>> served = load_app("support.tools", into=server)  # registers the module's tools into ``server``
    """
    from ._undolog import UndoLog

    spec = spec or os.environ.get("UNDOLOG_APP")
    if not spec:
        raise ConfigurationError("no app given: pass --app module:attribute or set UNDOLOG_APP")
    if is_gateway_config(spec):
        return _load_gateway(spec, into)
    if ":" not in spec and into is None:
        raise ConfigurationError(f"--app must look like module:attribute, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    # Found from the directory the command runs in, as `python -m` and `undolog check-undo` find theirs: the app's
    # package is seldom installed, and `undolog --app myagent.app:undolog ...` is run from the project's folder.
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {mod_name!r} for --app: {exc}") from exc
    if not attr:
        assert into is not None
        found = [v for v in vars(mod).values() if _is_declared(v)]
        if found:
            into.register(*found)
        return into
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise ConfigurationError(f"module {mod_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, UndoLog):
        _check_compensations(obj, spec)
        return obj
    if into is not None:
        if _is_declared(obj):
            into.register(obj)
            return into
        if isinstance(obj, list | tuple | set):
            into.register(*obj)
            return into
        if callable(obj) and _arity(obj) == 1:
            obj(into)
            return into
    if callable(obj) and not _is_declared(obj) and _arity(obj) in (0, None):
        obj = obj()
    if isinstance(obj, UndoLog):
        _check_compensations(obj, spec)
    if not isinstance(obj, UndoLog):
        what = (
            "an UndoLog (or a factory returning one), a function taking the UndoLog, a list of tools, or a "
            "decorated tool"
            if into is not None
            else "an UndoLog (or a zero-argument factory returning one)"
        )
        raise ConfigurationError(f"--app {spec} must name {what} (got {type(obj).__name__})")
    return obj


def _check_compensations(u: UndoLog, spec: str) -> None:
    """Refuse an app whose tools name compensations it never registered: a rollback (``undolog rollback``, the
    desk's) would stop at the first such call, with its effect still in the world."""
    missing = sorted(f"{name} -> {tool.compensation.name!r}" for name, tool in u.registry.tools.items()
                     if tool.compensation is not None and tool.compensation.name not in u.registry.compensations)
    if missing:
        raise ConfigurationError(
            f"--app {spec}: compensations named but registered nowhere ({', '.join(missing)}): register them in the "
            "app (undolog.register(fn) or register_compensation) before handing its UndoLog over")


def _is_declared(v: Any) -> bool:
    return hasattr(v, "__undolog_spec__") or hasattr(v, "__undolog_compensation__")


def _arity(fn: Any) -> int | None:
    """How many parameters ``fn`` takes; None when it cannot be told (a builtin, say)."""
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
