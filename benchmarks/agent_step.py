"""UndoLog inside the frameworks: what it adds to an agent step, as ratios measured in the same run.

    .venv/bin/python benchmarks/agent_step.py [--db sqlite|postgres|both] [--quick] [--pg-url URL]
                                              [--only langgraph,crewai,sk] [--rounds N] [--turns N] [--match TEXT]

A *step* is one user turn of a real agent loop: the scripted model (no network, no keys) asks for one tool call,
the framework runs it, the model answers. A round runs ``--turns`` steps (20) on a fresh thread of each variant; a
variant's sample is its mean step time in that round. LangGraph's variants are interleaved turn by turn (turn 1 of
each variant of a tier in a shuffled order, then turn 2...: a change of the machine's load falls on all of them
alike); the other sections run each variant's turns as one block, in a shuffled order. Every round starts with
``gc.collect()``. A ratio is paired: each round divides the variant's sample by its baseline's sample of the same
round, and the figure is the median of those per-round ratios, with their p25-p75 beside it (the spread; a goal is
met when the median is under it). The SAFE "no middleware, again" row is the baseline measured against itself: its
spread is the measurement's own resolution in that run. The same ratios in CPU time of the process (all its
threads) are printed beside: they hold on a loaded machine, where wall time mostly measures the other processes,
but leave out what is no CPU time (an fsync's wait, the database server's own work).
"Lower bound" rows are not competitors: the work no implementation can skip (see ``lower_bound_middleware``); when
one misses a goal, the goal is out of reach on this machine in this run, and "over its lower bound" rows show
UndoLog's own cost above it (goal 1.10x, as in ``overhead.py``).

1. LangGraph ``create_agent`` (InMemorySaver unless said), one tool per turn, for a SAFE and a COMPENSABLE tool:
   no middleware (the baseline); LangChain's ``HumanInTheLoopMiddleware`` gating only the IRREVERSIBLE tool (which
   the model never calls: HITL's cost on an ungated step); ``UndoLogMiddleware`` on SQLite (durable commit marks,
   and ``fast_commit_mark=True``) and on PostgreSQL; LangGraph's ``PostgresSaver`` alone and with UndoLog on
   PostgreSQL. Goals (issue 13): SAFE <= 1.05x and COMPENSABLE <= 1.16x with UndoLog on SQLite, durable marks;
   what UndoLog adds next to PostgresSaver <= 25% of what PostgresSaver itself adds (the "share" rows:
   (PostgresSaver + UndoLog - PostgresSaver) / (PostgresSaver - none), per round, then the median).
   The COMPENSABLE step also runs with the SQLite store on tmpfs (``/dev/shm``, durable marks): the disk's fsyncs
   are out, so what remains over the no-middleware step is UndoLog's own work (goal, issue 35: <= 1.10x), beside
   its lower bound on the same tmpfs store. The same COMPENSABLE step is also run through ``ainvoke`` (the async path: middleware ``awrap_tool_call``),
   with its own lower bound (``awrap_*`` hooks, the writes on the loop), and again with LangSmith's
   ``aio_to_thread`` run inline ("LangSmith inline": ``traceable`` otherwise makes two executor hops per async hook).
2. CrewAI: a one-agent crew with a scripted LLM (native tool calling); one kickoff is a step; the tool wrapped by
   ``wrap_tools`` against the same tool unwrapped. A round runs four interleaved blocks of ``--turns``/4 kickoffs
   per variant (one in ``--quick``).
3. Semantic Kernel: the auto function-calling loop of a scripted chat service; ``install``-ed filter against none.
   A step is a quarter of a millisecond, so a round runs ten conversations of ``--turns`` steps per variant (one
   in ``--quick``), each time in a new shuffled order: one conversation's block is shorter than the machine's
   scheduling jitter.

Group commit: the last section runs N concurrent LangGraph threads (one per worker thread, each its own UndoLog
session) with a COMPENSABLE tool on SQLite and on PostgreSQL, and prints how many durable commits the hot path
issued per commit mark (``commits/mark`` < 1 means marks were batched across sessions).

It is a report: the exit status is 0 whatever the numbers (non-zero only if the benchmark itself breaks).
``--quick`` is a smoke run for CI (a few seconds per framework).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Frameworks that phone home are kept offline (as in .ci/run); set before any of them is imported.
for _k, _v in {"CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true", "CREWAI_TESTING": "true",
               "CREWAI_TRACING_ENABLED": "false", "CREWAI_DISABLE_VERSION_CHECK": "true",
               "CREWAI_DISABLE_TRACKING": "true", "LANGCHAIN_TRACING_V2": "false",
               "LANGSMITH_TRACING": "false"}.items():
    os.environ.setdefault(_k, _v)

from overhead import quartiles  # noqa: E402 - the same paired-round statistics as the core's benchmark

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool  # noqa: E402

DEFAULT_PG_URL = os.environ.get("UNDOLOG_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

# -- the tools (trivial bodies: what is measured is the framework and UndoLog, not the tool) -------------


@undolog_tool(tier=ToolTier.SAFE)
def lookup_order(order_id: str) -> str:
    """Look an order up."""
    return f"order {order_id}: shipped"


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("bench_cancel_refund"))
def refund_order(order_id: str, amount: int) -> str:
    """Refund an order."""
    return f"refunded {amount} on {order_id}"


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes the account")
def delete_account(user_id: str) -> str:
    """Delete an account (never called by the script: only gated)."""
    return f"deleted {user_id}"


@compensation("bench_cancel_refund")
def bench_cancel_refund(ctx: Any) -> None:
    return None


TOOLS = (lookup_order, refund_order, delete_account, bench_cancel_refund)
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "SAFE": ("lookup_order", {"order_id": "A-17"}),
    "COMPENSABLE": ("refund_order", {"order_id": "A-17", "amount": 25}),
}

# -- measurement (the style of overhead.py) ----------------------------------------------------------------


@dataclass
class Variant:
    name: str
    run: Callable[[int], float]  # runs n steps on a fresh thread/session, returns the seconds they took
    baseline: str | None = None
    goal: float | None = None
    samples: list[float] = field(default_factory=list)  # per-step seconds, one per round
    cpu: list[float] = field(default_factory=list)  # per-step CPU seconds of the process (all threads), per round
    # A lower bound's name: the "over its lower bound" row divides this variant by it, per round (goal: over_goal).
    over: str | None = None
    over_goal: float | None = None
    # Opens a fresh thread/session and returns its step (runs turn i): lets ``measure`` interleave the variants
    # turn by turn. None: the variant's turns of a round run as one block.
    open: Callable[[], Callable[[int], None]] | None = None
    # Stepped variants are interleaved with those of their group only (a tier: a COMPENSABLE step's commits between
    # two SAFE steps would make every SAFE turn re-read its session, which a SAFE agent alone does not).
    group: str = ""
    # Blocks of n steps (each on a fresh thread/session) a round runs of this variant, the variants' blocks
    # interleaved in a shuffled order each time (see ``measure``): for steps so short that one block is shorter
    # than the machine's scheduling jitter.
    reps: int = 1


@dataclass
class Share:
    """(with - alone) / (alone - none), per round: what UndoLog adds as a share of what another layer adds."""

    name: str
    none: str
    alone: str
    with_: str
    goal: float | None = None


def measure(variants: list[Variant], *, rounds: int, turns: int, rng: random.Random) -> None:
    """``rounds`` paired samples of every variant: its mean step time (wall and CPU) over ``turns`` steps.

    Each round starts from a full collection (``gc.collect()``), the same for every variant. When every variant can
    be stepped (``Variant.open``), a round runs, group by group (``Variant.group``), turn 1 of each variant of the
    group (on its own fresh thread, in a shuffled order), then turn 2 of each, and so on: each step is timed alone,
    and the steps a ratio compares ran moments apart, so a change of the machine's load (other processes, CPU
    frequency) falls on every variant alike instead of on the variant whose block it hit. The steps are the same as
    in a block (the same thread, turn after turn), and all that happens inside a step (its collections, its threads)
    is counted in it. Otherwise each variant runs its turns as one block, in a shuffled order.
    """
    for v in variants:  # warm-up: imports, graph compilation caches, pool connections, the lease thread
        v.run(max(2, turns // 4))
    stepped = all(v.open is not None for v in variants)
    groups: dict[str, list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.group, []).append(v)
    for _ in range(rounds):
        if stepped:
            for group in rng.sample(list(groups.values()), len(groups)):
                gc.collect()
                _stepped_round(group, turns, rng)
            continue
        order = list(variants)
        reps = max(v.reps for v in variants)
        if reps == 1:
            rng.shuffle(order)
            for v in order:
                gc.collect()
                # CPU time beside wall time: on a loaded machine the wall clock mostly measures the other processes
                # (and the disk's fsyncs, which are no CPU time: a step's durable commits show in wall time only).
                c0 = time.process_time()
                v.samples.append(v.run(turns) / turns)
                v.cpu.append((time.process_time() - c0) / turns)
            continue
        # Short blocks, interleaved: ``reps`` times every variant's block in a new shuffled order, so that a slow
        # moment of the machine falls on a block of each variant alike (one long block per variant took whole
        # slow phases: the baseline itself spread 0.18-0.26 ms a step). One collection a round, not a block.
        wall = dict.fromkeys(range(len(order)), 0.0)
        cpu = dict.fromkeys(range(len(order)), 0.0)
        gc.collect()
        for _ in range(reps):
            idx = list(range(len(order)))
            rng.shuffle(idx)
            for j in idx:
                c0 = time.process_time()
                wall[j] += order[j].run(turns)
                cpu[j] += time.process_time() - c0
        for j, v in enumerate(order):
            v.samples.append(wall[j] / (turns * reps))
            v.cpu.append(cpu[j] / (turns * reps))


def _stepped_round(variants: list[Variant], turns: int, rng: random.Random) -> None:
    steps = [v.open() for v in variants if v.open is not None]  # a fresh thread/session of each
    wall = [0.0] * len(variants)
    cpu = [0.0] * len(variants)
    order = list(range(len(variants)))
    for i in range(turns):
        rng.shuffle(order)
        for j in order:
            c0 = time.process_time()
            t0 = time.perf_counter()
            steps[j](i)
            t1 = time.perf_counter()
            cpu[j] += time.process_time() - c0
            wall[j] += t1 - t0
    for v, w, c in zip(variants, wall, cpu, strict=True):
        v.samples.append(w / turns)
        v.cpu.append(c / turns)


@dataclass
class Row:
    section: str
    variant: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    ratio: float | None = None
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    goal: float | None = None
    share: bool = False
    cpu_ratio: float | None = None
    cpu_lo: float | None = None
    cpu_hi: float | None = None

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "baseline"
        if self.goal is None:
            return ""
        if ": lower bound" in self.variant:
            # Not UndoLog: whether the goal is within reach of any implementation on this machine, in this run.
            return "reachable" if self.ratio <= self.goal else "OUT OF REACH"
        return "PASS" if self.ratio <= self.goal else "MISS"


def rows_for(section: str, variants: list[Variant], shares: list[Share] = ()) -> list[Row]:  # type: ignore[assignment]
    by_name = {v.name: v for v in variants}
    out = []
    for v in variants:
        lo, hi = quartiles(v.samples)
        row = Row(section, v.name, statistics.median(v.samples) * 1e3, lo * 1e3, hi * 1e3, goal=v.goal)
        if v.baseline:
            paired = [a / b for a, b in zip(v.samples, by_name[v.baseline].samples, strict=True)]
            row.ratio = statistics.median(paired)
            row.ratio_lo, row.ratio_hi = quartiles(paired)
            cpu = [a / b for a, b in zip(v.cpu, by_name[v.baseline].cpu, strict=True)]
            row.cpu_ratio = statistics.median(cpu)
            row.cpu_lo, row.cpu_hi = quartiles(cpu)
        out.append(row)
        if v.over:
            # UndoLog over the lower bound of its own mode, per round: what its own bookkeeping adds.
            lb = by_name[v.over]
            paired = [a / b for a, b in zip(v.samples, lb.samples, strict=True)]
            cpu = [a / b for a, b in zip(v.cpu, lb.cpu, strict=True)]
            over = Row(section, f"{v.name.split(':')[0]}: ... over its lower bound", float("nan"), float("nan"),
                       float("nan"), statistics.median(paired), *quartiles(paired), v.over_goal, share=False,
                       cpu_ratio=statistics.median(cpu))
            over.cpu_lo, over.cpu_hi = quartiles(cpu)
            out.append(over)
    for s in shares:
        none, alone, with_ = by_name[s.none].samples, by_name[s.alone].samples, by_name[s.with_].samples
        per_round = [(w - a) / (a - n) if a > n else float("inf") for n, a, w in zip(none, alone, with_, strict=True)]
        lo, hi = quartiles(per_round)
        added = statistics.median([w - a for a, w in zip(alone, with_, strict=True)]) * 1e3
        saver = statistics.median([a - n for n, a in zip(none, alone, strict=True)]) * 1e3
        out.append(Row(section, f"{s.name} (+{added:.2f} ms vs +{saver:.2f} ms)", float("nan"), float("nan"),
                       float("nan"), statistics.median(per_round), lo, hi, s.goal, share=True))
        # The same share in CPU time (what the fsyncs and the server's own work leave out).
        cn, ca, cw = by_name[s.none].cpu, by_name[s.alone].cpu, by_name[s.with_].cpu
        cpu_rounds = [(w - a) / (a - n) if a > n else float("inf") for n, a, w in zip(cn, ca, cw, strict=True)]
        out[-1].cpu_ratio = statistics.median(cpu_rounds)
        out[-1].cpu_lo, out[-1].cpu_hi = quartiles(cpu_rounds)
    return out


# -- LangGraph create_agent ------------------------------------------------------------------------------------


def _scripted_model(tool: str, args: dict[str, Any]) -> Any:
    """A chat model that asks for ``tool(**args)`` after each user message and answers after its result."""
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    class Scripted(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "undolog-bench-scripted"

        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self

        def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                      **kwargs: Any) -> ChatResult:
            if isinstance(messages[-1], HumanMessage):
                msg = AIMessage(content="", tool_calls=[{"name": tool, "args": dict(args),
                                                         "id": "call_" + uuid.uuid4().hex[:12], "type": "tool_call"}])
            else:
                msg = AIMessage(content="done")
            return ChatResult(generations=[ChatGeneration(message=msg)])

    return Scripted()


async def _inline_to_thread(default: Any, ctx: Any, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """LangSmith's ``aio_to_thread`` run inline, on the loop: what a deployment without tracing can install with
    ``langsmith.set_runtime_overrides(aio_to_thread=...)`` (process-wide: it is LangSmith's, not UndoLog's, to set)."""
    return ctx.run(func, *args, **kwargs)


def _agent_steps(agent: Any, *, is_async: bool = False, loop: asyncio.AbstractEventLoop | None = None,
                 inline_langsmith: bool = False) -> Callable[[], Callable[[int], None]]:
    """Opens a fresh thread of ``agent`` (a fresh UndoLog session) and returns its step: user turn i, checked.

    ``inline_langsmith``: the step runs with LangSmith's ``aio_to_thread`` inline (``_inline_to_thread``), set for
    this step only, so the variant interleaves with the others (each of which runs with LangSmith's default)."""

    def open_thread() -> Callable[[int], None]:
        config = {"configurable": {"thread_id": "t-" + uuid.uuid4().hex[:12]}}

        def step(i: int) -> None:
            _check(agent.invoke({"messages": [{"role": "user", "content": f"turn {i}"}]}, config))

        async def astep(i: int) -> None:
            _check(await agent.ainvoke({"messages": [{"role": "user", "content": f"turn {i}"}]}, config))

        if is_async and inline_langsmith:
            assert loop is not None
            import langsmith

            def inlined(i: int) -> None:
                langsmith.set_runtime_overrides(aio_to_thread=_inline_to_thread)
                try:
                    loop.run_until_complete(astep(i))
                finally:
                    langsmith.set_runtime_overrides(aio_to_thread=None)

            return inlined
        if is_async:
            assert loop is not None
            return lambda i: loop.run_until_complete(astep(i))
        return step

    return open_thread


def _agent_runner(open_thread: Callable[[], Callable[[int], None]]) -> Callable[[int], float]:
    """n user turns on a fresh thread (``_agent_steps``); the seconds they took."""

    def run(n: int) -> float:
        step = open_thread()
        t0 = time.perf_counter()
        for i in range(n):
            step(i)
        return time.perf_counter() - t0

    return run


def _check(out: Any) -> None:
    # A benchmark of a broken step measures nothing: every turn must have run its tool and answered.
    msgs = out["messages"]
    tool_msg = msgs[-2]
    if getattr(tool_msg, "status", "success") != "success" or msgs[-1].content != "done":
        raise RuntimeError(f"the step did not run its tool: {tool_msg!r}")


class PgSaver:
    """LangGraph's PostgresSaver on its own schema (one connection, as ``from_conn_string`` opens it)."""

    def __init__(self, pg_url: str, schema: str) -> None:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row

        conninfo = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
        self.conn = psycopg.connect(conninfo, autocommit=True, prepare_threshold=0, row_factory=dict_row,
                                    options=f"-csearch_path={schema}")
        self.saver = PostgresSaver(self.conn)
        self.saver.setup()

    def close(self) -> None:
        self.conn.close()


def lower_bound_middleware(u: UndoLog | None, *, durable: bool = True) -> Any:
    """A lower bound for UndoLog's middleware, not a competitor: the work no middleware can skip, with nothing else.

    With ``u=None``: a pass-through middleware with UndoLog's hooks (``wrap_model_call`` and ``wrap_tool_call``, and
    their ``awrap_*`` twins for ``ainvoke``, where the writes are made on the loop):
    LangChain's own cost of having them (it wraps each hook in LangSmith's ``traceable`` and composes handlers),
    which UndoLog cannot go under. With a store: the same, and around each tool call what a COMPENSABLE call must
    store: its arguments validated, snapshotted and digested, an effect id, UndoLog's one-statement pre-write
    (the effect and its undo entry, the session checked), then the tool, then the commit mark: with ``durable``
    at once and fsynced, else queued and written per batch without fsync (fast mode's flusher). Left out, though
    UndoLog needs them: the turn's session check, the pin check, the in-flight set and lease, ``current_call()``,
    the tool's raw value, the effect's metadata on the message. If this row misses a goal, no trimming of
    UndoLog's own code meets it on this machine: only storing less (or a faster disk) would.
    """
    from langchain.agents.middleware import AgentMiddleware

    from undolog_adapters.langgraph._middleware import _plain_hook

    # Internal on purpose: the bound canonicalises and hashes with UndoLog's own code (the same bytes stored).
    from undolog_core._json import canonical_text, sha256_hex
    from undolog_core.limits import result_text
    from undolog_core.storage.base import new_id

    class LowerBound(AgentMiddleware):
        def __init__(self) -> None:
            super().__init__()
            self.marks: list[tuple[str, str, float]] = []
            if u is not None:
                self.session = u.session(agent_id="bench-lower-bound").id
                u.engine.persist(self.session)  # the bound writes straight to the hot path: the row first

        def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            return handler(request)

        def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            if u is None:
                return handler(request)
            spec = u.tool_spec(request.tool_call["name"])
            if spec.compensation is None:
                return handler(request)  # SAFE: nothing stored
            effect_id = self.prewrite(spec, request)
            out = handler(request)
            self.mark(effect_id, out)
            return out

        # The async path (``ainvoke``): the same writes, made on the loop, straight (the cheapest any implementation
        # can make them: no thread hop, no wait for a lock held elsewhere, which UndoLog's hot path must handle).
        async def awrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            return await handler(request)

        async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            if u is None:
                return await handler(request)
            spec = u.tool_spec(request.tool_call["name"])
            if spec.compensation is None:
                return await handler(request)
            effect_id = self.prewrite(spec, request)
            out = await handler(request)
            self.mark(effect_id, out)
            return out

        def prewrite(self, spec: Any, request: Any) -> str:
            assert u is not None
            hot = u.engine.hot
            model = spec.validate(request.tool_call["args"])
            text = canonical_text(spec.snapshot(model))
            effect_id, now = new_id(), time.time()
            if not hot.prewrite(self.session, 0, effect_id, effect_id, spec.name, spec.revision, text,
                                sha256_hex(text), u.engine.owner, now, now + u.lease_seconds, spec.compensation.name,
                                spec.compensation.version):
                raise RuntimeError("the lower bound's pre-write was refused")
            return effect_id

        def mark(self, effect_id: str, out: Any) -> None:
            assert u is not None
            hot = u.engine.hot
            if durable:
                hot.mark(effect_id, result_text(out.content), time.time(), fast=False)
            else:
                self.marks.append((effect_id, result_text(out.content), time.time()))
                if len(self.marks) >= 20:  # a flusher's batch
                    hot.mark_many(self.marks)
                    self.marks = []

    # UndoLog's middleware binds its hooks as plain functions carrying their signatures, as any middleware can
    # (LangSmith's ``traceable``, which LangChain wraps every hook in, rebuilds a bound method's signature on each
    # call): so does the lower bound.
    lower = LowerBound()
    for hook in ("wrap_model_call", "wrap_tool_call", "awrap_model_call", "awrap_tool_call"):
        setattr(lower, hook, _plain_hook(getattr(lower, hook)))
    return lower


def langgraph_variants(stores: dict[str, UndoLog], pg_saver: PgSaver | None,
                       loop: asyncio.AbstractEventLoop) -> tuple[list[Variant], list[Share]]:
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware
    from langgraph.checkpoint.memory import InMemorySaver

    from undolog_adapters.langgraph import UndoLogMiddleware

    tools: list[Any] = [lookup_order, refund_order, delete_account]
    variants: list[Variant] = []
    shares: list[Share] = []
    for tier, goal in (("SAFE", 1.05), ("COMPENSABLE", 1.16)):
        model = _scripted_model(*CALLS[tier])

        def agent(middleware: list[Any], saver: Any = None, model: Any = model) -> Any:
            return create_agent(model, tools, checkpointer=saver or InMemorySaver(), middleware=middleware)

        def undolog(u: UndoLog) -> list[Any]:
            return [UndoLogMiddleware(u, tools=tools, compensations=[bench_cancel_refund])]

        def lg(name: str, graph: Any, baseline: str | None = None, goal: float | None = None, *,
               is_async: bool = False, inline_langsmith: bool = False, tier: str = tier, **kw: Any) -> Variant:
            steps = _agent_steps(graph, is_async=is_async, loop=loop, inline_langsmith=inline_langsmith)
            return Variant(name, _agent_runner(steps), baseline, goal, open=steps, group=tier, **kw)

        base = f"{tier}: no middleware"
        variants.append(lg(base, agent([])))
        if tier == "SAFE":
            # The same graph again, measured as a variant: its ratio (1.000x but for noise) and spread are the
            # measurement's own, the resolution every other row of the section has in this run.
            variants.append(lg(f"{tier}: no middleware, again (the measurement's own spread)", agent([]), base))
        variants.append(lg(f"{tier}: HumanInTheLoopMiddleware (gating delete_account only)",
                           agent([HumanInTheLoopMiddleware(interrupt_on={"delete_account": True})]), base))
        if "sqlite" in stores:
            lb = f"{tier}: lower bound, SQLite, durable" if tier == "COMPENSABLE" else \
                f"{tier}: lower bound: a pass-through middleware with UndoLog's hooks"
            variants.append(lg(lb, agent([lower_bound_middleware(stores["sqlite"] if tier == "COMPENSABLE" else None)]),
                               base, goal))
            variants.append(lg(f"{tier}: UndoLogMiddleware, SQLite, durable marks", agent(undolog(stores["sqlite"])),
                               base, goal, over=lb, over_goal=1.10))
            if tier == "COMPENSABLE" and "sqlite-tmpfs" in stores:
                # The store on tmpfs: its commits cost no fsync, so the ratio is UndoLog's own work over the step.
                lbt = f"{tier}: lower bound, SQLite on tmpfs (/dev/shm), durable"
                variants.append(lg(lbt, agent([lower_bound_middleware(stores["sqlite-tmpfs"])]), base, 1.10))
                variants.append(lg(f"{tier}: UndoLogMiddleware, SQLite on tmpfs (/dev/shm), durable marks",
                                   agent(undolog(stores["sqlite-tmpfs"])), base, 1.10, over=lbt, over_goal=1.10))
            if tier == "COMPENSABLE":
                lbf = f"{tier}: lower bound, SQLite, fast mode"
                variants.append(lg(lbf, agent([lower_bound_middleware(stores["sqlite-fast"], durable=False)]), base))
                variants.append(lg(f"{tier}: UndoLogMiddleware, SQLite, fast_commit_mark",
                                   agent(undolog(stores["sqlite-fast"])), base, over=lbf, over_goal=1.10))
                abase = f"{tier}: no middleware, ainvoke"
                variants.append(lg(abase, agent([]), is_async=True))
                # The async lower bound: the same pass-through middleware and writes, through awrap_* hooks.
                alb = f"{tier}: lower bound, SQLite, durable, ainvoke"
                variants.append(lg(alb, agent([lower_bound_middleware(stores["sqlite"])]), abase, goal, is_async=True))
                variants.append(lg(f"{tier}: UndoLogMiddleware, SQLite, durable, ainvoke",
                                   agent(undolog(stores["sqlite"])), abase, goal, is_async=True, over=alb,
                                   over_goal=1.10))
                # LangSmith's ``traceable`` (which LangChain wraps every hook in) runs two functions of each async
                # hook call in the loop's executor, traced or not: six thread hops a step, for any middleware. The
                # same bound and UndoLog with them inline (a deployment without tracing can set that), against the
                # no-middleware step (which has no hook: the setting changes nothing there).
                ilb = f"{tier}: lower bound, SQLite, durable, ainvoke, LangSmith inline"
                variants.append(lg(ilb, agent([lower_bound_middleware(stores["sqlite"])]), abase, goal,
                                   is_async=True, inline_langsmith=True))
                variants.append(lg(f"{tier}: UndoLogMiddleware, SQLite, durable, ainvoke, LangSmith inline",
                                   agent(undolog(stores["sqlite"])), abase, goal, is_async=True,
                                   inline_langsmith=True, over=ilb, over_goal=1.10))
        if "postgres" in stores:
            variants.append(lg(f"{tier}: UndoLogMiddleware, PostgreSQL", agent(undolog(stores["postgres"])), base))
            if pg_saver is not None:
                alone = f"{tier}: PostgresSaver alone"
                with_ = f"{tier}: PostgresSaver + UndoLogMiddleware, PostgreSQL"
                variants.append(lg(alone, agent([], pg_saver.saver), base))
                variants.append(lg(with_, agent(undolog(stores["postgres"]), pg_saver.saver), alone))
                shares.append(Share(f"{tier}: UndoLog's share of PostgresSaver's cost", base, alone, with_,
                                    0.25 if tier == "COMPENSABLE" else None))
                if tier == "COMPENSABLE" and "postgres-fast" in stores:
                    fast = f"{tier}: PostgresSaver + UndoLogMiddleware, PostgreSQL, fast_commit_mark"
                    variants.append(lg(fast, agent(undolog(stores["postgres-fast"]), pg_saver.saver), alone))
                    shares.append(Share(f"{tier}: UndoLog's share of PostgresSaver's cost, fast_commit_mark", base,
                                        alone, fast))
    return variants, shares


# -- CrewAI ------------------------------------------------------------------------------------------------


def crewai_variants(stores: dict[str, UndoLog]) -> tuple[list[Variant], list[Share]]:
    """One kickoff of a one-agent crew (scripted LLM, native tool calling) per step; wrapped tools vs plain."""
    from crewai import Agent, Crew, Task
    from crewai.tools import tool as crewai_tool

    from examples.crewai_support_crew.llm import ScriptedLLM
    from undolog_adapters.crewai import wrap_tools

    variants: list[Variant] = []
    for tier, goal in (("SAFE", 1.05), ("COMPENSABLE", 1.16)):
        name, args = CALLS[tier]

        def crew_of(tools: list[Any], name: str = name, args: dict[str, Any] = args) -> Any:
            llm = ScriptedLLM(model="scripted", steps=[{"tool": name, "args": args}], native=True)
            agent = Agent(role="Support agent", goal="Help the customer", backstory="Scripted", llm=llm,
                          tools=tools, verbose=False, max_iter=3)
            task = Task(description="Handle the ticket", expected_output="a summary", agent=agent)
            return Crew(agents=[agent], tasks=[task], verbose=False)

        plain = crew_of([crewai_tool(lookup_order), crewai_tool(refund_order)])

        def run_plain(n: int, crew: Any = plain) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                crew.kickoff()
            return time.perf_counter() - t0

        base = f"{tier}: plain tools"
        variants.append(Variant(base, run_plain))
        for key, label, g in (("sqlite", "SQLite, durable marks", goal), ("postgres", "PostgreSQL", None)):
            if key not in stores:
                continue
            tools = wrap_tools([lookup_order, refund_order], undolog=stores[key], compensations=[bench_cancel_refund])
            crew = crew_of(list(tools))

            def run_wrapped(n: int, crew: Any = crew, tools: Any = tools) -> float:
                sid = "crew-" + uuid.uuid4().hex[:12]  # one session per round, its kickoffs continue it
                t0 = time.perf_counter()
                for _ in range(n):
                    tools.kickoff(crew, session_id=sid)
                return time.perf_counter() - t0

            variants.append(Variant(f"{tier}: wrap_tools, {label}", run_wrapped, base, g))
    return variants, []


# -- Semantic Kernel ----------------------------------------------------------------------------------------


def sk_variants(stores: dict[str, UndoLog], loop: asyncio.AbstractEventLoop,
                conversations: int = 1) -> tuple[list[Variant], list[Share]]:
    """The auto function-calling loop of a scripted chat service, one user message per step; filter vs none.

    A round runs ``conversations`` fresh conversations of n steps per variant, interleaved (``Variant.reps``): an
    SK step is a quarter of a millisecond, so one conversation's block (about 5 ms) is shorter than the machine's
    scheduling jitter, which then decided a round's ratio (p25-p75 spreads of 0.96-1.14 against a 1.05x goal)."""
    import json as _json

    from semantic_kernel import Kernel
    from semantic_kernel.connectors.ai.chat_completion_client_base import ChatCompletionClientBase
    from semantic_kernel.connectors.ai.function_choice_behavior import FunctionChoiceBehavior
    from semantic_kernel.connectors.ai.prompt_execution_settings import PromptExecutionSettings
    from semantic_kernel.contents import (
        AuthorRole,
        ChatHistory,
        ChatMessageContent,
        FunctionCallContent,
        FunctionResultContent,
    )
    from semantic_kernel.filters import FilterTypes
    from semantic_kernel.functions import kernel_function

    from undolog_adapters.semantic_kernel import install, undolog_session

    class Plugin:
        @kernel_function(name="lookup_order", description="Look an order up.")
        @undolog_tool(tier=ToolTier.SAFE)
        def lookup_order(self, order_id: str) -> str:
            return f"order {order_id}: shipped"

        @kernel_function(name="refund_order", description="Refund an order.")
        @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("bench_cancel_refund"))
        def refund_order(self, order_id: str, amount: int) -> str:
            return f"refunded {amount} on {order_id}"

    class Chat(ChatCompletionClientBase):
        """Asks for ``fn`` after each user message, answers after its result."""

        SUPPORTS_FUNCTION_CALLING: Any = True
        fn: str = ""
        fn_args: dict[str, Any] = {}

        async def _inner_get_chat_message_contents(self, chat_history: Any, settings: Any) -> list[Any]:
            if chat_history.messages[-1].role == AuthorRole.USER:
                call = FunctionCallContent(id="call_" + uuid.uuid4().hex[:12], name=self.fn,
                                           arguments=_json.dumps(self.fn_args))
                return [ChatMessageContent(role=AuthorRole.ASSISTANT, items=[call])]
            return [ChatMessageContent(role=AuthorRole.ASSISTANT, content="done")]

    settings = PromptExecutionSettings(function_choice_behavior=FunctionChoiceBehavior.Auto())

    def kernel_with(u: UndoLog | None, noop_filters: bool = False, bound: UndoLog | None = None,
                    checked: tuple[UndoLog, contextvars.ContextVar[str | None]] | None = None) -> Any:
        kernel = Kernel()
        kernel.add_plugin(Plugin(), plugin_name="shop")
        if u is not None:
            install(kernel, u, compensations=[bench_cancel_refund])
        if noop_filters:
            async def passthrough(context: Any, next: Any) -> None:  # noqa: A002 - SK passes it by this name
                await next(context)

            inner = passthrough if bound is None else _stored_writes_filter(bound)
            kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, inner if checked is None else _checked_filter(*checked))
            kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, passthrough)
        return kernel

    def runner(kernel: Any, chat: Any, session: bool | contextvars.ContextVar[str | None]) -> Callable[[int], float]:
        async def go(n: int) -> float:
            history = ChatHistory()
            sid = "sk-" + uuid.uuid4().hex[:12]
            t0 = time.perf_counter()
            for i in range(n):
                history.add_user_message(f"turn {i}")
                if isinstance(session, contextvars.ContextVar):  # the lower bound's own: the bare variable
                    token = session.set(sid)
                    try:
                        reply = await chat.get_chat_message_content(history, settings, kernel=kernel)
                    finally:
                        session.reset(token)
                elif session:
                    with undolog_session(sid):
                        reply = await chat.get_chat_message_content(history, settings, kernel=kernel)
                else:
                    reply = await chat.get_chat_message_content(history, settings, kernel=kernel)
                if str(reply) != "done":
                    raise RuntimeError(f"the SK step did not finish: {reply!r}")
            elapsed = time.perf_counter() - t0
            ran = [i for m in history.messages for i in m.items if isinstance(i, FunctionResultContent)]
            if len(ran) != n or not all(str(i.result).startswith(("order", "refunded")) for i in ran):
                raise RuntimeError(f"the SK steps did not run their tool: {[str(i.result) for i in ran]}")
            return elapsed

        return lambda n: loop.run_until_complete(go(n))

    variants: list[Variant] = []
    for tier, goal in (("SAFE", 1.05), ("COMPENSABLE", 1.16)):
        name, args = CALLS[tier]
        chat = Chat(ai_model_id="scripted", fn=f"shop-{name}", fn_args=args)
        base = f"{tier}: no filter"
        variants.append(Variant(base, runner(kernel_with(None), chat, False)))
        # SK's own cost of having filters at all (it rebuilds and copies contexts for each): the peer figure, and
        # for a SAFE call the lower bound of any filter (UndoLog installs two).
        lb = f"{tier}: lower bound: two pass-through filters (SK's own cost)"
        variants.append(Variant(lb, runner(kernel_with(None, noop_filters=True), chat, False), base,
                                goal if tier == "SAFE" else None))
        if tier == "SAFE" and "sqlite" in stores:
            # What no implementation of the SAFE guarantees can skip, in the same two filters (see _checked_filter).
            # UndoLog's own bookkeeping is shown over this one ("over its lower bound").
            var: contextvars.ContextVar[str | None] = contextvars.ContextVar("bench_sk_session", default=None)
            lb = f"{tier}: lower bound: session checked, arguments checked, counted"
            variants.append(Variant(lb,
                                    runner(kernel_with(None, noop_filters=True, checked=(stores["sqlite"], var)),
                                           chat, var), base, goal))
        if tier == "COMPENSABLE" and "sqlite" in stores:
            # The same filters storing what a COMPENSABLE call must store (see lower_bound_middleware).
            lb = f"{tier}: lower bound, SQLite, durable"
            variants.append(Variant(lb, runner(kernel_with(None, noop_filters=True, bound=stores["sqlite"]), chat,
                                               False), base, goal))
        for key, label, g in (("sqlite", "SQLite, durable marks", goal), ("postgres", "PostgreSQL", None)):
            if key in stores:
                variants.append(Variant(f"{tier}: UndoLog filter, {label}", runner(kernel_with(stores[key]), chat, True),
                                        base, g, over=lb if key == "sqlite" else None, over_goal=1.10))
    for v in variants:
        v.reps = conversations
    return variants, []


def _checked_filter(u: UndoLog, session: contextvars.ContextVar[str | None]) -> Any:
    """An SK FUNCTION_INVOCATION filter doing, around a SAFE function, what no implementation of UndoLog's SAFE
    guarantees can skip; a lower bound. Per conversation: its session read once (one SELECT of its row: a session
    halted elsewhere refuses, a resumed one keeps its pins). Per turn: the session named (the runner sets the bare
    context variable). Per call: the session's state checked, each argument's type checked against the contract (every
    parameter required, exact types: UndoLog's own as-is path), a copy kept for the approver's view of recent calls,
    the call counted. Nothing is written."""
    from undolog_core.errors import SessionHalted

    hot = u.engine.hot
    seen: dict[str | None, list[Any]] = {}

    async def checked(context: Any, next: Any) -> None:  # noqa: A002 - SK passes it by this name
        sid = session.get()
        sc = seen.get(sid)
        if sc is None:
            row = hot.read_session(sid, wait=False)
            sc = seen[sid] = [row.state if row is not None else "active", 0, collections.deque(maxlen=50)]
        if sc[0] != "active":
            raise SessionHalted(str(sid), "halted")
        args = context.arguments
        if len(args) != 1 or type(args.get("order_id")) is not str:  # the one tool's contract, written out
            raise ValueError("invalid arguments")
        sc[1] += 1
        sc[2].append({**args})
        await next(context)

    return checked


def _stored_writes_filter(u: UndoLog) -> Any:
    """An SK FUNCTION_INVOCATION filter doing, around a COMPENSABLE function, the writes no implementation can skip
    (the pre-write, durable, then the durable commit mark: see ``lower_bound_middleware``); a lower bound."""
    # Internal on purpose: the bound canonicalises and hashes with UndoLog's own code (the same bytes stored).
    from undolog_core._json import canonical_text, sha256_hex
    from undolog_core.limits import result_text
    from undolog_core.storage.base import new_id

    session = u.session(agent_id="bench-lower-bound").id
    u.engine.persist(session)  # the bound writes straight to the hot path: the row first

    async def stored(context: Any, next: Any) -> None:  # noqa: A002 - SK passes it by this name
        spec = u.tool_spec(context.function.name)
        if spec.compensation is None:
            await next(context)
            return
        hot = u.engine.hot
        text = canonical_text(spec.snapshot(spec.validate(dict(context.arguments))))
        effect_id, now = new_id(), time.time()
        if not hot.prewrite(session, 0, effect_id, effect_id, spec.name, spec.revision, text, sha256_hex(text),
                            u.engine.owner, now, now + u.lease_seconds, spec.compensation.name,
                            spec.compensation.version):
            raise RuntimeError("the lower bound's pre-write was refused")
        await next(context)
        hot.mark(effect_id, result_text(context.result.value), time.time(), fast=False)

    return stored


# -- group commit -------------------------------------------------------------------------------------------


@dataclass
class GroupRow:
    store: str
    workers: int
    grouping: str
    steps_per_s: float
    writes: int
    commits: int
    largest: int


def group_commit_rows(stores: dict[str, UndoLog], *, workers: tuple[int, ...], turns: int,
                      rounds: int) -> list[GroupRow]:
    """N agent threads at once (one Python thread and one UndoLog session each), COMPENSABLE tool, durable marks:
    steps per second, and on SQLite how many durable writes each commit carried, with grouping on and off."""
    import threading

    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    from undolog_adapters.langgraph import UndoLogMiddleware

    tools: list[Any] = [lookup_order, refund_order, delete_account]
    model = _scripted_model(*CALLS["COMPENSABLE"])
    out: list[GroupRow] = []
    for key in ("sqlite", "postgres"):
        if key not in stores:
            continue
        u = stores[key]
        agent = create_agent(model, tools, checkpointer=InMemorySaver(),
                             middleware=[UndoLogMiddleware(u, tools=tools, compensations=[bench_cancel_refund])])
        group = getattr(u.engine.hot, "group", None)
        modes = (("on", True), ("off", False)) if group is not None else (("server's own", True),)
        run = _agent_runner(_agent_steps(agent))
        run(2)
        for n in workers:
            for label, enabled in modes:
                if group is not None:
                    group.enabled = enabled
                    w0, c0, group.largest = group.writes, group.commits, 0
                best = 0.0
                for _ in range(rounds):
                    threads = [threading.Thread(target=run, args=(turns,)) for _ in range(n)]
                    t0 = time.perf_counter()
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    best = max(best, n * turns / (time.perf_counter() - t0))
                if group is not None:
                    out.append(GroupRow(key, n, label, best, group.writes - w0, group.commits - c0, group.largest))
                    group.enabled = True
                else:
                    out.append(GroupRow(key, n, label, best, 0, 0, 0))
    return out


def print_group(rows: list[GroupRow]) -> None:
    print()
    print("Group commit: N agent threads at once, COMPENSABLE tool, durable marks (best of the rounds)")
    headers = ("store", "threads", "grouping", "steps/s", "durable writes", "commits", "writes/commit", "largest")
    body = [(r.store, str(r.workers), r.grouping, f"{r.steps_per_s:,.0f}",
             str(r.writes) if r.commits else "", str(r.commits) if r.commits else "",
             f"{r.writes / r.commits:.2f}" if r.commits else ("1.00" if r.grouping == "off" else ""),
             str(r.largest) if r.commits else "") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for b in body:
        print("  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)))


# -- stores -------------------------------------------------------------------------------------------------


#: Where the tmpfs store goes (Linux's memory-backed file system); without it the tmpfs rows are left out.
SHM = "/dev/shm"


class Stores:
    """The UndoLog stores of a run: SQLite files in a temp dir, PostgreSQL in a fresh schema (dropped at the end)."""

    def __init__(self, kinds: tuple[str, ...], pg_url: str) -> None:
        self.opened: dict[str, UndoLog] = {}
        self.tmp = tempfile.TemporaryDirectory(prefix="undolog-agent-step-")
        self.shm: tempfile.TemporaryDirectory[str] | None = None
        self.schema: str | None = None
        self.admin: Any = None
        self.pg_url = pg_url
        self.pg_saver: PgSaver | None = None
        if "sqlite" in kinds:
            url = f"sqlite:///{os.path.join(self.tmp.name, 'bench.db')}"
            self.opened["sqlite"] = UndoLog.open(url)
            self.opened["sqlite-fast"] = UndoLog.open(url, fast_commit_mark=True, migrate=False)
            if os.path.isdir(SHM):
                # A second SQLite store in memory-backed files: the same work, without the disk's fsyncs.
                self.shm = tempfile.TemporaryDirectory(prefix="undolog-agent-step-", dir=SHM)
                shm_url = f"sqlite:///{os.path.join(self.shm.name, 'bench.db')}"
                self.opened["sqlite-tmpfs"] = UndoLog.open(shm_url)
        if "postgres" in kinds:
            import sqlalchemy as sa

            self.schema = "bench_" + uuid.uuid4().hex[:12]
            self.admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", pool_size=1)
            with self.admin.connect() as c:
                c.exec_driver_sql(f'CREATE SCHEMA "{self.schema}"')
            self.opened["postgres"] = UndoLog.open(pg_url, schema=self.schema)
            self.opened["postgres-fast"] = UndoLog.open(pg_url, schema=self.schema, fast_commit_mark=True,
                                                        migrate=False)
            self.pg_saver = PgSaver(pg_url, self.schema)
        for u in self.opened.values():
            u.register(*TOOLS)

    def close(self) -> None:
        for u in self.opened.values():
            try:
                u.close()
            except Exception:  # noqa: BLE001 - a report; cleanup problems must not hide the numbers
                pass
        if self.pg_saver is not None:
            self.pg_saver.close()
        if self.admin is not None:
            with self.admin.connect() as c:
                c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
            self.admin.dispose()
        self.tmp.cleanup()
        if self.shm is not None:
            self.shm.cleanup()


# -- report ---------------------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    headers = ("section", "variant", "median ms/step", "p25-p75 ms", "ratio", "ratio p25-p75", "goal", "result",
               "cpu ratio", "cpu p25-p75")
    body = []
    for r in rows:
        body.append((
            r.section,
            r.variant,
            "" if r.share or r.median_ms != r.median_ms else f"{r.median_ms:,.2f}",
            "" if r.share or r.median_ms != r.median_ms else f"{r.p25_ms:,.2f}-{r.p75_ms:,.2f}",
            (f"{r.ratio:.0%}" if r.share else f"{r.ratio:.3f}x") if r.ratio is not None else "1.000x",
            ((f"{r.ratio_lo:.0%}-{r.ratio_hi:.0%}" if r.share else f"{r.ratio_lo:.3f}-{r.ratio_hi:.3f}")
             if r.ratio_lo is not None and r.ratio_hi is not None else ""),
            (f"<= {r.goal:.0%}" if r.share else f"<= {r.goal:.2f}x") if r.goal is not None else "",
            r.verdict,
            ((f"{r.cpu_ratio:.0%}" if r.share else f"{r.cpu_ratio:.3f}x") if r.cpu_ratio is not None else ""),
            ((f"{r.cpu_lo:.0%}-{r.cpu_hi:.0%}" if r.share else f"{r.cpu_lo:.3f}-{r.cpu_hi:.3f}")
             if r.cpu_lo is not None and r.cpu_hi is not None else ""),
        ))
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    right = {2, 3, 4, 5, 8, 9}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    prev = None
    for b in body:
        tier = b[1].split(":")[0]
        if prev is not None and (b[0], tier) != prev:
            print()
        print(line(b))
        prev = (b[0], tier)


def matching(variants: list[Variant], shares: list[Share], text: str) -> tuple[list[Variant], list[Share]]:
    """The variants whose name holds ``text``, with the baselines and lower bounds their rows divide by."""
    by_name = {v.name: v for v in variants}
    keep = {v.name for v in variants if text in v.name}
    for name in list(keep):
        v = by_name[name]
        keep |= {n for n in (v.baseline, v.over) if n is not None}
    kept = [s for s in shares if {s.none, s.alone, s.with_} <= keep]
    return [v for v in variants if v.name in keep], kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    p.add_argument("--pg-url", default=DEFAULT_PG_URL)
    p.add_argument("--rounds", type=int, help="rounds (each: --turns steps of every variant)")
    p.add_argument("--turns", type=int, help="steps per round and variant (default 20; CrewAI: a quarter)")
    p.add_argument("--only", default="langgraph,crewai,sk,group", help="sections to run, comma-separated")
    p.add_argument("--seed", type=int, default=20261130)
    p.add_argument("--match", help="only the variants whose name holds this text (with their baselines and lower "
                                   "bounds), e.g. --match tmpfs")
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 21)
    turns = args.turns or (4 if args.quick else 20)
    only = set(args.only.split(","))
    rng = random.Random(args.seed)
    kinds = ("sqlite", "postgres") if args.db == "both" else (args.db,)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    rows: list[Row] = []
    broken = False
    stores = Stores(kinds, args.pg_url)
    loop = asyncio.new_event_loop()
    try:
        sections: list[tuple[str, Callable[[], tuple[list[Variant], list[Share]]]]] = []
        if "langgraph" in only:
            sections.append(("langgraph", lambda: langgraph_variants(stores.opened, stores.pg_saver, loop)))
        if "crewai" in only:
            sections.append(("crewai", lambda: crewai_variants(stores.opened)))
        if "sk" in only:
            # Ten conversations a run (one is shorter than the machine's jitter: see sk_variants); one in --quick.
            sections.append(("sk", lambda: sk_variants(stores.opened, loop, conversations=1 if args.quick else 10)))
        for name, build in sections:
            try:
                variants, shares = build()
                if args.match:
                    variants, shares = matching(variants, shares, args.match)
                # A CrewAI kickoff is a whole crew run (tens of ms): fewer of them per block say as much; four
                # blocks a round, interleaved (Variant.reps): with one block of five kickoffs per variant, a
                # round's ratio spread wider (p25-p75 1.00-1.12) than the SAFE goal's 5% margin.
                n = max(2, turns // 4) if name == "crewai" and not args.turns else turns
                if name == "crewai" and not args.quick:
                    for v in variants:
                        v.reps = 4
                measure(variants, rounds=rounds, turns=n, rng=rng)
                rows += rows_for(name, variants, shares)
            except Exception as exc:  # noqa: BLE001 - report what could not be measured, keep the rest
                broken = True
                print(f"[{name}] the benchmark could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        loop.close()
        stores.close()
    group_rows: list[GroupRow] = []
    if "group" in only:
        stores = Stores(kinds, args.pg_url)
        try:
            group_rows = group_commit_rows(stores.opened, workers=(1, 4) if args.quick else (1, 4, 8),
                                           turns=turns, rounds=1 if args.quick else 3)
        except Exception as exc:  # noqa: BLE001 - report what could not be measured, keep the rest
            broken = True
            print(f"[group] the benchmark could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            stores.close()
    if rows:
        print_table(rows)
        misses = sum(r.verdict == "MISS" for r in rows)
        passes = sum(r.verdict == "PASS" for r in rows)
        print()
        print(f"{passes} PASS, {misses} MISS; {rounds} rounds x {turns} steps per variant, interleaved; "
              f"{time.perf_counter() - t0:.1f} s. Python {platform.python_version()}, {platform.machine()}, "
              f"{os.cpu_count()} CPU; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
              "(wall-clock ratios are only meaningful on a quiet machine; the CPU ratios leave out the fsyncs).")
    if group_rows:
        print_group(group_rows)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
