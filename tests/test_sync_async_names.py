"""The public sync/async pairs keep their names and their kinds (issue #35, step 4).

The rule: a new pair is ``x`` (sync) and ``ax`` (async). The names that predate it keep theirs, because renaming them
would flip what an existing name means: ``Session.call`` and ``Session.rollback`` are async and their sync forms
``call_sync`` / ``rollback_sync`` (so are the saga's); the driver's ``run_sync`` / ``run_async`` and ``call_sync`` /
``call_async``. Every public function or method UndoLog defines on the surfaces below that is async, or that has an
``a``-named twin, is listed here: a name renamed, added, dropped, or turned from sync to async (or back) fails.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import undolog_adapters.langgraph as langgraph
import undolog_adapters.semantic_kernel as semantic_kernel
from undolog_core import Session, UndoLog
from undolog_core._saga import Saga
from undolog_core.integration import CallDriver

# What UndoLogMiddleware() builds by default (interrupt_mode="batched"): its one pause per model message adds a hook.
BATCHED = type(langgraph.UndoLogMiddleware.__new__(langgraph.UndoLogMiddleware))

# (surface, sync name, async name): the pairs, each a sync callable and its async twin.
PAIRS: list[tuple[Any, str, str]] = [
    (UndoLog, "rollback", "arollback"),
    (Session, "call_sync", "call"),
    (Session, "rollback_sync", "rollback"),
    (Saga, "rollback_sync", "rollback"),
    (CallDriver, "decide", "adecide"),
    (CallDriver, "run_sync", "run_async"),
    (CallDriver, "call_sync", "call_async"),
    (CallDriver, "rollback_noting", "arollback_noting"),
    (langgraph, "rollback", "arollback"),
    (langgraph, "undolog_resume", "aundolog_resume"),
    (langgraph, "resume_decided", "aresume_decided"),
    (langgraph.UndoLogMiddleware, "wrap_model_call", "awrap_model_call"),
    (langgraph.UndoLogMiddleware, "wrap_tool_call", "awrap_tool_call"),
    (BATCHED, "wrap_model_call", "awrap_model_call"),
    (BATCHED, "wrap_tool_call", "awrap_tool_call"),
    # (BATCHED's after_model / aafter_model: no longer UndoLog's own. The batched gate asks inside the model call
    # (wrap_model_call / awrap_model_call, above) and the names are LangChain's base hooks again, still callable.)
]

# The pairs named before the x / ax rule: renaming them would flip an existing name's meaning.
BEFORE_THE_RULE = {(Session, "call_sync", "call"), (Session, "rollback_sync", "rollback"),
                   (Saga, "rollback_sync", "rollback"), (CallDriver, "run_sync", "run_async"),
                   (CallDriver, "call_sync", "call_async")}

# Async with no sync twin: Semantic Kernel runs only on an event loop.
ASYNC_ONLY: dict[Any, set[str]] = {
    semantic_kernel: {"invoke", "resume", "resume_agent", "resume_pending"},
    semantic_kernel.UndoLogFilter: {"auto_function_invocation", "function_invocation"},
}

SURFACES = list(dict.fromkeys([s for s, _, _ in PAIRS] + list(ASYNC_ONLY)))


def _ours(surface: Any) -> dict[str, Any]:
    """The public callables UndoLog itself defines on ``surface`` (a framework base class's own are not ours)."""
    found: dict[str, Any] = {}
    if inspect.ismodule(surface):
        items = [(n, getattr(surface, n)) for n in dir(surface)]
    else:
        items = [(n, v) for klass in reversed(surface.__mro__) for n, v in vars(klass).items()]
    for name, value in items:
        fn = inspect.unwrap(value.__func__ if isinstance(value, (staticmethod, classmethod)) else value)
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        if (getattr(fn, "__module__", "") or "").startswith(("undolog_core", "undolog_adapters")):
            found[name] = fn
    return found


def _is_async(fn: Any) -> bool:
    """A coroutine function, or a plain function that returns the coroutine running it (``run_async``)."""
    if inspect.iscoroutinefunction(fn):
        return True
    returns = inspect.signature(fn).return_annotation
    return isinstance(returns, str) and returns.startswith(("Coroutine[", "Awaitable["))


def _name(surface: Any) -> str:
    return str(surface.__name__)


@pytest.mark.parametrize(("surface", "sync", "async_"), PAIRS, ids=lambda v: v if isinstance(v, str) else _name(v))
def test_each_pair_is_a_sync_name_and_its_async_twin(surface: Any, sync: str, async_: str) -> None:
    ours = _ours(surface)
    assert sync in ours and async_ in ours, f"{_name(surface)}: {sync} / {async_} renamed or gone"
    assert not _is_async(ours[sync]), f"{_name(surface)}.{sync} is the sync form: it turned async"
    assert _is_async(ours[async_]), f"{_name(surface)}.{async_} is the async form: it turned sync"
    if (surface, sync, async_) not in BEFORE_THE_RULE:
        assert async_ == "a" + sync, f"{_name(surface)}: a pair's async name is its sync name with an 'a'"


@pytest.mark.parametrize("surface", SURFACES, ids=_name)
def test_every_async_name_and_every_twin_is_listed(surface: Any) -> None:
    ours = _ours(surface)
    pairs = {(s, a) for x, s, a in PAIRS if x is surface}
    listed_async = {a for _, a in pairs} | ASYNC_ONLY.get(surface, set())
    found_async = {n for n, fn in ours.items() if _is_async(fn)}
    assert found_async == listed_async, (f"{_name(surface)}: async names not as listed (new: "
                                         f"{sorted(found_async - listed_async)}, gone or sync: "
                                         f"{sorted(listed_async - found_async)})")
    twins = {(n[1:], n) for n in ours if n.startswith("a") and n[1:] in ours}
    assert twins <= pairs, f"{_name(surface)}: x / ax twins not listed in PAIRS: {sorted(twins - pairs)}"
