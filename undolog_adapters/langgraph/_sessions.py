"""Which UndoLog session a LangGraph thread is in: ``thread``, then ``thread#2``... after each rollback.

Imports no framework. Also holds the adapters alive in this process, so the module-level helpers
(``rollback``, ``undolog_resume``...) can find "the" UndoLog when the app did not pass one.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from undolog_core import errors

if TYPE_CHECKING:
    from undolog_core import UndoLog

SEP = "#"  # thread "t1" -> sessions "t1", "t1#2", "t1#3"... (a new one after each rollback)

# Adapters alive in this process, so module-level helpers can find "the" UndoLog when there is one.
_ADAPTERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _default_undolog(undolog: UndoLog | None) -> UndoLog:
    if undolog is not None:
        return undolog
    found: dict[int, UndoLog] = {id(a.undolog): a.undolog for a in list(_ADAPTERS)}
    if len(found) == 1:
        return next(iter(found.values()))
    raise errors.ConfigurationError(
        "pass undolog=...: " + ("no UndoLog adapter exists in this process" if not found
                                else "several UndoLog instances are in use")
    )


def _chain(base: str, n: int) -> str:
    return base if n <= 1 else f"{base}{SEP}{n}"


def _chain_index(base: str, sid: str) -> int:
    if sid == base:
        return 1
    return int(sid[len(base) + len(SEP):])


def _base_of(sid: str) -> str:
    head, sep, tail = sid.rpartition(SEP)
    return head if sep and tail.isdigit() else sid


def _thread(config: Mapping[str, Any]) -> Any:
    return (config.get("configurable") or {}).get("thread_id")


def _thread_config(config: Mapping[str, Any] | None, thread_id: str) -> dict[str, Any]:
    base = dict(config or {})
    base["configurable"] = {**(base.get("configurable") or {}), "thread_id": thread_id}
    return base
