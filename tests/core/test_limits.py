"""Hostile JSON, full JSON Schema and the one identity length rule, through the Python API (issue 11, findings 2, 3
and 7). Each test failed on the code before: a lone surrogate raised UnicodeEncodeError, ~900 levels raised
"Circular reference", a hostile result left the effect pending, `enum`/`maximum`/... were ignored, and a 200-character
session id or a long approver was a database error on PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import pytest

from undolog_core import ApprovalPending, ToolTier, UndoLog, compensation, limits, undolog_tool
from undolog_core._recovery import Recovery
from undolog_core.errors import ArgumentsInvalid, InvalidDeclaration, InvalidId, UndoLogError

RETURNS: dict[str, Any] = {}
UNDONE: list[Any] = []


@compensation("undo_store")
def undo_store(ctx: Any) -> None:
    UNDONE.append(ctx.result)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_store")
def store(x: Any) -> Any:
    return RETURNS["value"]


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="for good")
def publish(x: Any) -> Any:
    return RETURNS["value"]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_store")
def explode(x: Any) -> Any:
    raise RuntimeError(RETURNS["value"])


PAY_SCHEMA = {
    "type": "object",
    "required": ["to", "amount"],
    "additionalProperties": False,
    "properties": {
        "to": {"type": "string", "enum": ["acme", "globex"]},
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "memo": {"type": "string", "maxLength": 10},
        "lines": {"type": "array", "items": {"type": "object", "required": ["sku"],
                                             "properties": {"sku": {"type": "string", "pattern": "^S[0-9]+$"}}}},
    },
}
PAID: list[dict[str, Any]] = []


def nested(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = {"a": value}
    return value


@pytest.fixture
def u(db: Any) -> UndoLog:
    u = db.open()
    u.register(store, publish, explode, undo_store)
    u.register_tool(lambda **kw: PAID.append(kw) or kw, name="pay", tier="irreversible", args_schema=PAY_SCHEMA)
    PAID.clear()
    return u


def effects(u: UndoLog, sid: str) -> list[dict[str, Any]]:
    return u.sessions.effects(sid)


def nothing_logged(u: UndoLog) -> bool:
    return all(not effects(u, r.session_id) for r in u.sessions.list()) and u.approvals.list() == []


# -- hostile arguments: refused before anything is stored ---------------------------------------------------------


@pytest.mark.parametrize("tool", [store, publish])
def test_lone_surrogate_in_arguments_is_arguments_invalid_naming_the_path(u: UndoLog, tool: Any) -> None:
    s = u.session(agent_id="bot")
    with pytest.raises(ArgumentsInvalid) as exc:
        s.call_sync(tool, x={"note": ["ok", "bad \ud800"]})
    assert exc.value.details["errors"][0]["loc"] == ["x", "note", 1]
    assert exc.value.details["errors"][0]["type"] == "invalid_unicode"
    with pytest.raises(ArgumentsInvalid):  # a key, too
        s.call_sync(tool, x={"\udfff": 1})
    assert nothing_logged(u)


def test_nesting_past_the_limit_is_refused_with_its_path(u: UndoLog) -> None:
    s = u.session(agent_id="bot")
    for depth in (65, 900, 5000):
        for tool in (store, publish):
            with pytest.raises(ArgumentsInvalid) as exc:
                s.call_sync(tool, x=nested(depth - 1))  # x's value under the arguments object: `depth` levels in all
            err = exc.value.details["errors"][0]
            assert err["type"] == "json_too_deep", (depth, err)
            assert err["loc"][:3] == ["x", "a", "a"]
    assert nothing_logged(u)


def test_nesting_at_the_limit_is_accepted(u: UndoLog) -> None:
    RETURNS["value"] = "ok"
    s = u.session(agent_id="bot")
    assert s.call_sync(store, x=nested(limits.MAX_JSON_DEPTH - 1)) == "ok"
    (e,) = effects(u, s.id)
    assert e["state"] == "committed"


# -- hostile results: the tool ran, so the result is stored and the commit mark never lost -----------------------


def _cyclic() -> Any:
    a: list[Any] = [1]
    a.append(a)
    return a


HOSTILE_RESULTS = {
    "surrogate": ("\ud800", lambda r: r == "\\ud800"),
    "surrogate_key": ({"\udc00k": "v"}, lambda r: r == {"\\udc00k": "v"}),
    "deep_2000": (nested(2000), lambda r: "undolog_truncated" in json.dumps(r)),
    # Deeper than the cap, yet within what the JSON encoder itself takes (255): capped all the same.
    "deep_100": (nested(100), lambda r: "undolog_truncated" in json.dumps(r)),
    "deep_64": (nested(60), lambda r: "undolog_truncated" not in json.dumps(r)),
    "huge": ("x" * (limits.MAX_RESULT_BYTES + 10), lambda r: r["undolog_truncated"]["bytes"] > limits.MAX_RESULT_BYTES),
    "cyclic": (_cyclic(), lambda r: r[0] == 1 and "undolog_truncated" in json.dumps(r)),
    "nan": ({"v": float("nan")}, lambda r: r == {"v": "NaN"}),
    "nul": ("a\x00b", lambda r: r == "a\x00b"),
}


@pytest.mark.parametrize("tier", ["compensable", "irreversible"])
def test_a_hostile_result_is_stored_capped_and_the_call_returns_the_real_value(u: UndoLog, tier: str) -> None:
    for kind in sorted(HOSTILE_RESULTS):
        _hostile_result(u, tier, kind)


def _hostile_result(u: UndoLog, tier: str, kind: str) -> None:
    value, check = HOSTILE_RESULTS[kind]
    RETURNS["value"] = value
    s = u.session(agent_id="bot")
    if tier == "compensable":
        got = s.call_sync(store, x=1, call_id="c-1")
    else:
        with pytest.raises(ApprovalPending) as p:
            s.call_sync(publish, x=1, call_id="c-1")
        u.approvals.approve(p.value.approval_request_id, approver="ana")
        got = s.call_sync(publish, x=1, call_id="c-1")
    assert got is value, kind  # the caller gets the tool's own value, not the stored form
    (e,) = effects(u, s.id)
    assert e["state"] == "committed", (kind, e["state"])
    assert u.sessions.get(s.id).state == "active"
    assert check(e["result_snapshot"]), (kind, str(e["result_snapshot"])[:200])
    # The same call again replays the stored (safe) result; recovery finds nothing in flight.
    replay = s.call_sync(store if tier == "compensable" else publish, x=1, call_id="c-1")
    assert check(replay)
    u.recover()
    assert effects(u, s.id)[0]["state"] == "committed"


def test_a_compensation_sees_the_stored_result_of_a_hostile_call(u: UndoLog) -> None:
    RETURNS["value"] = {"id": "m-1", "note": "\ud800"}
    UNDONE.clear()
    s = u.session(agent_id="bot")
    s.call_sync(store, x=1)
    s.rollback_sync()
    assert UNDONE == [{"id": "m-1", "note": "\\ud800"}]


@pytest.mark.parametrize("message", ["bad \ud800 text", "nul \x00 inside"])
def test_a_failure_whose_message_cannot_be_stored_is_still_recorded(u: UndoLog, message: str) -> None:
    RETURNS["value"] = message
    s = u.session(agent_id="bot")
    with pytest.raises(RuntimeError):
        s.call_sync(explode, x=1)
    (e,) = effects(u, s.id)
    assert e["state"] in ("failed", "compensated"), e
    assert "RuntimeError" in e["error"]
    assert u.sessions.get(s.id).state == "rolled_back"


def test_safe_result_and_preview_helpers() -> None:
    assert limits.safe_result({"a": [1, 2.5, None, True]}) == {"a": [1, 2.5, None, True]}
    capped = limits.safe_result("y" * 100, max_bytes=50)
    assert capped["undolog_truncated"]["bytes"] == 102
    assert limits.preview({"k": "v"}) == {"k": "v"}
    big = limits.preview({"k": "v" * 5000})
    assert big["undolog_truncated"]["chars"] > 5000 and len(big["undolog_truncated"]["preview"]) == limits.PREVIEW_CHARS
    assert limits.result_text({"id": 7}) == '{"id":7}'


# -- full JSON Schema ------------------------------------------------------------------------------------------------


SCHEMA_CASES = [
    ({"to": "mallory", "amount": 5}, ["to"], "enum"),
    ({"to": "acme", "amount": 1e12}, ["amount"], "maximum"),
    ({"to": "acme", "amount": -1}, ["amount"], "minimum"),
    ({"to": "acme", "amount": 5, "memo": "x" * 11}, ["memo"], "maxLength"),
    ({"to": "acme", "amount": 5, "lines": [{"sku": "S1"}, {"sku": "X"}]}, ["lines", 1, "sku"], "pattern"),
    ({"to": "acme", "amount": 5, "lines": [{}]}, ["lines", 0, "sku"], "required"),
    ({"to": "acme"}, ["amount"], "required"),
    ({"to": "acme", "amount": 5, "extra": 1}, [], "additionalProperties"),
]


def test_agent_input_is_validated_against_the_whole_schema(u: UndoLog) -> None:
    s = u.session(agent_id="bot")
    for args, loc, keyword in SCHEMA_CASES:
        with pytest.raises(ArgumentsInvalid) as exc:
            s.call_sync("pay", **args)
        errs = exc.value.details["errors"]
        assert {"loc": loc, "type": f"schema.{keyword}"} in [{"loc": e["loc"], "type": e["type"]} for e in errs], errs
    assert nothing_logged(u)


def test_an_edit_is_validated_against_the_whole_schema_even_where_the_tool_is_not_loaded(u: UndoLog, db: Any) -> None:
    s = u.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as p:
        s.call_sync("pay", to="acme", amount=5, call_id="c-1")
    rid = p.value.approval_request_id
    with pytest.raises(ArgumentsInvalid) as exc:
        u.approvals.modify(rid, approver="ana", args={"to": "mallory", "amount": 1e12})
    assert sorted(e["loc"][0] for e in exc.value.details["errors"]) == ["amount", "to"]
    # A process without the tool (the CLI, a desk without --app) checks the stored contract's schema the same way.
    other = db.open()
    with pytest.raises(ArgumentsInvalid) as exc:
        other.approvals.modify(rid, approver="ana", args={"to": "acme", "amount": 5, "memo": "much too long"})
    assert exc.value.details["errors"][0]["loc"] == ["memo"]
    with pytest.raises(ArgumentsInvalid):
        other.approvals.modify(rid, approver="ana", args={"to": "acme", "amount": nested(100)})
    assert u.approvals.get(rid).state == "pending"
    other.approvals.modify(rid, approver="ana", args={"to": "globex", "amount": 7})
    assert s.call_sync("pay", to="acme", amount=5, call_id="c-1") == {"to": "globex", "amount": 7}
    assert PAID == [{"to": "globex", "amount": 7}]


def test_an_invalid_schema_is_refused_at_registration(u: UndoLog) -> None:
    with pytest.raises(InvalidDeclaration, match="not a valid JSON Schema"):
        u.register_tool(lambda **kw: kw, name="bad", tier="safe", args_schema={"type": "objekt"})


def test_validators_are_compiled_once_per_schema() -> None:
    from undolog_core._validation import schema_validator

    assert schema_validator("a", dict(PAY_SCHEMA)) is schema_validator("b", json.loads(json.dumps(PAY_SCHEMA)))


# -- one identity length rule ------------------------------------------------------------------------------------


def test_a_session_id_at_the_limit_works_for_every_tier(u: UndoLog) -> None:
    RETURNS["value"] = "ok"
    sid = "s" * limits.MAX_ID_LENGTH
    s = u.session(session_id=sid, agent_id="a" * limits.MAX_ID_LENGTH)
    assert s.call_sync(store, x=1) == "ok"
    with pytest.raises(ApprovalPending) as p:
        s.call_sync(publish, x=1, call_id="c" * limits.MAX_ID_LENGTH)
    rec = u.approvals.approve(p.value.approval_request_id, approver="ana" * 66)
    assert rec.state.value == "approved" and len(rec.decided_by) == 198
    assert u.verify_audit().ok


@pytest.mark.parametrize("field", ["approver", "actor"])
def test_an_identity_over_the_limit_is_a_clear_error_and_nothing_changes(u: UndoLog, field: str) -> None:
    s = u.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as p:
        s.call_sync(publish, x=1)
    rid = p.value.approval_request_id
    long = "x" * (limits.MAX_ID_LENGTH + 1)
    if field == "approver":
        for decide in (lambda: u.approvals.approve(rid, approver=long),
                       lambda: u.approvals.reject(rid, approver=long, reason="no"),
                       lambda: u.approvals.modify(rid, approver=long, args={"x": 2}),
                       lambda: u.approvals.approve(rid, approver="bad \x00")):
            with pytest.raises(InvalidId, match="at most 200 characters"):
                decide()
        assert u.approvals.get(rid).state == "pending"
    else:
        u.approvals.reject(rid, approver="ana", reason="no")
        with pytest.raises(InvalidId):
            u.sessions.resume(s.id, actor=long)
        with pytest.raises(InvalidId):
            u.rollback(s.id, actor=long)
        with pytest.raises(InvalidId):
            u.policy.set(actor=long, context_calls=3)
        assert u.sessions.get(s.id).state == "halted"
    with pytest.raises(InvalidId):
        u.session(agent_id=long).call_sync(store, x=1)
    with pytest.raises(InvalidId):
        u.session(session_id="s" * (limits.MAX_ID_LENGTH + 1)).call_sync(store, x=1)


@undolog_tool(tier=ToolTier.SAFE)
def look(q: Any) -> str:
    return "seen"


def test_hostile_safe_arguments_in_the_agent_context_never_break_an_approval_request(u: UndoLog) -> None:
    """SAFE calls are not logged, but a request's agent context shows them: stored made safe."""
    u.register(look)
    s = u.session(agent_id="bot")
    s.call_sync(look, q="bad \ud800")
    s.call_sync(look, q=nested(2000))
    with pytest.raises(ApprovalPending) as p:
        s.call_sync(publish, x=1)
    context = u.approvals.get(p.value.approval_request_id).agent_context
    assert [c["args"]["q"] for c in context][0] == "bad \\ud800"
    assert "undolog_truncated" in json.dumps(context[1]["args"])


# -- declarations: what one database would refuse, both refuse, at registration ------------------------------------


BAD_DECLARATIONS = {
    "long tool name": {"name": "t" * (limits.MAX_ID_LENGTH + 1), "tier": "safe"},
    "NUL in tool name": {"name": "t\x00", "tier": "safe"},
    "surrogate in tool name": {"name": "t\udc00", "tier": "safe"},
    "long compensation name": {"name": "c1", "tier": "compensable", "compensation": "u" * (limits.MAX_ID_LENGTH + 1)},
    "NUL in compensation name": {"name": "c2", "tier": "compensable", "compensation": "u\x00"},
    "NUL in reason": {"name": "i1", "tier": "irreversible", "reason": "wipes \x00 all"},
    "surrogate in reason": {"name": "i2", "tier": "irreversible", "reason": "wipes \ud800"},
    "NUL in a risk tag": {"name": "i3", "tier": "irreversible", "risk_tags": ["pii\x00"]},
    "surrogate in a risk tag": {"name": "i4", "tier": "irreversible", "risk_tags": ["\udc00"]},
}


@pytest.mark.parametrize("case", sorted(BAD_DECLARATIONS))
def test_a_declaration_the_store_cannot_hold_is_refused_at_registration(u: UndoLog, case: str) -> None:
    """Before: PostgreSQL refused a long or NUL-bearing name at registration with a raw DataError (SQLite stored it,
    so an app built on the embedded default broke on PostgreSQL at start); a NUL in the reason registered on both,
    then every call of the tool failed at its gate on PostgreSQL (the request's reason is text); a surrogate was a
    UnicodeEncodeError. Now: InvalidDeclaration naming what is wrong, on both, and nothing is stored."""
    before = u.registry.history()
    with pytest.raises(InvalidDeclaration) as exc:
        u.register_tool(lambda x=None: x, **BAD_DECLARATIONS[case])
    assert any(w in exc.value.message for w in ("name", "reason", "risk tag")), exc.value.message
    assert u.registry.history() == before


def test_a_declaration_at_the_limits_registers_and_gates(u: UndoLog) -> None:
    name = "t" * limits.MAX_ID_LENGTH
    u.register_tool(lambda x=None: x, name=name, tier="irreversible", reason="wipes\tall\n(é)", risk_tags=["pii"])
    s = u.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as p:
        s.call_sync(name, x=1)
    assert u.approvals.get(p.value.approval_request_id).reason == "wipes\tall\n(é)"


def test_a_response_that_is_not_valid_unicode_is_refused_and_the_request_stays_pending(u: UndoLog) -> None:
    """Before: a UnicodeEncodeError from the audit hash, not an UndoLogError."""
    s = u.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as p:
        s.call_sync(publish, x=1, call_id="c-1")
    rid = p.value.approval_request_id
    with pytest.raises(UndoLogError, match="lone surrogate"):
        u.approvals.respond(rid, approver="ana", response="done \ud800")
    assert u.approvals.get(rid).state == "pending"
    u.approvals.respond(rid, approver="ana", response="done \x00 anyway")  # NUL is valid Unicode: kept
    assert s.call_sync(publish, x=1, call_id="c-1") == "done \x00 anyway"
    assert u.verify_audit().ok


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**30])
def test_a_policy_number_that_is_not_a_sane_whole_number_is_policy_invalid(u: UndoLog, value: Any) -> None:
    """Before: an infinity raised OverflowError from int(), not PolicyInvalid."""
    from undolog_core.errors import PolicyInvalid

    before = u.policy.get()
    for field in ("approval_timeout_seconds", "context_calls", "approved_ttl_seconds"):
        with pytest.raises(PolicyInvalid):
            u.policy.set(actor="admin", **{field: value})
    assert u.policy.get() == before


@pytest.mark.parametrize("message", ["bad \ud800 text", "nul \x00 inside"])
def test_leaving_a_session_by_an_exception_that_cannot_be_stored_still_rolls_it_back(u: UndoLog, message: str) -> None:
    """The exception's text becomes the rollback's reason (stored as text, hashed into the audit). Before: the
    rollback failed on it (a UnicodeEncodeError on both databases, a NUL refused by PostgreSQL), the halt that
    follows a failed rollback failed on the same text, and the session stayed `active` with its calls undone by
    nobody."""
    import asyncio

    RETURNS["value"] = "ok"
    UNDONE.clear()
    with pytest.raises(RuntimeError) as exc:
        with u.session(agent_id="bot") as s:
            s.call_sync(store, x=1)
            raise RuntimeError(message)
    assert u.sessions.get(s.id).state == "rolled_back", exc.value.__notes__
    assert UNDONE == ["ok"]

    async def leave() -> str:
        async with u.session(agent_id="bot") as a:
            await a.call(store, x=2)
            raise RuntimeError(message)

    with pytest.raises(RuntimeError):
        asyncio.run(leave())
    assert UNDONE == ["ok", "ok"]
    assert all(r.state == "rolled_back" for r in u.sessions.list())
    assert u.verify_audit().ok


HOSTILE_TEXT: dict[str, str] = {}


def hostile_probe(ctx: Any) -> Any:
    raise RuntimeError(HOSTILE_TEXT["probe"])


@compensation("undo_hostile")
def undo_hostile(ctx: Any) -> None:
    raise RuntimeError(HOSTILE_TEXT["undo"])


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_hostile", probe=hostile_probe)
def probed_send(x: Any) -> Any:
    return x


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_hostile")
def plain_send(x: Any) -> Any:
    return x


@pytest.mark.parametrize("message", ["bad \ud800 text", "nul \x00 inside"])
@pytest.mark.parametrize("tool", ["probed_send", "plain_send"])
def test_recovery_whose_probe_or_compensation_fails_with_unstorable_text_still_counts_to_the_dead_letter(
        u: UndoLog, tool: str, message: str) -> None:
    """Before: recovery stored the probe's or the compensation's error text as it was; the store refused it (a
    surrogate on both databases, a NUL on PostgreSQL), so recover() raised on every run and the call never reached
    the dead letter: in flight for ever, its session writable."""
    u.register(probed_send, plain_send, undo_hostile)
    u.saga.backoff_seconds = 0.0
    HOSTILE_TEXT.update(probe=message, undo=message)
    s = u.session(agent_id="bot")
    d = u.driver.decide(s.id, tool, {"x": 1}, call_id="c")
    u.leases.abandon(d.effect_id)  # as if the process died while it ran
    for _ in range(Recovery.dead_letter_after):
        u.recover()
    (e,) = effects(u, s.id)
    assert e["state"] in ("dead_letter", "compensated"), e
    assert u.sessions.get(s.id).state == "halted"
    assert u.recover().errors == []


PROBE_SAYS: dict[str, Any] = {}


def saying_probe(ctx: Any) -> Any:
    return PROBE_SAYS.get(ctx.args["x"], False)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_store", probe=saying_probe)
def probed_store(x: Any) -> Any:
    return x


@pytest.mark.parametrize("kind", ["cyclic", "deep_2000", "surrogate", "huge"])
def test_a_probe_whose_answer_is_hostile_settles_its_call_and_never_wedges_recovery(u: UndoLog, kind: str) -> None:
    """A probe's answer is the call's result, so it is stored made safe like any result. Before: a cyclic or very
    deep answer raised out of recover() (every run, so every other in-doubt call in the store waited behind it), and
    a lone surrogate was stored as it was (an invalid string for every reader)."""
    value, check = HOSTILE_RESULTS[kind]
    u.register(probed_store)
    PROBE_SAYS.clear()
    PROBE_SAYS.update({"hostile": value, "fine": {"ok": True}})
    sids = []
    for x in ("hostile", "fine"):
        s = u.session(agent_id="bot")
        d = u.driver.decide(s.id, "probed_store", {"x": x}, call_id="c")
        u.leases.abandon(d.effect_id)  # as if the process died after the tool ran
        sids.append(s.id)
    report = u.recover()
    assert report.errors == [], report.errors
    (hostile,) = effects(u, sids[0])
    (fine,) = effects(u, sids[1])
    assert hostile["state"] == "committed" and check(hostile["result_snapshot"]), str(hostile)[:300]
    assert fine["state"] == "committed" and fine["result_snapshot"] == {"ok": True}


@pytest.mark.parametrize(("edit", "loc"), [({"to": "acme", "amount": float("nan")}, ["amount"]),
                                           ({"to": "acme", "amount": 5, "lines": [{"sku": "S1", "n": float("inf")}]},
                                            ["lines", 0, "n"])])
def test_an_edit_with_a_number_json_cannot_hold_is_arguments_invalid_naming_it(u: UndoLog, db: Any, edit: Any,
                                                                               loc: list[Any]) -> None:
    """Before: a raw ValueError from the JSON encoder (the request stayed pending, the person got no field)."""
    s = u.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as p:
        s.call_sync("pay", to="acme", amount=5, call_id="c-1")
    rid = p.value.approval_request_id
    for service in (u.approvals, db.open().approvals):  # with the tool loaded, and without it (a CLI, a desk)
        with pytest.raises(ArgumentsInvalid) as exc:
            service.modify(rid, approver="ana", args=edit)
        assert exc.value.details["errors"][0]["loc"] == loc
        assert u.approvals.get(rid).state == "pending"
