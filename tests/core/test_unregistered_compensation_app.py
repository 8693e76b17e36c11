"""A compensation named but registered nowhere: found when ``--app`` loads the app, and warned of by a bare
``register_tool``.

Before: found only at the first rollback, which stopped at that call with its effect still in the world.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from undolog_core import errors, load_app

pytestmark = pytest.mark.storage


def _app_module(tmp_path, db, name: str, *, register_comp: bool) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool

        @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_order"))
        def place_order(item: str) -> str:
            return "placed"

        @compensation("cancel_order")
        def cancel_order(ctx):
            pass

        def app():
            u = UndoLog.open({db.url!r}, schema={db.schema!r})
            u.register(place_order{", cancel_order" if register_comp else ""})
            return u
    """))
    return f"{name}:app"


def test_load_app_refuses_an_app_with_a_compensation_it_never_registered(tmp_path, db, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = _app_module(tmp_path, db, "shop_without_undo", register_comp=False)
    with pytest.raises(errors.ConfigurationError) as raised:
        load_app(spec)
    first = str(raised.value).splitlines()[0]
    assert "place_order -> 'cancel_order'" in first and "registered nowhere" in first
    good = load_app(_app_module(tmp_path, db, "shop_with_undo", register_comp=True))
    good.close()
    for mod in ("shop_without_undo", "shop_with_undo"):
        sys.modules.pop(mod, None)


def test_a_bare_register_tool_warns_of_a_compensation_not_registered(undolog) -> None:
    with pytest.warns(UserWarning, match="names the compensation 'undo_vendor_call', which is not registered"):
        undolog.register_tool(lambda order_id: "ok", name="vendor_call", tier="compensable",
                              compensation="undo_vendor_call")
