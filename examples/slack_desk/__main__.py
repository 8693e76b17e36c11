"""``python -m examples.slack_desk [--reject] [--db PATH]``."""

from __future__ import annotations

import argparse

from .demo import main


def _cli() -> int:
    p = argparse.ArgumentParser(prog="python -m examples.slack_desk", description=__doc__)
    p.add_argument("--reject", action="store_true", help="the approver rejects the wire in Slack")
    p.add_argument("--db", default=None, help="UndoLog SQLite file (a temporary folder by default)")
    a = p.parse_args()
    return main(reject=a.reject, db_path=a.db)


raise SystemExit(_cli())
