"""The per-content cache of what collection reads from test modules' source (tests/support/source_facts.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from tests.support import source_facts


def _names(tree: ast.Module) -> list[str]:
    return sorted(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))


def test_a_second_read_is_the_cached_answer_and_an_edit_is_read_again(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_facts, "FOLDER", tmp_path / "facts")
    module = tmp_path / "test_x.py"
    module.write_text("a = b\n")
    parsed: list[Any] = []

    def counting(tree: ast.Module) -> list[str]:
        parsed.append(tree)
        return _names(tree)

    assert source_facts.facts(module, "names", counting) == ["a", "b"]
    assert source_facts.facts(module, "names", counting) == ["a", "b"]
    assert len(parsed) == 1  # the second answer came from the cache
    module.write_text("c = d\n")
    assert source_facts.facts(module, "names", counting) == ["c", "d"]  # new text, new key: never a stale answer
    assert source_facts.facts(module, "other", counting) == ["c", "d"] and len(parsed) == 3  # kinds kept apart


def test_an_unwritable_cache_still_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(source_facts, "FOLDER", blocker / "facts")  # under a file: cannot be made
    module = tmp_path / "test_y.py"
    module.write_text("e = f\n")
    assert source_facts.facts(module, "names", _names) == ["e", "f"]
