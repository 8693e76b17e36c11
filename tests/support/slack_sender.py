"""A desk process with Slack on, for the crash tests: killed while Slack holds its post, or by SIGKILL right after
it recorded a decision and before it marked the request's messages for their update.

    python -m tests.support.slack_sender sweep                        (UNDOLOG_DATABASE_URL, UNDOLOG_SCHEMA, SLACK_API_URL)
    python -m tests.support.slack_sender approve-then-die RID DIGEST
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from undolog_core import UndoLog
from undolog_server import create_app
from undolog_server.slack import SlackConfig
from undolog_server.state import ServerSettings
from undolog_server.storage.slack import SlackStore

from . import demo_app
from .slack_standin import SIGNING_SECRET, TEAM, TOKEN


def _app() -> Any:
    undolog = UndoLog.open(os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA"))
    demo_app.register(undolog)
    config = SlackConfig(bot_token=TOKEN, signing_secret=SIGNING_SECRET, team_id=TEAM,
                         api_url=os.environ["SLACK_API_URL"], update_now=False)
    return create_app(undolog, settings=ServerSettings(background=False, slack=config))


def main(argv: list[str]) -> None:
    app = _app()
    if argv[0] == "sweep":
        app.state.sweeper.tick()
        return
    rid, digest = argv[1], argv[2]

    def die(self: Any, approval_request_id: str, unless_shown: str | None = None) -> int:
        # The decision is committed; this process dies before anything marks or updates a message.
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    SlackStore.mark_dirty = die  # type: ignore[method-assign]
    payload = {"type": "block_actions", "team": {"id": TEAM}, "user": {"id": "U0ANA", "team_id": TEAM},
               "trigger_id": "t", "actions": [{"action_id": "undolog_approve",
                                               "value": json.dumps({"r": rid, "d": digest})}]}
    app.state.undolog_server.slack.handle(payload)
    raise SystemExit("the decision returned: the process was meant to die inside it")


if __name__ == "__main__":
    main(sys.argv[1:])
