"""What one server process holds: the UndoLog, the server store, settings and loaded tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from undolog_core import UndoLog

from .storage import ServerStore
from .views import CoreViews

if TYPE_CHECKING:
    from .proxy import ProxyTools


@dataclass
class ServerSettings:
    """Tunables of one server process.

    Attributes:
        background: Run the sweeper and webhook loops (tests of single pieces turn it off).
        sweep_interval: Seconds between sweeps (expire due approvals, escalate, fan out events).
        recover_interval: Seconds between recovery runs.
        webhook_interval: Seconds between polls for due webhook deliveries.
        webhook_timeout: Seconds one webhook POST may take before it counts as failed.
        webhook_max_attempts: Attempts before a delivery is given up as ``failed``.
        webhook_backoff_base: First retry delay; doubles each attempt.
        webhook_backoff_max: Ceiling of the retry delay.
        context_calls: How many of the session's last calls a request page shows.
        cookie_max_age: Dashboard login lifetime in seconds.
        secure_cookies: Force the cookie ``Secure`` flag; None sets it on HTTPS requests only.
        poll_seconds: Dashboard queue refresh period.
        max_body_bytes: The largest request body accepted (bytes); a larger one is answered 413 before it is
            buffered.
    """

    background: bool = True
    sweep_interval: float = 1.0
    recover_interval: float = 30.0
    webhook_interval: float = 0.5
    webhook_timeout: float = 5.0
    webhook_max_attempts: int = 8
    webhook_backoff_base: float = 1.0
    webhook_backoff_max: float = 300.0
    context_calls: int = 10
    cookie_max_age: int = 12 * 3600
    secure_cookies: bool | None = None
    poll_seconds: float = 3.0
    max_body_bytes: int = 1 << 20


@dataclass
class ServerState:
    """Everything the routes need, attached to ``app.state.undolog_server``."""

    undolog: UndoLog
    store: ServerStore
    views: CoreViews
    settings: ServerSettings
    secret: bytes
    proxy: ProxyTools | None = None
    app_spec: str | None = None
    worker_id: str = ""
    stats: dict[str, int] = field(default_factory=dict)

