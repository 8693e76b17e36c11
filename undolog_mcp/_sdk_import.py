"""Start-up of the processes UndoLog starts per MCP session: the MCP SDK's package ``__init__`` files are run only
when a name defined in them is asked for.

``import mcp.types`` runs ``mcp/__init__.py`` first, and that imports the SDK's client and server sessions, its
stdio transports and, through ``mcp/server/__init__.py``, FastMCP (starlette, uvicorn, sse-starlette, jsonschema,
pydantic-settings): about 0.3 CPU s that ``undolog mcp serve`` and ``undolog mcp connect`` never use, paid by every
gateway an MCP client starts (one per session, for a client that opens a session per call). :func:`defer_inits`
registers the two packages without running their ``__init__``; each runs the first time a name it defines (not a
submodule) is asked for, so ``from mcp import ClientSession`` keeps working in the same process.

It also keeps out httpx's command-line client: httpx's ``__init__`` imports it (``httpx._main``: click, pygments
and Rich, about 80 modules) whenever those are installed, as they are beside most dev tools, and the SDK imports
httpx in every process for its HTTP transports. A gateway never runs ``httpx.main``; without its module, httpx's
``__init__`` defines a stub ``main`` instead (what it does when ``httpx[cli]`` is not installed).

Only the CLI's commands call it, before their first SDK import: a process that already imported the SDK keeps it
as it is, and a program that imports ``undolog_mcp`` is left alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

# The SDK packages whose ``__init__`` imports what a gateway does not use (the parent before the child).
DEFERRED = ("mcp", "mcp.server")
# Modules a gateway never uses that a package it imports would import anyway: kept out (an import of one fails).
SKIPPED = ("httpx._main",)

_lock = threading.RLock()


class _DeferredPackage(types.ModuleType):
    """A package whose ``__init__`` has not run yet: its submodules import as usual; any other name runs it."""

    def __getattr__(self, name: str) -> Any:
        sub = f"{self.__name__}.{name}"
        if importlib.util.find_spec(sub) is not None:  # a submodule (``from mcp import types``): import just that
            return importlib.import_module(sub)
        _run_init(self)
        return object.__getattribute__(self, name)


def _run_init(module: types.ModuleType) -> None:
    """Run the package's real ``__init__`` in its own namespace, once; it becomes a plain module again."""
    with _lock:
        if not isinstance(module, _DeferredPackage):
            return  # another thread ran it
        spec = module.__spec__
        assert spec is not None and spec.loader is not None
        setattr(module, "__class__", types.ModuleType)  # noqa: B010 - mypy types __class__ by the narrowed type
        try:
            spec.loader.exec_module(module)
        except BaseException:
            setattr(module, "__class__", _DeferredPackage)  # noqa: B010 - as above: another try runs it again
            raise


def defer_inits() -> None:
    """Register :data:`DEFERRED` without running their ``__init__`` (a no-op for any already imported, or when
    the SDK is not installed: the first import then fails as it would have), and keep :data:`SKIPPED` out (unless
    its package is imported already)."""
    with _lock:
        for name in SKIPPED:
            if name.rpartition(".")[0] not in sys.modules:
                # None in sys.modules is the import system's "not importable" (typeshed types the values as modules).
                sys.modules.setdefault(name, None)  # type: ignore[arg-type]
        for name in DEFERRED:
            if name in sys.modules:
                continue
            parent, _, child = name.rpartition(".")
            if parent and parent not in sys.modules:
                return
            spec = importlib.util.find_spec(name)  # a child's is found on its (deferred) parent's __path__
            if spec is None or spec.submodule_search_locations is None:
                return
            module = _DeferredPackage(name)
            module.__spec__ = spec
            module.__loader__ = spec.loader
            module.__file__ = spec.origin
            module.__path__ = list(spec.submodule_search_locations)
            module.__package__ = name
            sys.modules[name] = module
            if parent:
                setattr(sys.modules[parent], child, module)
