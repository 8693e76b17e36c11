"""Compensation templates and pinned variants as gateway.toml states them: what each placeholder renders, what is
refused at load (with the fix in the message), and a capture too large to store whole, through the real gateway
in front of the real SDK upstream of ``counter_server.py``-style tests (here ``tickets_server.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from undolog_core.errors import ConfigurationError
from undolog_mcp import load_config
from undolog_mcp.templates import CompensationTemplate

from .test_gateway import gateway, only_session, text, write_config


def _tool(**raw: Any) -> Any:
    return load_config({"upstreams": {"up": {"url": "http://127.0.0.1:9/mcp"}},
                        "tools": {"up": {"t": {"tier": "compensable", **raw}}}}).tools[("up", "t")]


def test_for_each_is_one_call_per_element_newest_first_each_with_its_own_key() -> None:
    t = CompensationTemplate("delete_entities", {"entityNames": ["{item.name}"], "why": "undo of {forward_key}",
                                                 "key": "{undo_key}"}, for_each="{result.entities}")
    calls = t.calls({}, {"entities": [{"name": "ada"}, {"name": "grace"}]}, undo_key="undo-7", forward_key="do-e1")
    assert calls == [
        ({"entityNames": ["grace"], "why": "undo of do-e1", "key": "undo-7.1"}, "undo-7.1"),
        ({"entityNames": ["ada"], "why": "undo of do-e1", "key": "undo-7.0"}, "undo-7.0"),
    ]
    # The same keys every time: a compensation interrupted after its first element sends it again with its key.
    assert t.calls({}, {"entities": [{"name": "ada"}, {"name": "grace"}]}, undo_key="undo-7",
                   forward_key="do-e1") == calls


def test_skip_if_empty_makes_a_call_that_changed_nothing_need_no_undo() -> None:
    """Before: a create that created nothing broke its template at rollback (retried, then the session halted)."""
    each = CompensationTemplate("delete", {"id": "{item.id}"}, for_each="{result.made}", skip_if_empty=True)
    assert each.calls({}, {"made": []}, undo_key="undo-1", forward_key="do-1") == []
    assert each.calls({}, {}, undo_key="undo-1", forward_key="do-1") == []
    one = CompensationTemplate("close", {"id": "{result.id}"}, skip_if_empty=True)
    assert one.calls({}, {"note": "nothing to do"}, undo_key="undo-1", forward_key="do-1") == []
    assert one.calls({}, {"id": 4}, undo_key="undo-1", forward_key="do-1") == [({"id": 4}, "undo-1")]
    strict = CompensationTemplate("close", {"id": "{result.id}"})
    with pytest.raises(ConfigurationError, match=r"\{result.id\} is not in the call's result"):
        strict.calls({}, {"note": "nothing"}, undo_key="undo-1", forward_key="do-1")
    with pytest.raises(ConfigurationError, match="not a list"):
        CompensationTemplate("d", {"id": "{item}"}, for_each="{result.made}").calls(
            {}, {"made": "x"}, undo_key="undo-1", forward_key="do-1")


def test_idempotency_key_keeps_its_meaning_for_one_release_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="undolog.mcp"):
        cfg = _tool(compensation={"tool": "close", "args": {"id": "{args.id}", "key": "{idempotency_key}"}})
    assert "write {undo_key}" in caplog.text
    assert cfg.compensation.calls({"id": 1}, None, undo_key="undo-3", forward_key="do-x") == [
        ({"id": 1, "key": "undo-3"}, "undo-3")]


@pytest.mark.parametrize(("raw", "says"), [
    ({"compensation": {"tool": "w", "args": {"c": "{before.content}"}}}, "needs a capture"),
    ({"compensation": {"tool": "d", "args": {"n": "{item.name}"}}}, "needs for_each"),
    ({"compensation": {"tool": "d", "args": {}, "for_each": "{args.x}"}}, "naming a list in the result"),
    ({"compensation": {"tool": "d", "args": {}, "skip_if_empty": "yes"}}, "true or false"),
    ({"compensation": {"tool": "d", "args": {}, "forEach": "{result.x}"}}, "unknown key"),
    ({"compensation": {"tool": "w", "args": {}}, "capture": {"tool": "r", "args": {"p": "{result.x}"}}},
     "only {args.NAME}"),
    ({"of": "edit_file"}, "needs pin"),
    ({"pin": {"dryRun": True}, "of": "t"}, "names itself"),
])
def test_a_template_or_variant_that_cannot_work_is_refused_at_load(raw: dict[str, Any], says: str) -> None:
    base = {"compensation": {"tool": "x", "args": {}}}
    with pytest.raises(ConfigurationError, match=says):
        _tool(**{**base, **raw})


def test_the_plain_tool_pins_the_other_value_of_a_variants_boolean() -> None:
    tools = load_config({"upstreams": {"fs": {"url": "http://127.0.0.1:9/mcp"}}, "tools": {"fs": {
        "edit_file_preview": {"of": "edit_file", "pin": {"dryRun": True}, "tier": "safe"},
        "edit_file": {"tier": "irreversible"},
    }}}).tools
    assert tools[("fs", "edit_file")].pin == {"dryRun": False}
    assert tools[("fs", "edit_file_preview")].upstream_tool == "edit_file"
    with pytest.raises(ConfigurationError, match="not a boolean"):
        load_config({"upstreams": {"fs": {"url": "http://127.0.0.1:9/mcp"}}, "tools": {"fs": {
            "send_draft": {"of": "send", "pin": {"mode": "draft"}, "tier": "safe"},
            "send": {"tier": "irreversible"},
        }}})


@pytest.mark.storage
async def test_a_capture_too_large_to_store_whole_refuses_the_call(db: Any, tmp_path: Path) -> None:
    """Kept whole or not at all: a cut copy would restore the wrong thing. The call did not run; nothing to undo."""
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.create_ticket.capture]
        tool = "search_tickets"
        args = { q = "x" }
    """)
    async with gateway(db, cfg) as client:
        # Each title stays under the gateway's 256 KiB argument limit; the capture of the sixth sees 1.0 MB.
        for i in range(6):
            assert not (await client.call_tool("create_ticket", {"title": "x" * 200_000 + str(i)})).isError
        big = await client.call_tool("create_ticket", {"title": "z"})
        # search_tickets now answers six titles of 200 kB each: more than 1 MiB.
        assert big.isError and "could not be captured" in text(big) and "1048576" in text(big), text(big)[:300]
    u = db.open()
    effects = u.sessions.effects(only_session(u).session_id)
    assert [e["state"] for e in effects] == ["committed"] * 6 + ["failed"]
    assert effects[-1]["undo_id"] is None
