"""``python -m examples.support_agent [--reject] [--interactive] [--model provider:name] [--db PATH]``."""

from __future__ import annotations

import argparse

from .demo import main


def _cli() -> int:
    p = argparse.ArgumentParser(prog="python -m examples.support_agent", description=__doc__)
    p.add_argument("--reject", action="store_true", help="the supervisor rejects the account deletion")
    p.add_argument("--interactive", action="store_true", help="decide the approval at the prompt")
    p.add_argument("--model", default=None, help="provider:name of a real chat model (needs its package and key)")
    p.add_argument("--db", default=None, help="UndoLog SQLite file (a temporary folder by default)")
    a = p.parse_args()
    return main(reject=a.reject, interactive=a.interactive, model=a.model, db_path=a.db)


raise SystemExit(_cli())
