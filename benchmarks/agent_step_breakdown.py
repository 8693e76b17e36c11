"""Where a COMPENSABLE ``create_agent`` step's CPU goes, part by part: UndoLog's middleware against its lower bound.

    .venv/bin/python benchmarks/agent_step_breakdown.py [--steps 600] [--runs 3] [--store DIR]

``agent_step.py`` gives ratios of whole steps; on a shared machine their spread (0.1 ms a step and more) hides the
parts this script is for: each middleware hook's own CPU and each of the two durable writes', inside real steps
(the tmpfs store of ``agent_step.py``'s tmpfs row, the same agent and tools). Every part is timed on the thread
clock (``time.thread_time``: only the calling thread's CPU, so another thread or process running meanwhile is not
counted) by a wrapper installed on it, and charged *exclusive* of the parts inside it that are timed too: a hook's
figure leaves out its handler (LangChain's model call, the tool's run) and the writes; ``_prewrite_in`` is the
pre-write's statement alone. Each wrapper adds two clock reads (a system call each) to the part it wraps, about the
same for both variants. A part is printed per step (its CPU over all steps / steps).

Why the thread clock and not cProfile: LangGraph runs the tool node in a new executor thread at every step, which a
profiler enabled on the caller's thread never sees, and a profiler's per-call overhead inflates Python code against
SQLite's C. Why in steps and not in a loop: inside a step every part runs with cold caches (the framework's own
milliseconds run in between), and costs several times what it costs warm (``cpu_per_call.py``): the turn check is
about 3.5 us warm and about 20 us here, the pre-write's statement about 25 us warm and 90 us here.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_step as A  # noqa: E402 - the benchmark's agent, tools and lower bound, and its offline environment

from undolog_core import UndoLog  # noqa: E402

_clock = time.thread_time


class Parts:
    """Exclusive thread CPU per timed part: each wrapper charges its part's time minus that of timed parts inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self._stack = threading.local()

    def timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            stack = getattr(self._stack, "s", None)
            if stack is None:
                stack = self._stack.s = []
            stack.append(0.0)  # the time of timed parts inside this one
            t0 = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = _clock() - t0
                inner = stack.pop()
                if stack:
                    stack[-1] += spent
                total = self.totals.setdefault(label, [0.0, 0.0])
                total[0] += spent - inner
                total[1] += 1

        return wrapper

    def hook(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A middleware hook ``fn(self, request, handler)``, timed without its handler (timed apart)."""

        def hooked(mw: Any, request: Any, handler: Callable[[Any], Any]) -> Any:
            return self.timed(label, fn)(mw, request, self.timed(f"{label}: its handler", handler))

        return hooked


def _plain(fn: Callable[..., Any], owner: Any, like: Any) -> Any:
    """``fn`` bound to ``owner`` as the middleware binds its hooks (``_plain_hook``: what LangSmith reads)."""
    bound: Any = functools.partial(fn, owner)
    bound.__name__, bound.__qualname__, bound.__doc__ = like.__name__, like.__qualname__, like.__doc__
    bound.__signature__ = like.__signature__
    return bound


def run_variant(which: str, steps: int, path: str) -> tuple[dict[str, float], float]:
    """``steps`` steps of one variant on a fresh store (the SQLite file ``path``): its parts (us per step) and the
    step's process CPU (ms)."""
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    from undolog_adapters.langgraph import UndoLogMiddleware
    from undolog_adapters.langgraph import _middleware as mw_module
    from undolog_core.storage import sqlite as sqlite_store

    parts = Parts()
    u = UndoLog.open(f"sqlite:///{path}")
    u.register(*A.TOOLS)
    tools: list[Any] = [A.lookup_order, A.refund_order, A.delete_account]
    hot: Any = u.engine.hot
    saved_prewrite_in = sqlite_store.SQLiteHotPath._prewrite_in
    saved_hooks = {h: getattr(mw_module.UndoLogMiddleware, h) for h in ("wrap_model_call", "wrap_tool_call")}
    try:
        # The writes, in both variants: the hot path's entry points, its one-write path, and the statement.
        hot.prewrite = parts.timed("hot.prewrite (to the group commit)", hot.prewrite)
        hot.mark = parts.timed("hot.mark (to the group commit)", hot.mark)
        hot.group._write_one = parts.timed("_own_commit (the wal-index stamps)", hot.group._write_one)
        hot._write_one = parts.timed("_write_one (pool, lock, the mark's statement)", hot._write_one)
        sqlite_store.SQLiteHotPath._prewrite_in = staticmethod(  # type: ignore[method-assign]
            parts.timed("_prewrite_in (the pre-write's statement)", saved_prewrite_in))
        if which == "undolog":
            for h, fn in saved_hooks.items():  # before the middleware binds its hooks
                setattr(mw_module.UndoLogMiddleware, h, parts.hook(h, fn))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no approver=: irrelevant here (nothing is approved)
                mw: Any = UndoLogMiddleware(u, tools=tools, compensations=[A.bench_cancel_refund])
            guard = mw._undolog_guard
            guard.turn = parts.timed("_Guard.turn (the turn's session check)", guard.turn)
            guard.hot.intercept_spec = parts.timed("Engine.intercept_spec (decision, pre-write call)",
                                                   guard.hot.intercept_spec)
            driver: Any = u.driver
            driver.run_sync = parts.timed("CallDriver.run_sync (tool run around, mark call)", driver.run_sync)
        else:
            mw = A.lower_bound_middleware(u)
            for h in ("wrap_model_call", "wrap_tool_call"):
                hook = getattr(mw, h)
                setattr(mw, h, _plain(parts.hook(h, hook.func), hook.args[0], hook))
            mw.prewrite = parts.timed("LowerBound.prewrite (validate, digest, call)", mw.prewrite)
            mw.mark = parts.timed("LowerBound.mark (result text, call)", mw.mark)
        graph = create_agent(A._scripted_model(*A.CALLS["COMPENSABLE"]), tools, checkpointer=InMemorySaver(),
                             middleware=[mw])
        open_thread = A._agent_steps(graph)

        def run(n: int) -> None:
            for _ in range(max(1, n // 20)):  # threads of 20 turns, as agent_step.py's rounds
                step = open_thread()
                for i in range(20):
                    step(i)

        run(100)  # warm-up: imports, compiled graph caches, connections
        parts.totals.clear()
        c0 = time.process_time()
        run(steps)
        cpu = (time.process_time() - c0) / steps * 1e3
        return {k: v[0] / steps * 1e6 for k, v in parts.totals.items()}, cpu
    finally:
        sqlite_store.SQLiteHotPath._prewrite_in = saved_prewrite_in  # type: ignore[method-assign]
        for h, fn in saved_hooks.items():
            setattr(mw_module.UndoLogMiddleware, h, fn)
        u.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="steps per variant and run")
    p.add_argument("--runs", type=int, default=3, help="runs of each variant, alternating (medians printed)")
    p.add_argument("--store", default=A.SHM if os.path.isdir(A.SHM) else None,
                   help="folder of the SQLite stores (default: /dev/shm, as agent_step.py's tmpfs row)")
    args = p.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"lb": [], "undolog": []}
    cpus: dict[str, list[float]] = {"lb": [], "undolog": []}
    with tempfile.TemporaryDirectory(prefix="undolog-breakdown-", dir=args.store) as d:
        for r in range(args.runs):
            for which in ("lb", "undolog") if r % 2 == 0 else ("undolog", "lb"):
                got, cpu = run_variant(which, args.steps, os.path.join(d, f"{which}-{r}.db"))
                results[which].append(got)
                cpus[which].append(cpu)
    print(f"load average: {Path('/proc/loadavg').read_text().split()[:3]}")
    for which, name in (("lb", "lower bound"), ("undolog", "UndoLogMiddleware")):
        labels = sorted({k for run in results[which] for k in run})
        print(f"\n{name}: median of {args.runs} runs of {args.steps} steps, us per step (thread CPU, exclusive)")
        own = []
        for run in results[which]:
            own.append(sum(v for k, v in run.items() if not k.endswith("its handler")))
        for k in labels:
            print(f"  {statistics.median(run.get(k, 0.0) for run in results[which]):8.1f}  {k}")
        print(f"  {statistics.median(own):8.1f}  all of the above but the handlers")
        print(f"  step: {statistics.median(cpus[which]):.3f} ms process CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
