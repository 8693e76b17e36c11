"""The core stands alone: importing it (and its CLI) pulls in no server or framework dependency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from undolog_core import errors
from undolog_core.webhooks import SIGNATURE_HEADER, sign, verify_signature

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = (
    "fastapi", "starlette", "uvicorn", "jinja2", "httpx", "langgraph", "langchain", "crewai", "semantic_kernel",
)


def test_core_and_its_cli_import_no_server_or_framework_dependency() -> None:
    code = (
        "import json, sys\n"
        "import undolog_core, undolog_core.cli, undolog_core.webhooks\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_webhook_signatures_verify_with_the_core_alone() -> None:
    body = b'{"id":"evt_1"}'
    header = sign("s3cret", 1_767_052_800, body, delivery_id="dl_1")
    assert SIGNATURE_HEADER == "UndoLog-Signature"
    assert verify_signature("s3cret", header, body, delivery_id="dl_1", now=1_767_052_810)
    assert not verify_signature("other", header, body, delivery_id="dl_1", now=1_767_052_810)
    assert not verify_signature("s3cret", header, body + b" ", delivery_id="dl_1", now=1_767_052_810)
    assert not verify_signature("s3cret", header, body, delivery_id="dl_1", now=1_767_052_800 + 301)  # stale
    assert not verify_signature("s3cret", "garbage", body, delivery_id="dl_1")


def test_core_errors_carry_no_http_status() -> None:
    # The HTTP mapping is the server's (undolog_server.problems.ERROR_STATUS), not the core's.
    classes = [errors.UndoLogError, *_subclasses(errors.UndoLogError)]
    assert all("http_status" not in vars(c) for c in classes)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _cli_without(blocked: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``undolog`` CLI in a subprocess where importing ``blocked`` fails, as without the extra."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {blocked!r}:\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from undolog_core.cli import main\n"
        f"sys.argv = ['undolog', *{list(args)!r}]\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def test_serve_without_the_server_extra_says_what_to_install() -> None:
    for blocked in ("uvicorn", "undolog_server"):
        out = _cli_without(blocked, "serve", "--port", "1")
        assert out.returncode == 2, (blocked, out.stdout, out.stderr)
        assert "undolog[server]" in out.stderr, (blocked, out.stderr)
    assert "undolog[server]" in _cli_without("undolog_server", "keys", "list").stderr


@pytest.mark.parametrize("package", ["undolog_server", "undolog_adapters", "undolog_mcp"])
def test_the_cores_clients_use_only_its_public_modules(package: str) -> None:
    """The desk, the adapters and the gateway are clients of the core: they import ``undolog_core`` and its public
    modules (``errors``, ``limits``, ``webhooks``, ``integration``, ``storage`` for the desk's own tables' engine,
    ``testing``), never a private ``undolog_core._x``; the adapters and the gateway not ``storage`` either (what an
    integration needs of the internals is in ``undolog_core.integration``)."""
    import ast

    private: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            private += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if n.startswith("undolog_core.") and (
                            any(p.startswith("_") for p in n.split(".")[1:])
                            or (package != "undolog_server" and n.startswith("undolog_core.storage")))]
    assert private == []
