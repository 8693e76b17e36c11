"""CI's steps keep the framework imports in one process.

``.ci/run`` runs the framework tests (``FRAMEWORK_TESTS``: ``tests/adapters`` and the few modules elsewhere that
import LangChain, LangGraph, CrewAI or Semantic Kernel when imported) in the adapters' single process, and keeps
them out of the xdist steps: every xdist worker imports every module it collects, and a framework costs each worker
seconds of CPU on a CPU-bound machine. A new test module that imports a framework at import time, outside that list,
would quietly put those seconds back into every worker; this test names it instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Packages whose import costs seconds of CPU (and the adapters, which import them).
FRAMEWORKS = ("langchain", "langchain_core", "langchain_mcp_adapters", "langgraph", "crewai", "semantic_kernel",
              "undolog_adapters")


def _framework_tests() -> list[str]:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    found = re.search(r"^FRAMEWORK_TESTS=\(([^)]*)\)", text, re.MULTILINE)
    assert found, ".ci/run no longer defines FRAMEWORK_TESTS=(...): update tests/test_ci_steps.py with it"
    return found.group(1).split()


def _top_level_imports(path: Path) -> set[str]:
    """Modules a file imports when it is imported (module level, outside functions and TYPE_CHECKING blocks)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-node.level])
            names.add(f"{base}.{node.module}" if node.module else base)
    return names


def _imports_a_framework(path: Path, seen: set[Path] | None = None) -> str | None:
    """The framework a module imports when imported, directly or through a ``tests.`` module it imports."""
    seen = set() if seen is None else seen
    seen.add(path)
    for name in sorted(_top_level_imports(path)):
        if name.split(".")[0] in FRAMEWORKS:
            return name
        if name.startswith("tests."):
            target = ROOT.joinpath(*name.split("."))
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if candidate.is_file() and candidate not in seen:
                    via = _imports_a_framework(candidate, seen)
                    if via:
                        return f"{via} (through {name})"
    return None


def test_every_module_that_imports_a_framework_runs_in_the_adapters_step() -> None:
    listed = [ROOT / p for p in _framework_tests()]
    for path in listed:
        assert path.exists(), f".ci/run FRAMEWORK_TESTS names {path.relative_to(ROOT)}, which does not exist"
    outside = []
    for module in sorted((ROOT / "tests").rglob("test_*.py")):
        if any(module == p or p in module.parents for p in listed):
            continue
        framework = _imports_a_framework(module)
        if framework:
            outside.append(f"{module.relative_to(ROOT)} imports {framework}")
    assert not outside, (
        "test modules import a framework at import time but run in the xdist steps; add each to FRAMEWORK_TESTS in "
        ".ci/run (or import the framework inside the test):\n  " + "\n  ".join(outside))


def test_the_check_finds_a_framework_imported_through_a_support_module() -> None:
    # tests/support/lg_hooks.py imports LangChain when imported: a module importing it imports LangChain too.
    assert _imports_a_framework(ROOT / "tests" / "support" / "lg_hooks.py")
    assert _imports_a_framework(ROOT / "tests" / "test_cli.py") is None
