"""A real upstream MCP server for the gateway's tests, on the official SDK (its low-level ``Server``, 1.x line), with
the tools, schemas and answers FastMCP gave it (``lowlevel_tools.py``, copied beside it).

Its world is a JSON file (``TICKETS_STATE``): tickets, seats, and a log of every call with the idempotency key
that came in its ``_meta``. ``TICKETS_VARIANT=v2`` changes create_ticket's schema (a contract change).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from lowlevel_tools import ToolServer  # before the SDK: it imports the SDK the way a gateway does
from mcp.types import CallToolResult, TextContent, ToolAnnotations

STATE = Path(os.environ["TICKETS_STATE"])
V2 = os.environ.get("TICKETS_VARIANT") == "v2"
KEY = "dev.undolog/idempotency-key"
EPOCH = "dev.undolog/epoch"  # the fencing token beside the key (issue 34)

mcp = ToolServer("tickets")


def load() -> dict[str, Any]:
    if STATE.exists():
        return dict(json.loads(STATE.read_text()))
    return {"tickets": {}, "seats": [], "calls": [], "next": 1}


def save(state: dict[str, Any]) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(STATE)


def record(state: dict[str, Any], tool: str, args: dict[str, Any]) -> None:
    extra = mcp.meta()
    # The pid tells which upstream process did the work (a long-lived gateway starts its upstream once).
    state["calls"].append({"tool": tool, "args": args, "key": extra.get(KEY), "epoch": extra.get(EPOCH),
                           "pid": os.getpid()})


class Ticket(TypedDict):
    id: int
    title: str
    status: str


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def search_tickets(q: str) -> list[str]:
    """Search tickets by title."""
    state = load()
    record(state, "search_tickets", {"q": q})
    save(state)
    return [t["title"] for t in state["tickets"].values() if q in t["title"]]


if V2:
    @mcp.tool()
    def create_ticket(title: str, priority: int) -> Ticket:
        """Open a ticket (v2: with a priority)."""
        return _create(title)
else:
    @mcp.tool()
    def create_ticket(title: str) -> Ticket:
        """Open a ticket."""
        return _create(title)


def _create(title: str) -> Ticket:
    state = load()
    record(state, "create_ticket", {"title": title})
    if title == "crash":
        save(state)
        os._exit(3)  # dies mid-call, after doing its work: the gateway never gets an answer
    if title in ("slow", "slowish"):
        save(state)
        time.sleep(5 if title == "slow" else 1.5)
        state = load()
    n = state["next"]
    state["next"] = n + 1
    state["tickets"][str(n)] = {"id": n, "title": title, "status": "open"}
    save(state)
    return Ticket(id=n, title=title, status="open")


@mcp.tool()
def import_ticket(title: str) -> Annotated[CallToolResult, Ticket]:
    """Open a ticket, answering its id as a string: FastMCP's own (lax) check lets that through, the output schema
    it advertises (an integer id) does not. A sloppy upstream, for the client's check of results."""
    ticket = _create(title)
    data = {"id": str(ticket["id"]), "title": ticket["title"], "status": ticket["status"]}
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))], structuredContent=data)


@mcp.tool()
def close_ticket(id: int) -> str:
    """Close a ticket (idempotent; a ticket that never existed is fine)."""
    state = load()
    record(state, "close_ticket", {"id": id})
    t = state["tickets"].get(str(id))
    if t is not None:
        t["status"] = "closed"
    save(state)
    return "closed"


@mcp.tool()
def reserve_seat(seat: str) -> str:
    """Reserve a seat; an unknown seat name is refused with a tool error."""
    state = load()
    record(state, "reserve_seat", {"seat": seat})
    if seat.startswith("bad"):
        save(state)
        raise ValueError(f"no such seat: {seat}")
    if seat == "crash":
        state["seats"].append(seat)
        save(state)
        os._exit(3)
    state["seats"].append(seat)
    save(state)
    return f"reserved {seat}"


@mcp.tool()
def release_seat(seat: str) -> str:
    """Release a seat (a seat that was never reserved is fine)."""
    state = load()
    record(state, "release_seat", {"seat": seat})
    state["seats"] = [s for s in state["seats"] if s != seat]
    save(state)
    return f"released {seat}"


@mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
def delete_project(name: str) -> str:
    """Delete a project and every ticket in it."""
    state = load()
    record(state, "delete_project", {"name": name})
    state["tickets"] = {}
    save(state)
    return f"deleted {name}"


@mcp.tool()
def export_everything() -> str:
    """A tool the gateway's config does not classify: it must never be reachable."""
    state = load()
    record(state, "export_everything", {})
    save(state)
    return "exported"


@mcp.tool()
async def upgrade_tools() -> str:
    """Change close_ticket while running (it takes a reason from now on) and tell the client the list changed, as
    a server that loads plugins or upgrades itself in place does."""
    mcp.remove_tool("close_ticket")

    def close_ticket(id: int, reason: str = "") -> str:
        """Close a ticket, with a reason."""
        state = load()
        record(state, "close_ticket", {"id": id, "reason": reason})
        save(state)
        return "closed"

    mcp.add_tool(close_ticket)
    await mcp.session.send_tool_list_changed()
    return "upgraded"


if __name__ == "__main__":
    mcp.run()
