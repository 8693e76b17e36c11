"""The official MCP conformance suite (``@modelcontextprotocol/conformance`` 0.1.16, server mode), run against the
fixture upstream directly and through the gateway with every tool SAFE, then every tool COMPENSABLE.

Everything here is software nobody here wrote, but the fixture: the suite's runner (Node 22, installed by
``npm ci`` from the project's ``package.json``), the SDK's servers and transports, uvicorn, the real gateway
(``undolog mcp serve --http``, a subprocess) on the test's database. The runner sends no Authorization header; a
test-only proxy (``bearer_proxy.py``) adds an agent key in front of the gateway. A missing Node install fails
these tests: nothing skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from undolog_core import EffectState

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
FIXTURE = HERE / "conformance_fixture.py"
PROXY = HERE / "bearer_proxy.py"
NODE = ROOT / "node_modules" / ".bin" / "node"
RUNNER = ROOT / "node_modules" / ".bin" / "conformance"
SUMMARY = re.compile(r"^[✓✗] (?P<name>[\w/-]+): (?P<passed>\d+) passed, (?P<failed>\d+) failed$")
# Every tool the fixture lists but its compensation, which the config leaves unclassified (so not exposed).
FIXTURE_TOOLS = ["test_simple_text", "test_image_content", "test_audio_content", "test_embedded_resource",
                 "test_multiple_content_types", "test_tool_with_logging", "test_error_handling",
                 "test_tool_with_progress", "test_sampling", "test_elicitation", "test_elicitation_sep1034_defaults",
                 "test_elicitation_sep1330_enums", "json_schema_2020_12_tool"]


def run_suite(url: str, out: Path) -> dict[str, tuple[int, int]]:
    """Each scenario of the suite's active set against ``url``: (checks passed, checks failed)."""
    if not NODE.exists() or not RUNNER.exists():
        raise AssertionError(f"the conformance suite is not installed ({NODE} / {RUNNER}): run `npm ci` in {ROOT}")
    done = subprocess.run([str(NODE), str(RUNNER), "server", "--url", url, "-o", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    results = {}
    for line in done.stdout.splitlines():
        m = SUMMARY.match(line.strip())
        if m:
            results[m["name"]] = (int(m["passed"]), int(m["failed"]))
    assert results, f"the runner said no summary:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return results


def failures(results: dict[str, tuple[int, int]], out: Path) -> dict[str, list[str]]:
    """The failed checks' messages, by scenario (read from the runner's output folder)."""
    found: dict[str, list[str]] = {}
    for name, (_, failed) in results.items():
        if not failed:
            continue
        for checks in out.glob(f"server-{name.replace('/', '-')}-*/checks.json"):
            found[name] = [f"{c.get('id')}: {c.get('errorMessage')}" for c in json.loads(checks.read_text())
                           if c.get("status") == "FAILURE"]
    return found


def _url_from(proc: subprocess.Popen[str], marker: str) -> str:
    assert proc.stderr is not None
    for line in proc.stderr:
        if marker in line:
            return line.split(marker, 1)[1].strip()
    raise AssertionError(f"the process exited ({proc.wait()}) before saying {marker!r}")


@contextlib.contextmanager
def started(args: list[str], marker: str, env: dict[str, str] | None = None) -> Iterator[str]:
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield _url_from(proc, marker)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fixture_config(tmp: Path, tier: str) -> Path:
    """A gateway.toml over the fixture (stdio), every tool of it at ``tier``."""
    lines = [f"""
        [upstreams.fixture]
        command = [{json.dumps(sys.executable)}, {json.dumps(str(FIXTURE))}]
        """]
    for tool in FIXTURE_TOOLS:
        lines.append(f"""
        [tools.fixture.{tool}]
        tier = "{tier}"
        """)
        if tier == "compensable":
            lines.append("""compensation = { tool = "undo", args = { key = "{idempotency_key}" } }
        """)
    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent("".join(lines)))
    return cfg


@contextlib.contextmanager
def gateway_behind_proxy(db: Any, tmp: Path, tier: str) -> Iterator[str]:
    """The gateway over HTTP in front of the fixture, and the key-adding proxy in front of it: the proxy's URL."""
    cfg = fixture_config(tmp, tier)
    env = {**os.environ, **db.env}
    made = subprocess.run([sys.executable, "-m", "undolog_core.cli", "keys", "create", "--name", "conformance",
                           "--role", "agent"], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().split()[-1]
    with started([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg), "--http",
                  "--port", "0"], "undolog mcp: serving ", env) as gateway_url, \
            started([sys.executable, str(PROXY), "--target", gateway_url, "--key", key], "proxy: ") as proxy_url:
        yield proxy_url


def direct(tmp: Path) -> dict[str, tuple[int, int]]:
    port = free_port()
    with started([sys.executable, str(FIXTURE), "--http", str(port)], "fixture: ") as url:
        import time

        import httpx

        for _ in range(200):  # the fixture says its URL before uvicorn listens
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        return run_suite(url, tmp / "direct")


def test_the_fixture_passes_every_scenario_directly(tmp_path: Path) -> None:
    results = direct(tmp_path)
    assert len(results) == 30, sorted(results)
    assert not failures(results, tmp_path / "direct"), failures(results, tmp_path / "direct")


# A hang guard: the 30 scenarios through a gateway took 64-67 s on a slow CI host against the suite-wide 120 s.
@pytest.mark.timeout(300)
@pytest.mark.reads_store
@pytest.mark.parametrize("tier", ["safe", "compensable"])
def test_every_scenario_passes_through_the_gateway(db: Any, tmp_path: Path, tier: str) -> None:
    db.open()
    with gateway_behind_proxy(db, tmp_path, tier) as url:
        results = run_suite(url, tmp_path / tier)
    assert len(results) == 30, sorted(results)
    assert not failures(results, tmp_path / tier), failures(results, tmp_path / tier)
    if tier == "compensable":
        # Every call the suite made was logged as the tier says (pre-written, marked), and none is left in flight.
        u = db.open()
        effects = [e for s in u.sessions.list() for e in u.sessions.effects(s.session_id)]
        assert effects and all(e["state"] != EffectState.PENDING for e in effects), effects
