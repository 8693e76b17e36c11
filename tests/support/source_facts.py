"""What collection reads from a test module's source (its marks, its database imports), computed once per content.

Every pytest process of a CI run (eight xdist workers, the adapters' runs, the controllers' summaries) parsed every
test module's source again to decide what to import (``tests/conftest.py``) and what opens a store
(``tests/support/store_rule.py``): about 1.3 CPU s per process. The answers depend only on a module's text and on
the code that computes them, so they are kept in a folder under the temporary directory, by the hash of both: the
first process computes them, the others read them; a module or a rule that changes is a new key, never a stale
answer.

Example:
    >>> facts(Path("tests/test_cli.py"), "marks", lambda tree: sorted(...))  # doctest: +SKIP
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FOLDER = Path(tempfile.gettempdir()) / "undolog-test-source-facts"
_TESTS = Path(__file__).resolve().parents[1]
#: The code that computes the facts: part of every key, so a change to a rule is never answered from the cache.
_RULES = hashlib.sha256(b"".join(p.read_bytes() for p in (_TESTS / "conftest.py", _TESTS / "support" / "store_rule.py",
                                                          Path(__file__)))).hexdigest()


def facts(path: Path, kind: str, compute: Callable[[ast.Module], Any]) -> Any:
    """``compute(ast.parse(path))`` (a JSON value), from the cache when this text was already read by a rule."""
    source = path.read_bytes()
    key = hashlib.sha256(f"{_RULES}\0{kind}\0".encode() + source).hexdigest()
    cached = FOLDER / f"{key}.json"
    try:
        return json.loads(cached.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    value = compute(ast.parse(source))
    try:
        FOLDER.mkdir(exist_ok=True)
        # Written whole, then renamed: a process collecting at the same time reads it whole or not at all.
        partial = cached.with_name(f"{cached.name}.{os.getpid()}")
        partial.write_text(json.dumps(value), encoding="utf-8")
        os.replace(partial, cached)
    except OSError:
        pass  # a cache only
    return value
