"""The desk's OpenAPI document stays what clients were promised: a snapshot, compared apart from ordering.

Moving routes between modules (``undolog_server/routers/``) must not change a path, a method, an operation id,
a schema or a status code. Regenerate the snapshot only for a deliberate API change::

    UNDOLOG_SNAPSHOT_WRITE=1 .venv/bin/python -m pytest -q tests/server/test_openapi_snapshot.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from undolog_server import create_app
from undolog_server.state import ServerSettings

from ..support import demo_app

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "openapi_desk.json"


def normalised(node: Any) -> Any:
    """The document with every order that carries no meaning made canonical (keys, parameters, tags)."""
    if isinstance(node, dict):
        return {k: normalised(node[k]) for k in sorted(node)}
    if isinstance(node, list):
        items = [normalised(x) for x in node]
        return sorted(items, key=lambda x: json.dumps(x, sort_keys=True))
    return node


def test_the_openapi_document_matches_its_snapshot(db: Any) -> None:
    undolog = db.open()
    demo_app.register(undolog)
    spec = normalised(create_app(undolog, settings=ServerSettings(background=False)).openapi())
    if os.environ.get("UNDOLOG_SNAPSHOT_WRITE"):
        SNAPSHOT.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
    want = json.loads(SNAPSHOT.read_text())
    assert sorted(spec["paths"]) == sorted(want["paths"])
    for path, ops in want["paths"].items():
        assert spec["paths"][path] == ops, path
    assert sorted(spec["components"]["schemas"]) == sorted(want["components"]["schemas"])
    assert spec == want
