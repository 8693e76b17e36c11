"""The integration contract's reads of one call and the session record put back (issue #35): what the gateway and
the desk used to reach ``undolog.store`` / ``undolog.engine`` for, now documented functions of
``undolog_core.integration``."""

from __future__ import annotations

from undolog_core import EffectState, SessionState
from undolog_core.integration import (
    IN_FLIGHT,
    find_call,
    find_effect,
    session_of_client_key,
    session_table,
)

from ..support.toolkit import setup


def test_find_call_and_find_effect_name_the_same_effect_and_its_state(undolog):
    _, tools = setup(undolog)
    with undolog.session(agent_id="bot") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5, call_id="c1")
        sid = s.id
        s.complete()
    ref = find_call(undolog, sid, "c1")
    assert ref is not None
    assert (ref.session_id, ref.tool_name, ref.state) == (sid, "send_refund_email", EffectState.COMMITTED)
    assert ref.state not in IN_FLIGHT and isinstance(ref.state, EffectState)
    assert find_effect(undolog, ref.effect_id) == ref
    assert find_call(undolog, sid, "no-such-call") is None
    assert find_call(undolog, "no-such-session", "c1") is None


def test_session_of_client_key_finds_only_client_keyed_calls(undolog):
    _, tools = setup(undolog)
    with undolog.session(agent_id="bot") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5, call_id="ck:abc")
        s.call_sync(tools["send_refund_email"], user_id="u2", amount=6, call_id="plain")
        sid = s.id
        s.complete()
    assert session_of_client_key(undolog, "ck:abc") == sid
    assert session_of_client_key(undolog, "ck:other") is None
    assert session_of_client_key(undolog, "plain") is None  # not a client key: the partial index holds no such id


def test_remember_puts_a_session_changed_elsewhere_back_into_the_records(undolog, db):
    _, tools = setup(undolog)
    sessions = session_table(undolog)
    s = undolog.session(agent_id="bot")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    counted = sessions.cached(s.id)
    assert counted is not None and counted.state == SessionState.ACTIVE
    elsewhere = db.open()  # another process halts it
    elsewhere.sessions.set_state(s.id, SessionState.HALTED.value, allowed=(SessionState.ACTIVE.value,))
    assert sessions.cached(s.id).state == SessionState.ACTIVE  # this process does not know yet
    record = sessions.remember(undolog.sessions.get(s.id))
    assert record is sessions.cached(s.id) and record.state == SessionState.HALTED
