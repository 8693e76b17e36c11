"""``python -m examples.slack_desk`` (docs/how-to/slack.md) runs the Slack path end to end against the stand-in."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("reject", [False, True])
def test_the_slack_example_runs_end_to_end(tmp_path: Path, reject: bool) -> None:
    args = [sys.executable, "-m", "examples.slack_desk", "--db", str(tmp_path / "x.db")] + (["--reject"] if reject else [])
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "wire_money is waiting for approval" in out
    assert "[Approve]" in out and "[Reject]" in out and "[Edit]" in out
    assert "hidden (sensitive)" in out and "acct 0042" not in out  # the memo is the group's secret
    assert "&lt;!channel&gt;" in out  # the agent's text reached Slack escaped
    if reject:
        assert "Rejected* by ana" in out and re.search("refused: (approval_rejected|session_halted)", out) and "money wired: []" in out
    else:
        assert "Approved* by ana" in out and "the tool ran: {'wired': 1200.0" in out
        assert "money wired: [{'to': 'Globex <!channel>', 'amount': 1200.0}]" in out
