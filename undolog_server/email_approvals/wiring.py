"""Mounting email approvals on the desk's app: the admin routes always, the rest when email is configured.

Example:
    >>> install(app)   # create_app does this
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from undolog_core import errors

from .admin import api
from .page import ui
from .sender import EmailSender, queue_fanout
from .tokens import load_token_key

if TYPE_CHECKING:
    from ..state import ServerState

__all__ = ["install"]


def install(app: FastAPI) -> None:
    """Mount the admin API (always) and, when email is configured, the confirmation page, the outbox consumer and
    the mail loop."""
    app.include_router(api)
    app.include_router(ui)
    st: ServerState = app.state.undolog_server
    if st.settings.email is None:
        return
    try:
        key = load_token_key(st.settings.email)
    except ValueError as exc:
        raise errors.ConfigurationError(str(exc)) from None
    app.state.email_token_key = key
    sender = EmailSender(st, key)
    app.state.email_sender = sender
    # Runs inside the webhook fan-out's claiming transaction: the request's mail is queued with the claim.
    app.state.sweeper.webhooks.consumers.append(lambda: lambda conn, event: queue_fanout(st, conn, event))
    st.background_loops.append(sender.loop)
