"""How the desk talks to one Slack workspace (``SlackConfig``), and Slack's request signature (``sign_request``).

A leaf of the Slack package: the sender, the handler and the desk take a ``SlackConfig``; nothing here talks to
Slack or the database.

Example:
    >>> SlackConfig(bot_token="xoxb-1", signing_secret="s", team_id="T1").api_url
    'https://slack.com/api/'
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MISSING_EXTRA", "SlackConfig", "sign_request"]

#: What a desk configured for Slack without the ``slack`` extra is told.
MISSING_EXTRA = "Slack approvals need the slack extra: pip install 'undolog[slack]'"


@dataclass(frozen=True)
class SlackConfig:
    """How the desk talks to one Slack workspace.

    Attributes:
        bot_token: The app's bot token (``xoxb-...``): ``chat:write`` and ``channels:history`` (``groups:history``
            for private channels) scopes.
        signing_secret: The app's signing secret: interactivity requests are verified with it.
        team_id: The workspace whose people may decide (``T...``); a user of any other workspace is refused.
        api_url: The Web API's base URL (a stand-in's in tests).
        response_url_prefixes: Where a refusal may be told through a payload's ``response_url``.
        desk_url: The desk's public URL, for a link to the request on the dashboard (default: the desk's
            ``--public-url``).
        fold: Characters of an argument's value shown in a message; a longer one is cut and says by how much.
        max_attempts: Attempts before a post or an update is given up (rate limits do not count).
        update_now: Send a message's update right after a decision taken in Slack (the sweeper would anyway).

    Example:
        >>> SlackConfig(bot_token="xoxb-1", signing_secret="s", team_id="T1").api_url
        'https://slack.com/api/'
    """

    bot_token: str
    signing_secret: str
    team_id: str
    api_url: str = "https://slack.com/api/"
    response_url_prefixes: tuple[str, ...] = ("https://hooks.slack.com/",)
    desk_url: str | None = None
    fold: int = 300
    max_attempts: int = 10
    update_now: bool = True

    def __post_init__(self) -> None:
        for name in ("bot_token", "signing_secret", "team_id"):
            if not str(getattr(self, name) or "").strip():
                raise ValueError(f"Slack needs {name}: set it (UNDOLOG_SLACK_{name.upper()}) or leave Slack off")
        if not self.api_url.endswith("/"):
            object.__setattr__(self, "api_url", self.api_url + "/")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlackConfig | None:
        """The configuration from ``UNDOLOG_SLACK_BOT_TOKEN``, ``UNDOLOG_SLACK_SIGNING_SECRET``,
        ``UNDOLOG_SLACK_TEAM_ID`` (and optionally ``UNDOLOG_SLACK_API_URL``, ``UNDOLOG_SLACK_DESK_URL``); None when
        no bot token is set (Slack off).

        Example:
            >>> SlackConfig.from_env({}) is None
            True
        """
        env = os.environ if env is None else env
        if not env.get("UNDOLOG_SLACK_BOT_TOKEN"):
            return None
        extra: dict[str, Any] = {}
        if env.get("UNDOLOG_SLACK_API_URL"):
            extra["api_url"] = env["UNDOLOG_SLACK_API_URL"]
        if env.get("UNDOLOG_SLACK_DESK_URL"):
            extra["desk_url"] = env["UNDOLOG_SLACK_DESK_URL"]
        return cls(bot_token=env["UNDOLOG_SLACK_BOT_TOKEN"], signing_secret=env.get("UNDOLOG_SLACK_SIGNING_SECRET", ""),
                   team_id=env.get("UNDOLOG_SLACK_TEAM_ID", ""), **extra)


# ------------------------------------------------------------------------------------------------ signatures


def sign_request(signing_secret: str, timestamp: int | str, body: bytes) -> str:
    """Slack's request signature: ``v0=`` and the hex HMAC-SHA256 of ``v0:<timestamp>:<body>``.

    What Slack sends in ``X-Slack-Signature``; for tests and stand-ins (the desk verifies with ``slack_sdk``).

    Example:
        >>> sign_request("secret", 1700000000, b"payload=%7B%7D")[:3]
        'v0='
    """
    base = b"v0:" + str(timestamp).encode() + b":" + body
    return "v0=" + hmac.new(signing_secret.encode(), base, hashlib.sha256).hexdigest()
