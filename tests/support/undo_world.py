"""A small CRM kept in a JSON file, with tools and compensations (correct and deliberately broken ones) for the
undo-check tests.

The state lives in a file (``UNDO_WORLD`` or the path given) so that a child process killed by ``crash=True``
and the parent that recovers it see the same world. Every write is keyed by the call's idempotency key, so a
compensation can tell "never happened" from "happened" on its own.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from undolog_core import CompensationDescriptor, ToolTier, compensation, current_call, undolog_tool

START = {
    "accounts": {"u1": {"email": "ana@example.com", "name": "Ana", "credit": 10},
                 "u2": {"email": "bo@example.com", "name": "Bo", "credit": 0}},
    "writes": {},  # do-key -> what the write replaced (the world's own operation log)
    "undone": [],  # undo-keys already applied
}


def _path() -> Path:
    return Path(os.environ["UNDO_WORLD"])


@contextmanager
def world() -> Iterator[dict[str, Any]]:
    """The world's state, read and written under a file lock (tools may run in worker threads or processes)."""
    path = _path()
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text()) if path.exists() else json.loads(json.dumps(START))
        yield state
        path.write_text(json.dumps(state))


def reset() -> None:
    _path().write_text(json.dumps(START))


def snapshot() -> dict[str, Any]:
    """What a correct compensation restores: the accounts (the operation log is a trace left on purpose)."""
    with world() as w:
        return w["accounts"]


def _key() -> str:
    call = current_call()
    assert call is not None and call.idempotency_key is not None
    return call.idempotency_key


# -- correct tools and compensations -------------------------------------------------------------------------

@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("restore_email"))
def change_email(user_id: str, email: str) -> dict[str, Any]:
    with world() as w:
        old = w["accounts"][user_id]["email"]
        w["writes"][_key()] = {"user_id": user_id, "email": old}
        w["accounts"][user_id]["email"] = email
    return {"user_id": user_id, "old_email": old}


@compensation("restore_email")
def restore_email(ctx: Any) -> None:
    with world() as w:
        before = w["writes"].get(f"do-{ctx.effect_id}")
        if before is None or ctx.idempotency_key in w["undone"]:
            return  # the change never happened, or was already taken back under this key
        w["undone"].append(ctx.idempotency_key)
        w["accounts"][before["user_id"]]["email"] = before["email"]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("remove_credit"))
def add_credit(user_id: str, amount: int) -> dict[str, Any]:
    with world() as w:
        if _key() not in w["writes"]:
            w["writes"][_key()] = {"user_id": user_id, "amount": amount}
            w["accounts"][user_id]["credit"] += amount
        return {"credit": w["accounts"][user_id]["credit"]}


@compensation("remove_credit")
def remove_credit(ctx: Any) -> None:
    with world() as w:
        done = w["writes"].get(f"do-{ctx.effect_id}")
        if done is None or ctx.idempotency_key in w["undone"]:
            return  # never happened, or already taken back under this key
        w["undone"].append(ctx.idempotency_key)
        w["accounts"][done["user_id"]]["credit"] -= done["amount"]


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
def close_account(user_id: str) -> dict[str, Any]:
    with world() as w:
        w["accounts"].pop(user_id)
    return {"closed": user_id}


# -- deliberately broken compensations ------------------------------------------------------------------------

@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("restore_profile_forgets_name"))
def update_profile(user_id: str, email: str, name: str) -> dict[str, Any]:
    with world() as w:
        acct = w["accounts"][user_id]
        w["writes"][_key()] = {"user_id": user_id, "email": acct["email"], "name": acct["name"]}
        acct["email"], acct["name"] = email, name
    return {"user_id": user_id}


@compensation("restore_profile_forgets_name")
def restore_profile_forgets_name(ctx: Any) -> None:
    with world() as w:
        before = w["writes"].get(f"do-{ctx.effect_id}")
        if before is not None:
            w["accounts"][before["user_id"]]["email"] = before["email"]  # BUG: the name is not restored


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("remove_credit_twice"))
def add_bonus(user_id: str, amount: int) -> dict[str, Any]:
    with world() as w:
        w["writes"][_key()] = {"user_id": user_id, "amount": amount}
        w["accounts"][user_id]["credit"] += amount
    return {"user_id": user_id, "amount": amount}


@compensation("remove_credit_twice")
def remove_credit_twice(ctx: Any) -> None:
    with world() as w:
        done = w["writes"].get(f"do-{ctx.effect_id}")
        if done is not None:
            w["accounts"][done["user_id"]]["credit"] -= done["amount"]  # BUG: ignores its undo key


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("unsend_trusting_result"))
def send_note(user_id: str, text: str) -> dict[str, Any]:
    with world() as w:
        w["accounts"][user_id].setdefault("notes", []).append(text)
        w["writes"][_key()] = {"user_id": user_id}
    return {"user_id": user_id, "text": text}


@compensation("unsend_trusting_result")
def unsend_trusting_result(ctx: Any) -> None:
    user_id = ctx.result["user_id"]  # BUG: no result when the call never happened
    with world() as w:
        w["accounts"][user_id]["notes"].remove(ctx.result["text"])
        if not w["accounts"][user_id]["notes"]:
            del w["accounts"][user_id]["notes"]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("remove_credit"))
def add_credit_then_fail(user_id: str, amount: int) -> dict[str, Any]:
    """Writes like add_credit, then fails: the session's on_failure policy would roll back at once."""
    add_credit(user_id, amount)  # a plain call: the write is keyed by this call's own do-key
    raise RuntimeError("the ledger went away after the write")


# -- async twins ---------------------------------------------------------------------------------------------

@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("aremove_credit"))
async def aadd_credit(user_id: str, amount: int) -> dict[str, Any]:
    await asyncio.sleep(0)
    with world() as w:
        if _key() not in w["writes"]:
            w["writes"][_key()] = {"user_id": user_id, "amount": amount}
            w["accounts"][user_id]["credit"] += amount
        return {"credit": w["accounts"][user_id]["credit"]}


@compensation("aremove_credit")
async def aremove_credit(ctx: Any) -> None:
    await asyncio.sleep(0)
    remove_credit(ctx)


CORRECT = [change_email, restore_email, add_credit, remove_credit, close_account, add_credit_then_fail]
BROKEN = [update_profile, restore_profile_forgets_name, add_bonus, remove_credit_twice, send_note,
          unsend_trusting_result]
ASYNC = [aadd_credit, aremove_credit]


# -- scenarios (importable by path for crash=True and the CLI) ------------------------------------------------

def register(undolog: Any) -> None:
    undolog.register(*CORRECT, *BROKEN, *ASYNC)


def correct_scenario(undolog: Any, run: Any) -> None:
    register(undolog)
    with undolog.session(session_id=f"crm-{run.id}") as s:
        s.call_sync(change_email, user_id="u1", email="ana@new.example")
        s.call_sync(add_credit, user_id="u2", amount=5)
        s.call_sync(change_email, user_id="u2", email="bo@new.example")


def broken_scenario(undolog: Any, run: Any) -> None:
    register(undolog)
    with undolog.session(session_id=f"crm-{run.id}") as s:
        s.call_sync(change_email, user_id="u1", email="ana@new.example")
        s.call_sync(update_profile, user_id="u2", email="b@x.example", name="Robert")


def two_step_scenario(undolog: Any, run: Any) -> None:
    register(undolog)
    with undolog.session(session_id=f"crm-{run.id}") as s:
        s.call_sync(change_email, user_id="u1", email="ana@new.example")
        s.call_sync(add_credit, user_id="u2", amount=5)


def note_scenario(undolog: Any, run: Any) -> None:
    register(undolog)
    with undolog.session(session_id=f"crm-{run.id}") as s:
        s.call_sync(send_note, user_id="u1", text="hello")


def readme_scenario(undolog: Any, run: Any) -> None:
    """The README's table: one correct compensation and three deliberately broken ones."""
    register(undolog)
    with undolog.session(session_id=f"crm-{run.id}") as s:
        s.call_sync(change_email, user_id="u1", email="ana@new.example")
        s.call_sync(update_profile, user_id="u2", email="b@x.example", name="Robert")
        s.call_sync(add_bonus, user_id="u1", amount=3)
        s.call_sync(send_note, user_id="u1", text="hello")


def changes_in_the_crash_child(undolog: Any, run: Any) -> None:
    """Two steps in this process, a different second step in a crash child (not deterministic there only)."""
    import sys

    register(undolog)
    with undolog.session(session_id=f"crm-{run.id}") as s:
        s.call_sync(change_email, user_id="u1", email="ana@new.example")
        if sys.argv[0].endswith("_crash.py"):
            s.call_sync(change_email, user_id="u2", email="bo@new.example")
        else:
            s.call_sync(add_credit, user_id="u2", amount=5)
