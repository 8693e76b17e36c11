"""A desk process that sweeps once with Slack on, for the crash tests (killed while Slack holds its post).

    python -m tests.support.slack_sender     (UNDOLOG_DATABASE_URL, UNDOLOG_SCHEMA, SLACK_API_URL)
"""

from __future__ import annotations

import os

from undolog_core import UndoLog
from undolog_server import create_app
from undolog_server.slack import SlackConfig
from undolog_server.state import ServerSettings

from . import demo_app
from .slack_standin import SIGNING_SECRET, TEAM, TOKEN


def main() -> None:
    undolog = UndoLog.open(os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA"))
    demo_app.register(undolog)
    config = SlackConfig(bot_token=TOKEN, signing_secret=SIGNING_SECRET, team_id=TEAM,
                         api_url=os.environ["SLACK_API_URL"], update_now=False)
    app = create_app(undolog, settings=ServerSettings(background=False, slack=config))
    app.state.sweeper.tick()


if __name__ == "__main__":
    main()
