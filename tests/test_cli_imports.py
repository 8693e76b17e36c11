"""What starting the ``undolog`` CLI loads.

Every command and every gateway an MCP client starts (``undolog mcp serve`` runs through it) builds the app, so what
no command needs at start-up stays out of it: Rich (loaded by the command that prints a table or a bar, about
35 ms), Alembic (loaded only to migrate) and the MCP SDK (loaded by the ``mcp`` commands). ``undolog mcp connect``,
which an MCP client that opens a session per call starts for every call, does not build the app at all: it loads
neither the store's stack (SQLAlchemy, pydantic) nor Typer. One child process each: this one has them all loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_APP = ("import json, sys\nfrom undolog_core.cli import app\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'alembic', 'mcp'})))\n")

# The console script's own path: ``main()`` with the command line an MCP client's config gives.
_CONNECT = """import json, sys
from undolog_core.cli import main
sys.argv = ["undolog", "mcp", "connect", "--socket", sys.argv[1]]
try:
    main()
except SystemExit as exc:
    status = exc.code
heavy = {"sqlalchemy", "pydantic", "typer", "click", "rich", "alembic", "mcp", "anyio"}
print(json.dumps([status, sorted({m.split('.')[0] for m in sys.modules} & heavy)]))
"""


def test_building_the_app_loads_no_rich_alembic_or_mcp() -> None:
    out = subprocess.run([sys.executable, "-c", _APP], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_mcp_connect_forwards_without_building_the_app(tmp_path: Path) -> None:
    """``undolog mcp connect --socket PATH`` runs from the ``undolog.cli_direct`` entry point: with no gateway on
    ``PATH`` it says so as the app's command does (exit 2, the fix on the same line), having loaded none of the
    app's stack. Before: the whole app, 0.4-0.9 CPU s, at every start."""
    missing = tmp_path / "none.sock"
    out = subprocess.run([sys.executable, "-c", _CONNECT, str(missing)], capture_output=True, text=True, timeout=120,
                         check=True)
    assert json.loads(out.stdout) == [2, []]
    assert out.stderr.splitlines()[0] == (f"error: no gateway is listening on {missing}: start one with "
                                          f"`undolog mcp serve --config gateway.toml --socket {missing}`")


def test_a_direct_command_leaves_what_it_does_not_parse_to_the_app() -> None:
    """``--help`` (and any argument the direct command does not parse) goes to the app: the full help."""
    out = subprocess.run([sys.executable, "-m", "undolog_core.cli", "mcp", "connect", "--help"], capture_output=True,
                         text=True, timeout=120, check=True)
    assert "--socket" in out.stdout and "forwards its MCP messages" in " ".join(out.stdout.split())


def test_importing_the_package_or_its_errors_loads_no_store() -> None:
    """``import undolog_core`` (and ``undolog_core.errors``) imports each public name on first use: a process that
    needs only the errors (the connect command, a client's error handling) does not load SQLAlchemy."""
    child = ("import json, sys, warnings\nwarnings.simplefilter('error')\n"
             "import undolog_core, undolog_core.errors\nfirst = 'sqlalchemy' in sys.modules\n"
             "from undolog_core import UndoLog, ToolTier\n"
             "served = {n: type(getattr(undolog_core, n)).__name__ for n in undolog_core.__all__}\n"
             "print(json.dumps([first, 'sqlalchemy' in sys.modules, UndoLog.__module__, ToolTier.SAFE.value,"
             " sorted(set(undolog_core.__all__) - set(dir(undolog_core))), served]))\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    first, later, home, safe, missing, served = json.loads(out.stdout)
    assert [first, later, home, safe, missing] == [False, True, "undolog_core._undolog", "safe", []]
    # Every name of __all__ is served (no DeprecationWarning: they are not the moved names), modules as modules.
    assert set(served) == set(__import__("undolog_core").__all__)
    assert served["errors"] == served["limits"] == "module" and served["UndoLog"] == "type"
