"""Instructions per LangGraph ``create_agent`` step, counted by callgrind: the ratios of agent_step.py without noise.

    .venv/bin/python benchmarks/step_instructions.py [--tier SAFE|COMPENSABLE] [--turns 20]
                                                     [--variants none,model,tool,both,undolog,hitl]

Wall and CPU time of a 5-10 ms step move by several percent between runs on a shared machine (other processes,
CPU frequency, the threads LangGraph starts in every step); a 5% goal needs a finer instrument. Each variant runs
in its own process under ``valgrind --tool=callgrind`` (needs valgrind): two warm-up threads of ``--turns`` steps,
then the counters are zeroed (at ``os.getppid()``), one fresh thread of ``--turns`` steps runs, and the counters are
dumped (at ``os.getpgrp()``): instructions of every thread of the process, per step. The same step as
agent_step.py's (scripted model, InMemorySaver, the tier's one tool call a turn, UndoLog on SQLite with durable
marks); the GIL's switch interval is scaled by valgrind's slowdown, so that the machine's load changes the counts
little. Instructions are not time (a cache miss or an fsync costs none), so
this is beside agent_step.py's ratios, not instead of them.

Variants: ``none`` (the baseline); ``model``/``tool``/``both``: a pass-through middleware with a
``wrap_model_call`` hook, a ``wrap_tool_call`` hook, or both (LangChain's own cost of a middleware with UndoLog's
hooks: each is wrapped in LangSmith's ``traceable``; the hooks are bound as plain functions carrying their
signatures, as UndoLog's are);
``undolog``: ``UndoLogMiddleware``; ``hitl``: ``HumanInTheLoopMiddleware`` gating the tool the model never calls.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("none", "model", "tool", "both", "undolog", "hitl")


def _middleware(variant: str, store_dir: str) -> list[Any]:
    import agent_step as bench
    from langchain.agents.middleware import AgentMiddleware, HumanInTheLoopMiddleware

    from undolog_adapters.langgraph._middleware import _plain_hook

    class Model(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            return handler(request)

    class Tool(AgentMiddleware):
        def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            return handler(request)

    class Both(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            return handler(request)

        def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            return handler(request)

    if variant == "none":
        return []
    if variant in ("model", "tool", "both"):
        passing = {"model": Model, "tool": Tool, "both": Both}[variant]()
        for hook in ("wrap_model_call", "wrap_tool_call"):  # bound as UndoLogMiddleware binds its own
            if hook in type(passing).__dict__:
                setattr(passing, hook, _plain_hook(getattr(passing, hook)))
        return [passing]
    if variant == "hitl":
        return [HumanInTheLoopMiddleware(interrupt_on={"delete_account": True})]
    from undolog_adapters.langgraph import UndoLogMiddleware
    from undolog_core import UndoLog

    u = UndoLog.open(f"sqlite:///{os.path.join(store_dir, 'steps.db')}")
    u.register(*bench.TOOLS)
    return [UndoLogMiddleware(u, tools=[bench.lookup_order, bench.refund_order, bench.delete_account],
                              compensations=[bench.bench_cancel_refund])]


def child(variant: str, tier: str, turns: int) -> None:
    """Runs under callgrind: warm-up, then one counted thread of ``turns`` steps between getppid and getpgrp."""
    # The GIL's switch interval is wall-clock time: under valgrind, some 50 times slower, the default 5 ms would
    # force a switch every 0.1 ms of the program's own work, and as often more as the machine is loaded (each switch
    # wakes LangGraph's threads: instructions that depend on the load). Scaled by the slowdown, the program switches
    # about as often per unit of work as it does natively.
    sys.setswitchinterval(0.25)
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import agent_step as bench
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    with tempfile.TemporaryDirectory(prefix="undolog-steps-") as store_dir:
        tools: list[Any] = [bench.lookup_order, bench.refund_order, bench.delete_account]
        agent = create_agent(bench._scripted_model(*bench.CALLS[tier]), tools, checkpointer=InMemorySaver(),
                             middleware=_middleware(variant, store_dir))
        run = bench._agent_runner(bench._agent_steps(agent))
        run(turns)
        run(turns)
        gc.collect()
        os.getppid()  # callgrind zeroes its counters here (--zero-before=getppid)
        run(turns)
        os.getpgrp()  # and dumps them here (--dump-before=getpgrp)


def count(variant: str, tier: str, turns: int, out_dir: str) -> float:
    """Instructions per step of ``variant``, from a callgrind run of this script in child mode."""
    prefix = os.path.join(out_dir, f"{tier}.{variant}")
    env = {**os.environ, "PYTHONHASHSEED": "0", "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_TRACING": "false"}
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={prefix}.%p", "--zero-before=getppid",
                    "--dump-before=getpgrp", sys.executable, __file__, "--child", variant, "--tier", tier,
                    "--turns", str(turns)], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dumps = [p for p in Path(out_dir).glob(f"{tier}.{variant}.*.1")]
    if len(dumps) != 1:
        raise RuntimeError(f"expected one callgrind dump for {variant}, found {len(dumps)}")
    for line in dumps[0].read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]) / turns
    raise RuntimeError(f"no summary line in {dumps[0]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", choices=("SAFE", "COMPENSABLE"), default="SAFE")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.tier, args.turns)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="undolog-callgrind-") as out_dir:
        counts = {v: count(v, args.tier, args.turns, out_dir) for v in variants}
    base = counts.get("none")
    both = counts.get("both")
    print(f"{args.tier} step, {args.turns} turns on a fresh thread, instructions per step (callgrind, all threads)")
    for v, n in counts.items():
        cells = [f"{v:8s}", f"{n:14,.0f}"]
        if base:
            cells.append(f"{n / base:.4f}x none ({(n - base):+,.0f})")
        if both and v == "undolog":
            cells.append(f"{n / both:.4f}x both ({(n - both):+,.0f}: UndoLog's own, above LangChain's hook cost)")
        print("  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
