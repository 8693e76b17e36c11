"""A compensation named by a tool but registered nowhere is found when the adapter is built, naming both.

Before: it was found only at the first rollback, which stopped at that call with its effect still in the world.
Real CrewAI, Semantic Kernel and LangGraph adapters over the examples' support tools, built without the
compensation, then with it.
"""

from __future__ import annotations

import pytest
from crewai.hooks import clear_all_global_hooks
from semantic_kernel import Kernel

from examples.crewai_support_crew import support as crew_support
from examples.semantic_kernel_support import support as sk_support
from undolog_adapters.crewai import wrap_tools
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
from undolog_adapters.semantic_kernel import install
from undolog_core import CompensationDescriptor, ToolTier, errors, undolog_tool

NAMED = "send_refund_email -> 'cancel_refund_email'"


@pytest.fixture(autouse=True)
def _hooks():
    clear_all_global_hooks()
    yield
    clear_all_global_hooks()


def test_crewai_wrap_tools(undolog) -> None:
    with pytest.raises(errors.ConfigurationError, match="registered nowhere") as raised:
        wrap_tools(crew_support.TOOLS, undolog=undolog)
    assert NAMED in str(raised.value) and "compensations=[...]" in str(raised.value).splitlines()[0]
    wrap_tools(crew_support.TOOLS, undolog=undolog, compensations=crew_support.COMPENSATIONS)


def test_semantic_kernel_install(undolog) -> None:
    kernel = Kernel()
    kernel.add_plugin(sk_support.SupportPlugin(), plugin_name="support")
    with pytest.raises(errors.ConfigurationError, match="support-send_refund_email -> 'cancel_refund_email'"):
        install(kernel, undolog)
    install(kernel, undolog, compensations=sk_support.COMPENSATIONS)


@pytest.mark.parametrize("adapter", ["middleware", "node"])
def test_langgraph_adapters(undolog, adapter) -> None:
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
    def send_refund_email(user_id: str, amount: float) -> str:
        """Send a refund email."""
        return "sent"

    build = ((lambda **kw: UndoLogMiddleware(undolog, tools=[send_refund_email], **kw)) if adapter == "middleware"
             else (lambda **kw: UndoLogToolNode([send_refund_email], undolog=undolog, **kw)))
    with pytest.raises(errors.ConfigurationError, match="registered nowhere") as raised:
        build()
    assert NAMED in str(raised.value)
    build(compensations=crew_support.COMPENSATIONS)
