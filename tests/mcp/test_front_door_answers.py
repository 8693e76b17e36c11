"""Issue #29, part 5: honest answers from the gateway, with the SDK's own client over stdio, the real
``undolog mcp serve`` and a real upstream (``payments_server.py``), on both databases.

Before the fix, 9 of 10 concurrent asks of an approved payment were told ``isError`` (``invalid_effect_state``)
while it was being paid once; and ``{"amount": 5.0}`` after ``{"amount": 5}`` raised a second request that looked
identical at the desk (the gateway keyed calls by raw arguments, the core stores them validated).
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ..support.mcp_upstreams import copy_upstream
from .test_gateway import gateway, text

pytestmark = pytest.mark.reads_store
HERE = Path(__file__).parent


def _config(tmp: Path) -> Path:
    copy_upstream(HERE / "payments_server.py", tmp)
    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.bank]
        command = [{json.dumps(sys.executable)}, "payments_server.py"]
        env = {{ PAYMENTS_STATE = {json.dumps(str(tmp / "payments.json"))}, PAYMENTS_DELAY = "3" }}
        timeout = 60

        [tools.bank.pay]
        tier = "irreversible"
        reason = "Moves money"
    """))
    return cfg


async def test_five_and_five_point_zero_are_one_request_and_re_asks_while_running_are_pending(
        db: Any, tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    u = db.open()
    async with gateway(db, cfg) as client:
        first = await client.call_tool("pay", {"to": "acme", "amount": 5})
        second = await client.call_tool("pay", {"to": "acme", "amount": 5.0})
        assert not first.isError and not second.isError
        ids = {first.structuredContent["approval_request_id"], second.structuredContent["approval_request_id"]}
        assert len(ids) == 1, (text(first), text(second))
        pending = u.approvals.pending()
        assert len(pending) == 1 and pending[0].proposed_args == {"to": "acme", "amount": 5.0}
        u.approvals.approve(pending[0].approval_request_id, approver="ana")

        answers = await asyncio.gather(*(client.call_tool("pay", {"to": "acme", "amount": 5 if i % 2 else 5.0})
                                         for i in range(10)))
        assert not any(a.isError for a in answers), [text(a) for a in answers]
        ran = [a for a in answers if "paid" in text(a)]
        running = [a for a in answers if (a.structuredContent or {}).get("status") == "running"]
        assert len(ran) == 1 and len(running) == 9, [text(a) for a in answers]
        assert all("running; ask again" in text(a) for a in running)
        again = await client.call_tool("pay", {"to": "acme", "amount": 5})
        assert not again.isError and "paid" in text(again), text(again)
    assert json.loads((tmp_path / "payments.json").read_text()) == [{"to": "acme", "amount": 5.0}]
