"""A real upstream MCP server (the SDK's low-level ``Server`` with FastMCP's tools: ``lowlevel_tools.py``) with one
slow IRREVERSIBLE payment, for the gateway's honest answers: each payment made is appended to the JSON file
``PAYMENTS_STATE``."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from lowlevel_tools import ToolServer

STATE = Path(os.environ["PAYMENTS_STATE"])
mcp = ToolServer("payments")


@mcp.tool()
async def pay(to: str, amount: float) -> str:
    """Pay someone (slowly: a bank's API)."""
    await asyncio.sleep(float(os.environ.get("PAYMENTS_DELAY", "3")))
    made = json.loads(STATE.read_text()) if STATE.exists() else []
    made.append({"to": to, "amount": amount})
    STATE.write_text(json.dumps(made))
    return f"paid {amount} to {to}"


if __name__ == "__main__":
    mcp.run()
