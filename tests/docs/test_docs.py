"""The docs stay true: every block runs or says why not, the site builds strictly, and five answers are easy to find.

A fenced block in ``docs/`` is one of:

- a ```python block: run, in order, in one namespace per page, in a fresh folder (top-level ``await`` allowed);
- a ```python title="file.py" block: written to that file of the page's folder (the page's shell runs it);
- a ```bash block of a tutorial: run, all of the page's in order as one script, with this venv's ``bin`` first on
  ``PATH``, as a reader following the tutorial literally would;
- any block after ``<!-- norun: REASON -->`` (not run; the reason says why) or ``<!-- runs-in: tests/PATH -->``
  (run by that test, which must name the page).

Any other block (a non-tutorial shell block, output, JSON, TOML) must carry one of the two markers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
TUTORIALS = [p for p in PAGES if p.startswith("tutorials/")]

_FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
_MARK = re.compile(r"<!--\s*(norun|runs-in):\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    title: str | None
    code: str
    marker: tuple[str, str] | None


def blocks(page: str) -> list[Block]:
    text = (ROOT / page if page == "README.md" else DOCS / page).read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        title = re.search(r'title="([^"]+)"', m.group(2))
        out.append(Block(page, text[: m.start()].count("\n") + 1, m.group(1), title.group(1) if title else None,
                         m.group(3), (mark.group(1), mark.group(2)) if mark else None))
    return out


# --- every block runs or says why ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", [*PAGES, "README.md"])
def test_every_block_runs_or_says_why(page: str) -> None:
    for b in blocks(page):
        where = f"{page}:{b.line} ({b.lang or 'no language'})"
        if b.marker:
            kind, value = b.marker
            assert value, f"{where}: a {kind} marker needs a reason or a test path"
            if kind == "runs-in":
                path = ROOT / value.split("::")[0]
                assert path.is_file(), f"{where}: runs-in names {value}, which does not exist"
                assert Path(page).name in path.read_text(), f"{where}: {value} does not name {page}"
            continue
        runs = b.lang == "python" or (b.lang == "bash" and page in TUTORIALS)
        assert runs, f"{where}: this block is never run; run it, or mark it <!-- norun: why --> / <!-- runs-in: test -->"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _page_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNDOLOG_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(tmp_path)
    return env


@pytest.mark.parametrize("page", TUTORIALS)
def test_tutorial_followed_literally(page: str, tmp_path: Path) -> None:
    """The tutorial's files written as shown, then its shell blocks run in order, in a fresh folder."""
    page_blocks = [b for b in blocks(page) if not b.marker]
    shell = []
    for b in page_blocks:
        if b.title:
            (tmp_path / b.title).write_text(b.code)
        elif b.lang == "bash":
            shell.append(b.code)
        elif b.lang == "python":
            pytest.fail(f"{page}:{b.line}: a tutorial's Python is a file the reader saves (title=...)")
    assert shell, f"{page} has no shell block to follow"
    # The desk's port is the page's; another run of the suite (the other database's) may hold it at the same time.
    script = "\n".join(shell).replace("8437", str(_free_port()))
    # Whatever the script left in the background (the desk) is stopped by its process group, never by name.
    wrapped = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    out = subprocess.run(["bash", "-c", wrapped], cwd=tmp_path, env=_page_env(tmp_path), capture_output=True,
                         text=True, timeout=300, start_new_session=True)
    assert out.returncode == 0, f"{page} failed:\n{out.stdout}\n{out.stderr}"
    # The output a page shows (a text block marked as run here) is what the steps printed, ids aside.
    def masked(text: str) -> str:
        return re.sub(r"\b[0-9a-f]{32}\b", "<id>", text).strip()

    for b in blocks(page):
        if b.marker == ("runs-in", "tests/docs/test_docs.py"):
            assert masked(b.code) in masked(out.stdout), f"{page}:{b.line}: the page shows\n{b.code}\nbut the steps printed\n{out.stdout}"
    if page == "tutorials/first-agent.md":
        assert "rolled back: ['compensated', 'compensated']" in out.stdout
        assert "queued after the rollback: ['m-1']" in out.stdout
        assert "audit chain intact" in out.stdout
    if page == "tutorials/first-approval.md":
        ran = [line for line in out.stdout.splitlines() if line.startswith("ran: ")]
        assert ran == ["ran: {'user_id': 'u-1042', 'status': 'deleted'}"] * 2, out.stdout
        assert '"decided_by":"ana (key ' in out.stdout


PYTHON_PAGES = [p for p in [*PAGES, "README.md"] if p not in TUTORIALS and any(b.lang == "python" and not b.marker for b in blocks(p))]


#: Runs a page's blocks in a process of its own (a block may call ``asyncio.run`` or set process-wide state, as a
#: reader's script would): each block compiled with top-level ``await`` allowed, in one namespace, in order.
_RUNNER = """
import ast, asyncio, inspect, json, sys
ns = {"__name__": "__main__"}
for name, code in json.load(open(sys.argv[1])):
    result = eval(compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), ns)
    if inspect.iscoroutine(result):
        asyncio.run(result)
for value in ns.values():
    if type(value).__name__ == "UndoLog":
        value.close()
"""


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page: str, tmp_path: Path) -> None:
    """A page's unmarked Python blocks, in order, in one namespace, in a fresh folder and process."""
    todo = []
    for b in blocks(page):
        if b.marker or b.lang != "python":
            continue
        if b.title:
            (tmp_path / b.title).write_text(b.code)
        else:
            todo.append((f"{page}:{b.line}", b.code))
    (tmp_path / "blocks.json").write_text(json.dumps(todo))
    out = subprocess.run([sys.executable, "-c", _RUNNER, "blocks.json"], cwd=tmp_path, env=_page_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{page}: a block failed:\n{out.stdout}\n{out.stderr}"


def test_the_readme_is_short_and_links_into_the_site() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "the README is at most 250 lines: move the rest into docs/"
    [quickstart] = [b for b in blocks("README.md") if b.lang == "python"]
    assert len(quickstart.code.splitlines()) <= 40
    assert "pip install -e '.[docs]' && mkdocs serve" in text and "bash .ci/run" in text
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= len(PAGES) - 1, "the README links into every page of the site"
    for link in links:
        assert (ROOT / link).is_file(), f"the README links {link}, which does not exist"


# --- the site ----------------------------------------------------------------------------------------------

#: The five answers a newcomer must find: (words the page's title holds, its page).
FIVE = [
    (("gating", "langchain tool"), "how-to/langgraph.md"),
    (("migrating", "humanintheloopmiddleware"), "how-to/migrating-from-hitl.md"),
    (("error code", "means"), "reference/errors.md"),
    (("desk", "postgresql"), "how-to/postgresql.md"),
    (("checking", "compensation"), "how-to/compensations.md"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once per run: xdist workers share it (a build is about 5 CPU s, and each worker that got one of
    this module's tests built its own), the first to ask builds it under a lock, the others wait and read it."""
    import fcntl

    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (the dev extra includes it)")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder, above each worker's
    out, done = shared / "docs-site", shared / "docs-site.built"
    with open(shared / "docs-site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=600,
                                 env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
            assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
            done.touch()
    return out


def _nav() -> list[Any]:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]  # noqa: S506 - SafeLoader subclass


def _nav_pages(nav: list[Any], depth: int = 1) -> list[tuple[str, str, int]]:
    out = []
    for entry in nav:
        for title, value in entry.items():
            if isinstance(value, list):
                out += _nav_pages(value, depth + 1)
            else:
                out.append((title, value, depth))
    return out


def test_the_site_builds_strictly_and_the_five_answers_are_two_clicks_from_home(site: Path) -> None:
    pages = {path: (title, depth) for title, path, depth in _nav_pages(_nav())}
    assert set(pages) == set(PAGES), f"pages not in the nav: {set(PAGES) - set(pages)}; missing: {set(pages) - set(PAGES)}"
    index = json.loads((site / "search" / "search_index.json").read_text())
    titles = {d["location"]: d["title"] for d in index["docs"] if "#" not in d["location"]}
    home = (site / "index.html").read_text()
    for words, path in FIVE:
        nav_title, depth = pages[path]
        # Home -> its section (a tab) -> the page: two clicks at most; the home page links it directly too.
        assert depth <= 2, f"{path} is {depth} levels deep in the nav"
        url = path.removesuffix(".md") + "/"
        assert f'href="{url}"' in home, f"the home page does not link {path}"
        for title in (nav_title, titles[url]):
            assert all(w in title.lower() for w in words), f"{path}: title {title!r} does not say {words}"


def test_generated_reference_is_on_the_built_pages(site: Path) -> None:
    from undolog_core.errors import ApprovalRejected, SessionHalted

    errors_page = (site / "reference" / "errors" / "index.html").read_text()
    for cls in (SessionHalted, ApprovalRejected):
        assert f'id="{cls.code}"' in errors_page
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    assert "undolog approvals approve" in cli_page and "undolog mcp serve" in cli_page
    rest = (site / "reference" / "rest-api" / "index.html").read_text()
    assert "/v1/approvals/{approval_request_id}:approve" in rest
    api = (site / "reference" / "python-api" / "index.html").read_text()
    assert 'id="undolog_core.UndoLog"' in api and 'id="undolog_core.undolog_tool"' in api


def test_every_error_code_says_what_it_means_and_how_to_fix_it() -> None:
    from tools.docs_reference import _meaning_and_fix, error_classes

    for cls in error_classes():
        meaning, fix = _meaning_and_fix(cls)
        assert meaning and fix, f"{cls.__name__}: its docstring needs a meaning and a 'Fix:' section (docs/reference/errors.md)"


def test_every_environment_variable_is_on_the_configuration_page() -> None:
    from tools.docs_reference import environment_variables

    page = (DOCS / "reference" / "configuration.md").read_text()
    missing = [name for name in environment_variables() if name not in page]
    assert not missing, f"reference/configuration.md does not explain {missing}"


def test_every_state_is_on_the_states_page() -> None:
    from undolog_core import EffectState, RequestState, SessionState, UndoState

    page = (DOCS / "reference" / "states.md").read_text()
    for enum in (SessionState, EffectState, RequestState, UndoState):
        missing = [s.value for s in enum if f"`{s.value}`" not in page]
        assert not missing, f"reference/states.md does not explain {enum.__name__} {missing}"


def test_user_docs_hold_no_dated_run_or_stop_narrative() -> None:
    user_docs = [ROOT / "README.md", *(DOCS / p for p in PAGES), ROOT / "benchmarks" / "README.md"]
    for path in user_docs:
        text = path.read_text()
        assert not re.search(r"\b[Ss]tops? \d+\b", text), f"{path}: a 'stop N' narrative belongs in CHANGELOG.md"
        assert not re.search(r"load average", text), f"{path}: a dated run belongs under benchmarks/results/"
        # Prose only: a code block may show a timestamp as an example value.
        prose = _FENCE.sub("", text)
        if path.name != "README.md" or path.parent.name != "benchmarks":  # it lists the dated runs by file name
            dated = re.search(r"\b20\d\d-\d\d-\d\d\b", prose)
            assert not dated, f"{path}: {dated.group(0) if dated else ''}: a dated run belongs under benchmarks/results/"
        history = re.search(r"[Bb]efore this (work|change|fix|release)|[Uu]ntil this release|first draft|[Uu]ntil now\b",
                            prose)
        assert not history, f"{path}: {history.group(0) if history else ''}: history belongs in CHANGELOG.md"


def test_the_built_site_loads_nothing_from_elsewhere(site: Path) -> None:
    """Every script, stylesheet, font and image a built page loads is a file of the site (it works offline)."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    external = re.compile(r"""<(?:script|img|iframe)\b[^>]*\bsrc=["']?(?:https?:)?//|<link\b[^>]*\bhref=["']?(?:https?:)?//""")
    for page in pages:
        html = page.read_text()
        for m in external.finditer(html):
            tag = html[m.start(): html.index(">", m.start()) + 1]
            # A link to another site (rel="...") is not loaded; a stylesheet, preload or icon would be.
            if tag.startswith("<link") and not re.search(r'rel="(stylesheet|preload|preconnect|icon|modulepreload)"', tag):
                continue
            pytest.fail(f"{page.relative_to(site)} loads {tag} from elsewhere")
        for src in re.findall(r"""<script\b[^>]*\bsrc=["']([^"']+)""", html):
            # 404.html names its files from the site's root (it is served at any depth); the others relatively.
            local = site / src.lstrip("/") if src.startswith("/") else page.parent / src
            assert Path(str(local).split("?")[0]).resolve().is_file(), (
                f"{page.relative_to(site)}: {src} is not in the site")
    # The state diagrams are drawn by the copy of Mermaid the site serves, so the theme never fetches its CDN's.
    states = (site / "reference" / "states" / "index.html").read_text()
    assert 'class="mermaid"' in states and "assets/javascripts/mermaid.min.js" in states
    assert states.index("mermaid.min.js") < states.index("assets/javascripts/bundle.")
    assert "fonts.googleapis" not in (site / "index.html").read_text()
