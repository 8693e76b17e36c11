"""The README's set-up and both tutorials, followed literally on a fresh clone, install included.

``git clone`` of this repository into an empty folder, then, in the clone and in order: the README's "Set up"
and "Install" commands (a venv, ``pip install -e .``, then ``pip install -e '.[langgraph,server]'`` and
``undolog demo``), then each tutorial from its first
block (its own install into that venv, ``source .venv/bin/activate``) to its last, with the files it says to save
saved in the clone. Nothing of this test's own environment is used: not its venv, not its ``PATH`` entry for it,
not its ``UNDOLOG_*`` variables. The README's other set-up command, ``bash .ci/run``, is CI itself.

``tests/docs/test_docs.py::test_tutorial_followed_literally`` runs the same tutorials faster, in a fresh folder
with this venv; this test is what a newcomer does first. It installs packages (from the configured index), so it
takes a minute or two.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_docs import ROOT, _free_port, blocks

TUTORIALS = ["tutorials/first-agent.md", "tutorials/first-approval.md"]

# Two pip installs into a new venv: `.ci/run` runs this in its own step (`--kind install`), timed apart.
pytestmark = pytest.mark.install


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("fresh") / "undolog"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True, timeout=300)
    return where


def _env(home: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNDOLOG_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["HOME"] = str(home)
    return env


def _run(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    wrapped = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    return subprocess.run(["bash", "-c", wrapped], cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
                          start_new_session=True)


def _readme(section: str) -> str:
    """The README's shell block under ``## SECTION`` that installs."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    [found] = [b for b in blocks("README.md") if b.lang == "bash" and b.code.strip() in body and "pip install" in b.code]
    assert found.marker == ("runs-in", "tests/docs/test_fresh_clone.py"), found
    return found.code


# Two installs into a fresh venv: minutes on a loaded machine (a hang guard, not a measure).
@pytest.mark.timeout(1800)
def test_readme_setup_then_each_tutorial_on_a_fresh_clone(clone: Path, tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = _run(_readme("Install"), clone, env)
    assert out.returncode == 0, f"README install failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    out = _run(_readme("Set up"), clone, env)
    assert out.returncode == 0, f"README set-up failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "UndoLog demo" in out.stdout and "rolled_back" in out.stdout, out.stdout[-3000:]
    assert (clone / ".venv" / "bin" / "undolog").exists()

    for page in TUTORIALS:
        page_blocks = [b for b in blocks(page) if not (b.marker and b.marker[0] == "norun")]
        install = page_blocks[0]
        assert install.lang == "bash" and "pip install" in install.code
        assert install.marker == ("runs-in", "tests/docs/test_fresh_clone.py"), f"{page}: mark its install block"
        shell = []
        for b in page_blocks:
            if b.title:
                (clone / b.title).write_text(b.code)
            elif b.lang == "bash":
                shell.append(b.code)
        script = "\n".join(shell).replace("8437", str(_free_port()))
        out = _run(script, clone, env)
        assert out.returncode == 0, f"{page} failed on a fresh clone:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        if page == "tutorials/first-agent.md":
            assert "rolled back: ['compensated', 'compensated']" in out.stdout
        else:
            assert re.search(r"^ran: \{'user_id': 'u-1042', 'status': 'deleted'\}$", out.stdout, re.M)
        for leftover in ("undolog.db",):
            (clone / leftover).unlink(missing_ok=True)  # each tutorial starts from an empty database
