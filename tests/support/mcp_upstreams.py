"""Placing a test upstream MCP server (``tickets_server.py``, ``counter_server.py``, ...) in a test's folder.

A gateway starts its upstream from the config's folder with the SDK's bare environment, so the script's own folder
is the only one of the repository's on its ``sys.path``: the module its tools are built with (``lowlevel_tools.py``)
is copied there beside it. Kept apart from that module, which imports the SDK (as a gateway does) when imported.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SUPPORT = Path(__file__).parent
TICKETS = SUPPORT / "tickets_server.py"


def copy_upstream(script: Path, folder: Path) -> Path:
    """Copy ``script`` and the module its tools are built with into ``folder``; answer the copy."""
    shutil.copyfile(SUPPORT / "lowlevel_tools.py", folder / "lowlevel_tools.py")
    target = folder / script.name
    shutil.copyfile(script, target)
    return target
