"""``SlackDesk``: the Slack integration of one desk process, its sender and its handler over one client and store.

The desk builds one when ``ServerSettings.slack`` is set (``state.slack``); the sweeper registers its
:meth:`~SlackDesk.consumer` with the webhook fan-out and calls its :meth:`~SlackDesk.tick`, the interactivity route
hands it Slack's requests. What it sends is :class:`~undolog_server.slack.sender.SlackSender`'s job, what it is sent
is :class:`~undolog_server.slack.handler.SlackHandler`'s; they share the Web API client and the Slack tables.

Example:
    >>> desk = SlackDesk(state, SlackConfig(bot_token="xoxb-1", signing_secret="s", team_id="T1"))
    >>> desk.tick()
    {'escalated': 0, 'sent': 0}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from undolog_core import errors
from undolog_core.records import OutboxEvent

from ..identity import ApiKey
from ..storage.slack import SlackChannel, SlackStore
from .config import MISSING_EXTRA, SlackConfig
from .handler import SlackHandler
from .sender import SlackSender, slack_store

if TYPE_CHECKING:
    from ..state import ServerState

__all__ = ["SlackDesk"]


@dataclass
class SlackDesk:
    """The Slack integration of one desk process: the outbox consumer and sender, and the interactivity handler.

    Args:
        state: The desk's state.
        config: The workspace's configuration.
        client: A ``slack_sdk.WebClient`` (one is made from ``config`` when None), shared by the sender and the
            handler from construction on.

    Example:
        >>> desk = SlackDesk(state, SlackConfig(bot_token="xoxb-1", signing_secret="s", team_id="T1"))
        >>> desk.tick()
        {'escalated': 0, 'sent': 0}
    """

    state: ServerState
    config: SlackConfig
    client: Any = None
    store: SlackStore = field(init=False)
    sender: SlackSender = field(init=False)
    handler: SlackHandler = field(init=False)

    def __post_init__(self) -> None:
        self.store = slack_store(self.state)
        if self.client is None:
            try:
                from slack_sdk import WebClient
            except ImportError:  # pragma: no cover - the extra is in dev
                raise errors.ConfigurationError(MISSING_EXTRA) from None
            self.client = WebClient(token=self.config.bot_token, base_url=self.config.api_url, timeout=10)
        self.sender = SlackSender(self.state, self.config, self.client, self.store)
        self.handler = SlackHandler(self.state, self.config, self.client, self.store)

    # ---- what it sends: the sender's ---------------------------------------------------------------

    def route(self, tool_name: str, risk_tags: Sequence[str],
              channels: Sequence[SlackChannel] | None = None) -> list[SlackChannel]:
        """The channel configurations of the approver groups a request is routed to (``*`` when none is)."""
        return self.sender.route(tool_name, risk_tags, channels)

    def consumer(self) -> Callable[[Any, OutboxEvent], None]:
        """The outbox consumer (see :meth:`SlackSender.consumer`)."""
        return self.sender.consumer()

    def tick(self, now: float | None = None) -> dict[str, int]:
        """Escalate what is due, then send the due posts and updates (the sweeper calls this every sweep)."""
        return self.sender.tick(now)

    def escalate(self, now: float | None = None) -> int:
        """Re-post undecided requests to their group's escalation channel (see :meth:`SlackSender.escalate`)."""
        return self.sender.escalate(now)

    def run_due(self, now: float | None = None, limit: int = 20) -> int:
        """Send every due post and update once; returns how many were attempted."""
        return self.sender.run_due(now, limit)

    def message(self, approval_request_id: str, channel: str, *,
                purpose: str = "request") -> tuple[list[dict[str, Any]], str]:
        """The Block Kit blocks and the notification text of a request's message as it stands now."""
        return self.sender.message(approval_request_id, channel, purpose=purpose)

    def kick(self) -> None:
        """Send what is due now, off the request's thread (a decision's message update)."""
        self.sender.kick()

    # ---- what it is sent: the handler's ------------------------------------------------------------

    def verify(self, body: bytes, headers: Mapping[str, str], now: float | None = None) -> None:
        """Check an interactivity request's signature and freshness, and refuse a replay (see
        :meth:`SlackHandler.verify`)."""
        self.handler.verify(body, headers, now)

    def key_of(self, payload: Mapping[str, Any], action: str, approval_request_id: str | None) -> ApiKey:
        """The API key the payload's person decides with (refusals are audited)."""
        return self.handler.key_of(payload, action, approval_request_id)

    def handle(self, payload: Mapping[str, Any]) -> dict[str, Any] | None:
        """Act on a verified interactivity payload; returns the JSON to answer Slack with (None: an empty 200)."""
        return self.handler.handle(payload)
