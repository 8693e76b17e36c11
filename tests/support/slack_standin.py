"""The Slack Web API stand-in the tests use is the example's (``examples/slack_desk/standin.py``): one stand-in for
the tests and for the end-to-end example a reader runs."""

from examples.slack_desk.standin import (
    SIGNING_SECRET,
    TEAM,
    TOKEN,
    Call,
    SlackStandIn,
    block_action,
    signed,
    view_submission,
)

__all__ = ["SIGNING_SECRET", "TEAM", "TOKEN", "Call", "SlackStandIn", "block_action", "signed", "view_submission"]
