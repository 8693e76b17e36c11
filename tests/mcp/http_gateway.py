"""The real ``undolog mcp serve --http`` in a subprocess, for the tests of the gateway's front door."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def http_gateway(db: Any, cfg: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start the gateway over HTTP on a free loopback port; yields its ``/mcp`` URL. Its stderr is drained in a
    thread (kept in ``http_gateway.stderr``) so that a chatty gateway never blocks on a full pipe."""
    full_env = {**os.environ, **db.env, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                             "--http", "--port", "0", *extra], env=full_env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    url = None
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "serving http://" in line:
                url = line.split("serving ", 1)[1].strip()
                break
        assert url, "".join(lines)
        stream = proc.stderr
        threading.Thread(target=lambda: lines.extend(stream), daemon=True).start()
        http_gateway.pid = proc.pid  # type: ignore[attr-defined]
        http_gateway.stderr = lines  # type: ignore[attr-defined]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
