"""Bounds declared in a tool's signature with ``Annotated[..., Field(...)]`` are enforced on every path.

Failed before: the signature's hints were read without their extras, so ``Annotated[int, Field(ge=1, le=10)]``
became ``int``: the recorded schema lost ``minimum``/``maximum``/``pattern`` and a call outside them ran.
"""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import Field

from undolog_core import ArgumentsInvalid, ToolTier


def _register(undolog, ran: list[object]) -> None:
    def pick(n: Annotated[int, Field(ge=1, le=10)], code: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = "ABC"):
        ran.append(("pick", n, code))
        return n

    def refund(amount: Annotated[int, Field(gt=0, le=500)]):
        ran.append(("refund", amount))
        return {"refunded": amount}

    def undo_refund(ctx):
        ran.append(("undo", ctx.args["amount"]))

    undolog.register_tool(pick, name="pick", tier=ToolTier.SAFE)
    undolog.register_compensation(undo_refund, name="undo_refund")
    undolog.register_tool(refund, name="refund", tier=ToolTier.COMPENSABLE, compensation="undo_refund")


@pytest.mark.parametrize("bad", [{"n": 0}, {"n": 11}, {"n": 5, "code": "abc"}])
async def test_a_safe_call_outside_its_declared_bounds_is_refused_and_does_not_run(undolog, bad):
    ran: list[object] = []
    _register(undolog, ran)
    async with undolog.session() as s:
        with pytest.raises(ArgumentsInvalid):
            await s.call("pick", **bad)
        assert await s.call("pick", n=3, code="XYZ") == 3
    assert ran == [("pick", 3, "XYZ")]


@pytest.mark.parametrize("amount", [0, -5, 501])
async def test_a_compensable_call_outside_its_declared_bounds_is_refused_before_anything_is_written(undolog, amount):
    ran: list[object] = []
    _register(undolog, ran)
    async with undolog.session() as s:
        with pytest.raises(ArgumentsInvalid):
            await s.call("refund", amount=amount)
        assert await s.call("refund", amount=20) == {"refunded": 20}
    assert ran == [("refund", 20)]


def test_the_declared_bounds_are_in_the_tools_schema(undolog):
    _register(undolog, [])
    props = undolog.registry.spec_for("pick").json_schema["properties"]
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 10)
    assert props["code"]["pattern"] == "^[A-Z]{3}$"
