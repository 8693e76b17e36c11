"""``undolog demo``: the support agent's three tiers, approval and a LIFO rollback, as a Rich timeline.

Runs offline with a scripted model (no API key, no network). ``--model provider:name`` runs the same
agent on a real model when the provider's LangChain package and key are present.
"""

from __future__ import annotations

import sqlite3
import tempfile
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from undolog_core import ToolTier, UndoLog

from .model import ScriptedChatModel
from .tools import SupportTools, make_tools
from .world import SupportWorld

SCENE_1 = (
    "Hi, this is Dana (customer u-1042). Order A-1042 arrived broken: please refund the $42.50 and then "
    "delete my account."
)
SCENE_2 = "Sam (customer u-2002) here: please refund my orders B-7 ($19), B-8 ($25) and B-9 ($900)."
LATER = "Hello? Is my account gone now?"

SCRIPTS: dict[str, list[list[tuple[str, dict[str, Any]]]]] = {
    "u-1042": [
        [("search_knowledge_base", {"query": "refund damaged item and account deletion"})],
        [("send_refund_email", {"user_id": "u-1042", "amount": 42.5, "order_id": "A-1042"})],
        [("delete_user_account", {"user_id": "u-1042"})],
    ],
    "u-2002": [
        [("send_refund_email", {"user_id": "u-2002", "amount": 19.0, "order_id": "B-7"})],
        [("send_refund_email", {"user_id": "u-2002", "amount": 25.0, "order_id": "B-8"})],
        [("send_refund_email", {"user_id": "u-2002", "amount": 900.0, "order_id": "B-9"})],
    ],
}

TIER_STYLE = {ToolTier.SAFE: "green", ToolTier.COMPENSABLE: "yellow", ToolTier.IRREVERSIBLE: "red"}
APPROVER = "ana"
REJECT_REASON = "The customer has an open chargeback; their records must be kept"


@dataclass
class DemoResult:
    """What the demo did, for tests and for callers that want more than the printout."""

    workdir: Path
    world: SupportWorld
    undolog: UndoLog
    threads: dict[str, str] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    rollback_steps: list[dict[str, Any]] = field(default_factory=list)


def build_agent(undolog: UndoLog, tools: SupportTools, model: Any, checkpointer: Any) -> Any:
    """The support agent: ``create_agent`` with UndoLog's middleware.

    Example:
        >>> agent = build_agent(undolog, make_tools(world), ScriptedChatModel(scripts=SCRIPTS),
        ...                     InMemorySaver())  # doctest: +SKIP
    """
    from langchain.agents import create_agent

    from undolog_adapters.langgraph import UndoLogMiddleware

    return create_agent(
        model,
        tools.agent_tools,
        system_prompt=(
            "You are a customer-support agent. Use the knowledge base, confirm refunds by email and delete "
            "accounts only when the customer asks. If a tool reports an error, tell the customer exactly what "
            "happened."
        ),
        middleware=[UndoLogMiddleware(undolog, tools=tools.agent_tools, compensations=[tools.cancel_refund_email],
                                      agent_id="support-agent")],
        checkpointer=checkpointer,
    )


def run_demo(
    *,
    console: Console | None = None,
    reject: bool = False,
    interactive: bool = False,
    model: str | None = None,
    db_path: str | None = None,
    delivery_delay: float = 5.0,
    ask: Callable[[str, list[str]], str] | None = None,
) -> DemoResult:
    """Run the two support tickets and print the timeline.

    Args:
        console: where to print (a new ``rich.console.Console`` if None).
        reject: the supervisor rejects the account deletion instead of approving it.
        interactive: ask at the prompt whether to approve.
        model: ``provider:name`` for a real model (``langchain.chat_models.init_chat_model``).
        db_path: the UndoLog SQLite file (its folder also holds the checkpoints and the fake world);
            a new temporary folder when None.
        delivery_delay: seconds an email stays recallable in the outbox.
        ask: the prompt used by ``interactive`` (``rich.prompt.Prompt.ask`` by default).

    Example:
        >>> result = run_demo(reject=True)          # doctest: +SKIP
        >>> result.world.account_status("u-1042")   # doctest: +SKIP
        'active'
    """
    from langgraph.checkpoint.sqlite import SqliteSaver

    console = console or Console()
    if db_path:
        db_file = Path(db_path).expanduser().resolve()
        db_file.parent.mkdir(parents=True, exist_ok=True)
        workdir = db_file.parent
    else:
        workdir = Path(tempfile.mkdtemp(prefix="undolog-demo-"))
        db_file = workdir / "undolog.db"
    undolog = UndoLog.open(f"sqlite:///{db_file}")
    world = SupportWorld(workdir / f"{db_file.stem}.world.sqlite", delivery_delay=delivery_delay)
    tools = make_tools(world)
    chat = _chat_model(model)
    conn = sqlite3.connect(str(workdir / f"{db_file.stem}.checkpoints.sqlite"), check_same_thread=False)
    agent = build_agent(undolog, tools, chat, SqliteSaver(conn))
    result = DemoResult(workdir, world, undolog)
    run_id = uuid.uuid4().hex[:6]  # several runs on the same --db never share a thread
    timeline = _Timeline(console, undolog)

    console.rule("[bold]UndoLog demo: a customer-support agent")
    console.print(
        f"Model: [bold]{model or 'scripted (offline, no API key)'}[/]   UndoLog store: {db_file}\n"
        "Tools: [green]search_knowledge_base[/] SAFE · [yellow]send_refund_email[/] COMPENSABLE "
        "(undo: cancel_refund_email) · [red]delete_user_account[/] IRREVERSIBLE\n"
        f"The outbox delivers an email {delivery_delay:g}s after it is queued; until then it can be recalled."
    )

    # Ticket 1: the three tiers and a person in the loop.
    thread1 = f"ticket-1042-{run_id}"
    result.threads["ticket-1042"] = thread1
    cfg1 = {"configurable": {"thread_id": thread1}}
    console.rule("Ticket 1042")
    timeline.user(SCENE_1)
    _run(agent, {"messages": [{"role": "user", "content": SCENE_1}]}, cfg1, timeline)
    decide = _decider(reject, interactive, ask, console)
    while True:
        pending = _undolog_interrupts(agent.get_state(cfg1).interrupts)
        if not pending:
            break
        resume: dict[str, Any] = {}
        for intr in pending:
            request = intr.value["undolog"]  # UndoLog's fields, beside LangChain's ToolApprovalRequest ones
            timeline.approval_request(request)
            decision = decide(request)
            result.decisions.append({"tool": request["tool"], **decision})
            timeline.decision(decision)
            resume[intr.id] = decision
        from langgraph.types import Command

        value = next(iter(resume.values())) if len(resume) == 1 else resume
        console.print(f"[dim]graph.invoke(Command(resume={value!r}), config)  # resumes the paused run[/]")
        _run(agent, Command(resume=value), cfg1, timeline)
    if any(d["decision"] == "reject" for d in result.decisions):
        timeline.note(f"Session {thread1} is halted until a person resumes or rolls it back. A later turn:")
        timeline.user(LATER)
        _run(agent, {"messages": [{"role": "user", "content": LATER}]}, cfg1, timeline)

    # Ticket 2: a failing step rolls the session back, newest first.
    thread2 = f"ticket-2002-{run_id}"
    result.threads["ticket-2002"] = thread2
    cfg2 = {"configurable": {"thread_id": thread2}}
    console.rule("Ticket 2002")
    timeline.user(SCENE_2)
    _run(agent, {"messages": [{"role": "user", "content": SCENE_2}]}, cfg2, timeline)
    result.rollback_steps = list(timeline.rollback_steps)

    console.rule("The outside world afterwards")
    _world_tables(console, world, undolog, result.threads.values())
    conn.close()
    return result


def main(reject: bool = False, interactive: bool = False, model: str | None = None, db_path: str | None = None) -> int:
    """Entry point of ``undolog demo`` (and ``python -m examples.support_agent``); returns the exit code."""
    console = Console()
    try:
        result = run_demo(console=console, reject=reject, interactive=interactive, model=model, db_path=db_path)
    except _ModelUnavailable as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    result.undolog.close()
    return 0


# ---------------------------------------------------------------------------------------------------


class _ModelUnavailable(RuntimeError):
    pass


def _chat_model(spec: str | None) -> Any:
    if not spec:
        return ScriptedChatModel(scripts=SCRIPTS)
    if ":" not in spec:
        raise _ModelUnavailable(f"--model takes provider:name (e.g. openai:gpt-4o-mini), got {spec!r}")
    try:
        from langchain.chat_models import init_chat_model

        return init_chat_model(spec)
    except Exception as exc:  # noqa: BLE001 - missing package or key: say which, exit non-zero
        raise _ModelUnavailable(
            f"cannot start model {spec!r}: {exc}. Install the provider's LangChain package "
            f"(e.g. pip install langchain-{spec.split(':', 1)[0]}) and set its API key."
        ) from exc


def _run(agent: Any, payload: Any, config: dict[str, Any], timeline: _Timeline) -> None:
    for chunk in agent.stream(payload, config, stream_mode="updates"):
        for node, update in chunk.items():
            if node == "__interrupt__" or not isinstance(update, dict):
                continue
            for m in update.get("messages") or []:
                timeline.message(m, config["configurable"]["thread_id"])


def _undolog_interrupts(interrupts: Iterable[Any]) -> list[Any]:
    from undolog_adapters.langgraph import APPROVAL_INTERRUPT_TYPE

    return [i for i in interrupts
            if isinstance(i.value, dict) and (i.value.get("undolog") or {}).get("type") == APPROVAL_INTERRUPT_TYPE]


def _decider(reject: bool, interactive: bool, ask: Callable[[str, list[str]], str] | None,
             console: Console) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def decide(request: dict[str, Any]) -> dict[str, Any]:
        choice = "reject" if reject else "approve"
        if interactive:
            if ask is None:
                from rich.prompt import Prompt

                answer = Prompt.ask(
                    f"[bold]{APPROVER}[/], approve {request['tool']}({_args(request['args'])})?",
                    choices=["approve", "reject"], default="approve", console=console,
                )
            else:
                answer = ask(f"approve {request['tool']}?", ["approve", "reject"])
            choice = answer
        if choice == "reject":
            return {"decision": "reject", "approver": APPROVER, "reason": REJECT_REASON}
        return {"decision": "approve", "approver": APPROVER, "reason": "Customer identity verified"}

    return decide


class _Timeline:
    def __init__(self, console: Console, undolog: UndoLog) -> None:
        self.c = console
        self.u = undolog
        self.rollback_steps: list[dict[str, Any]] = []

    def user(self, text: str) -> None:
        self.c.print(Text.assemble(("  user   ", "bold cyan"), text))

    def note(self, text: str) -> None:
        self.c.print(Text.assemble(("  note   ", "dim"), (text, "dim")))

    def message(self, m: Any, thread_id: str) -> None:
        from langchain_core.messages import AIMessage, ToolMessage

        if isinstance(m, AIMessage):
            meta = (m.response_metadata or {}).get("undolog") or {}
            if meta.get("refused"):
                self.c.print(Text.assemble(("  ⛔ undolog ", "bold red"), str(m.content)))
            elif m.tool_calls:
                for tc in m.tool_calls:
                    self.c.print(Text.assemble(("  agent  ", "bold"), "calls ",
                                               (f"{tc['name']}({_args(tc['args'])})", "bold")))
            elif m.content:
                self.c.print(Text.assemble(("  agent  ", "bold"), str(m.content)))
        elif isinstance(m, ToolMessage):
            self._tool(m)

    def _tool(self, m: Any) -> None:
        meta = (m.response_metadata or {}).get("undolog") or {}
        tier = self.u.tool_spec(m.name).tier
        tag = (f"{tier.value.upper():<12}", TIER_STYLE[tier])
        if meta.get("failed"):
            self.c.print(Text.assemble("  ", tag, ("✗ ", "bold red"), f"{m.name} failed"))
            steps = meta.get("rollback") or []
            if steps:
                self.c.print(Text.assemble(("  ↶ rollback, newest first (LIFO):", "bold magenta")))
            for s in steps:
                effect = self._effect(s["effect_id"])
                what = _args(effect.get("args_snapshot") or {}) if effect else ""
                ok = s["outcome"] in ("compensated", "already_compensated")
                if ok and s["effect_id"] == meta.get("effect_id"):
                    self.c.print(Text.assemble(
                        "      ", ("✓ ", "green"),
                        f"{s['compensation_name']} checked the failed call itself ({what}): nothing had been sent",
                    ))
                    self.rollback_steps.append(s)
                    continue
                self.c.print(Text.assemble(
                    "      ", ("✓ " if ok else "✗ ", "green" if ok else "red"),
                    f"{s['compensation_name']} undid {s['tool_name']}({what}) · undo entry #{s['undo_id']} · "
                    f"{s['outcome']}" + (f": {s['error']}" if s.get("error") else ""),
                ))
                self.rollback_steps.append(s)
            self.c.print(Text.assemble("      ", ("model is told: ", "dim"), (_short(str(m.content), 220), "dim")))
            return
        if meta.get("refused"):
            self.c.print(Text.assemble("  ", tag, ("⛔ ", "bold red"), _short(str(m.content), 240)))
            return
        if tier is ToolTier.SAFE:
            self.c.print(Text.assemble("  ", tag, ("✓ ", "green"), f"{m.name} ran freely (read-only, not logged) → ",
                                       _short(_result_text(m), 90)))
        elif tier is ToolTier.COMPENSABLE:
            effect = self._effect(meta.get("effect_id"))
            undo = f"undo entry #{effect.get('undo_id')} ({effect.get('compensation_name')})" if effect else "undo entry"
            self.c.print(Text.assemble("  ", tag, ("✓ ", "green"), f"{m.name} → {_short(_result_text(m), 80)}"))
            self.c.print(Text.assemble("      ", (f"logged effect {str(meta.get('effect_id'))[:8]} with {undo}",
                                                  "yellow")))
        else:
            self.c.print(Text.assemble("  ", tag, ("✓ ", "green"), f"{m.name} ran once, after approval → ",
                                       _short(_result_text(m), 80)))

    def _effect(self, effect_id: str | None) -> dict[str, Any]:
        if not effect_id:
            return {}
        for sess in self.u.sessions.list(limit=50):
            for e in self.u.sessions.effects(sess.session_id):
                if e["effect_id"] == effect_id:
                    return e
        return {}

    def approval_request(self, value: dict[str, Any]) -> None:
        body = Table.grid(padding=(0, 2))
        body.add_row("request", value["approval_request_id"])
        body.add_row("tool", f"{value['tool']}({_args(value['args'])})")
        body.add_row("reason", str(value.get("reason")))
        body.add_row("risk tags", ", ".join(value.get("risk_tags") or []))
        body.add_row("timeout", str(value.get("timeout_at")))
        body.add_row("session", str(value.get("session_id")))
        self.c.print(Text.assemble("  ", (f"{'IRREVERSIBLE':<12}", "red"), ("⏸ ", "bold red"),
                                   f"{value['tool']} stopped before running: the graph is paused for approval"))
        self.c.print(Panel(body, title="approval request (interrupt payload)", border_style="red", expand=False))

    def decision(self, d: dict[str, Any]) -> None:
        verb = {"approve": "approved", "reject": "rejected", "modify": "approved with edits"}[d["decision"]]
        style = "green" if d["decision"] != "reject" else "red"
        self.c.print(Text.assemble(("  person ", "bold"), (f"{d['approver']} {verb}", f"bold {style}"),
                                   f": {d.get('reason') or ''}"))


def _world_tables(console: Console, world: SupportWorld, undolog: UndoLog, threads: Iterable[str]) -> None:
    t = Table(title="email outbox")
    for col in ("message", "to", "order", "amount", "status"):
        t.add_column(col)
    for e in world.emails():
        style = {"recalled": "magenta", "queued": "yellow", "delivered": "green"}.get(e.status, "")
        t.add_row(e.message_id, e.to_addr, e.order_id, f"${e.amount:.2f}", Text(e.status, style=style))
    console.print(t)
    a = Table(title="accounts")
    a.add_column("user")
    a.add_column("status")
    for uid in ("u-1042", "u-2002"):
        a.add_row(uid, world.account_status(uid) or "?")
    console.print(a)
    s = Table(title="UndoLog sessions")
    s.add_column("session")
    s.add_column("state")
    s.add_column("why")
    for tid in threads:
        rec = undolog.sessions.get(tid)
        s.add_row(tid, rec.state, rec.halted_reason or "")
    console.print(s)


def _args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _result_text(m: Any) -> str:
    return m.content if isinstance(m.content, str) else str(m.content)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
