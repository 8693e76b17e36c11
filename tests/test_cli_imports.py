"""What importing the ``undolog`` CLI loads: every command and every gateway an MCP client starts
(``undolog mcp serve`` runs through it) imports it, so what no command needs at start-up stays out: Rich (loaded
by the command that prints a table or a bar, about 35 ms), Alembic (loaded only to migrate) and the MCP SDK (loaded
by the ``mcp`` commands). One child process: this one has them all loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = ("import json, sys\nimport undolog_core.cli\n"
          "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'alembic', 'mcp'})))\n")


def test_importing_the_cli_loads_no_rich_alembic_or_mcp() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []
