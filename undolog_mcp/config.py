"""The gateway's configuration: ``gateway.toml``, read and checked before anything starts.

Example::

    session = "mcp"                                # how calls group into UndoLog sessions: mcp, process or key

    [upstreams.tickets]
    command = ["python", "tickets_server.py"]      # a stdio upstream; or url = "http://127.0.0.1:9000/mcp"

    [tools.tickets.search_tickets]
    tier = "safe"

    [tools.tickets.create_ticket]
    tier = "compensable"
    compensation = { tool = "close_ticket", args = { id = "{result.id}" } }

    [tools.tickets.delete_project]
    tier = "irreversible"
    reason = "Deletes the project and every ticket in it"
    risk_tags = ["data-loss"]

Paths (an upstream's command and working directory) resolve against the folder of the config file, so the
gateway, the CLI and the desk find the same upstreams wherever they are started.
"""

from __future__ import annotations

import enum
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undolog_core import ToolTier
from undolog_core.errors import ConfigurationError

from .environment import database_url, expand
from .templates import CompensationTemplate as CompensationTemplate  # re-exported: it was defined here
from .templates import parse_template
from .variants import pin_plain_tools, pinning

# What an upstream may pass through beside its tools (``expose = [...]``).
EXPOSABLE = ("resources", "prompts", "completion")


class Approval(enum.StrEnum):
    """Where an IRREVERSIBLE call is decided."""

    DESK = "desk"  # the desk, the REST API or the CLI (the default)
    ELICIT = "elicit"  # the MCP client's own form (opt-in; its person is an unverified approver)


class SessionGrouping(enum.StrEnum):
    """Which calls share one UndoLog session (the unit a person approves in, halts and rolls back)."""

    MCP = "mcp"  # one per MCP client session (a client that holds one session open for a whole run)
    PROCESS = "process"  # one per gateway process (per API key over HTTP): every short client connection shares it
    KEY = "key"  # over HTTP, one per API key, ended after ``session_idle`` seconds without a call


class Decline(enum.StrEnum):
    """What a "no" in the client's elicitation form records."""

    RESPOND = "respond"  # the tool did not run, the person's reason is its result, the session goes on (default)
    REJECT = "reject"  # a reject: it halts the session until a person resumes it


@dataclass(frozen=True)
class UpstreamConfig:
    """One upstream MCP server: a command spoken to over stdio, or a streamable-HTTP URL."""

    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 30.0  # seconds a tool call may take before its outcome counts as unknown
    start_timeout: float = 30.0  # seconds to start it and have it answer initialize and tools/list
    # What of the upstream besides its tools the gateway passes through (see passthrough.py): all unless told.
    expose: frozenset[str] = frozenset(EXPOSABLE)

    def describe(self) -> dict[str, Any]:
        """What identifies the upstream in a tool's contract (no environment: it may hold secrets)."""
        return {"command": list(self.command)} if self.command else {"url": self.url}


@dataclass(frozen=True)
class ToolConfig:
    """How one upstream tool is classified; a tool with no entry is not exposed at all."""

    upstream: str
    name: str
    tier: ToolTier
    compensation: CompensationTemplate | None = None
    reason: str | None = None
    risk_tags: tuple[str, ...] = ()
    probe: str | None = None  # a tool of the same upstream that tells whether a call with an unknown outcome happened
    approval: Approval = Approval.DESK
    decline: Decline = Decline.RESPOND  # with approval = "elicit": what the form's "no" records
    # A pinned variant: ``of`` names the upstream tool it calls, ``pin`` the argument values it always sends (hidden
    # from the exposed schema, refused when a client sends them). The plain tool then pins the other value.
    of: str | None = None
    pin: Mapping[str, Any] = field(default_factory=dict)

    @property
    def upstream_tool(self) -> str:
        """The upstream's name of the tool this entry calls (a variant's ``of``, else its own name)."""
        return self.of if self.of is not None else self.name

    @property
    def reason_or_default(self) -> str:
        """The reason shown to approvers.

        The config's, else ``<upstream>/<tool>``. Never the upstream's description, which the upstream may
        change at will: it is not part of the contract an approval is bound to.
        """
        return self.reason if self.reason is not None else f"{self.upstream}/{self.name}"


@dataclass(frozen=True)
class GatewayConfig:
    """``gateway.toml``, parsed. ``path`` is where it was read from (None when built in code)."""

    upstreams: Mapping[str, UpstreamConfig]
    tools: Mapping[tuple[str, str], ToolConfig]
    path: Path | None = None
    session: SessionGrouping = SessionGrouping.MCP
    session_idle: float = 1800.0  # with session = "key": seconds without a call that end the key's session
    # The UndoLog database the gateway and ``undolog --app gateway.toml`` use when no --db is given.
    database: str | None = None

    def tools_of(self, upstream: str) -> dict[str, ToolConfig]:
        """The classified tools of one upstream, by their upstream name."""
        return {name: cfg for (up, name), cfg in self.tools.items() if up == upstream}


def load_config(source: str | Path | Mapping[str, Any]) -> GatewayConfig:
    """Read and check a gateway config (a TOML file, or its already parsed mapping).

    Raises:
        ConfigurationError: naming the key that is wrong.

    Example:
        >>> cfg = load_config("gateway.toml")
        >>> sorted(cfg.upstreams)
        ['tickets']
    """
    base: Path | None = None
    path: Path | None = None
    if isinstance(source, Mapping):
        data: Mapping[str, Any] = source
    else:
        path = Path(source).expanduser().resolve()
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigurationError(f"gateway config {str(source)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"gateway config {str(source)!r} is not valid TOML: {exc}") from None
        base = path.parent
    unknown = set(data) - {"upstreams", "tools", *_TOP_KEYS}
    if unknown:
        raise ConfigurationError(f"gateway config: unknown section(s) {', '.join(sorted(unknown))} "
                                 "(expected session = \"...\", database = \"...\", [upstreams.NAME] and "
                                 "[tools.UPSTREAM.TOOL])")
    grouping, idle = _grouping(data)
    database = database_url(data["database"], base) if "database" in data else None
    upstreams = {name: _upstream(name, raw, base) for name, raw in _table(data, "upstreams").items()}
    if not upstreams:
        raise ConfigurationError("gateway config: no [upstreams.NAME] section; the gateway needs at least one")
    tools: dict[tuple[str, str], ToolConfig] = {}
    for up, table in _table(data, "tools").items():
        if up not in upstreams:
            raise ConfigurationError(f"gateway config: [tools.{up}] names no upstream (known: "
                                     f"{', '.join(sorted(upstreams))})")
        if not isinstance(table, Mapping):
            raise ConfigurationError(f"gateway config: [tools.{up}] must be a table of tools")
        for name, raw in table.items():
            tools[(up, name)] = _tool(up, name, raw)
    return GatewayConfig(upstreams, pin_plain_tools(tools), path, grouping, idle, database)


_TOP_KEYS = ("session", "session_idle", "database")


def _grouping(data: Mapping[str, Any]) -> tuple[SessionGrouping, float]:
    """The top-level ``session`` and ``session_idle`` keys."""
    try:
        grouping = SessionGrouping(str(data.get("session", "mcp")))
    except ValueError:
        raise ConfigurationError(
            f"gateway config: session = {data.get('session')!r} is not a grouping; use \"mcp\" (one UndoLog session "
            "per MCP session), \"process\" (one per gateway process) or \"key\" (over HTTP, one per API key)"
        ) from None
    idle = data.get("session_idle", 1800.0)
    if isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 < idle < float("inf"):
        raise ConfigurationError("gateway config: session_idle must be a positive number of seconds")
    if "session_idle" in data and grouping is not SessionGrouping.KEY:
        raise ConfigurationError("gateway config: session_idle is for session = \"key\" only; remove it, or set "
                                 "session = \"key\"")
    return grouping, float(idle)


def database_of(path: str | Path) -> str | None:
    """The ``database`` a gateway config names (expanded), or None.

    What ``undolog --app gateway.toml`` opens when no --db is given. Reads only that key, so the CLI does not
    start the upstreams to find its database.

    Raises:
        ConfigurationError: an unreadable file, or a ``database`` that is refused (see ``environment``).
    """
    resolved = Path(path).expanduser().resolve()
    try:
        with open(resolved, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigurationError(f"gateway config {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"gateway config {str(path)!r} is not valid TOML: {exc}") from None
    return database_url(data["database"], resolved.parent) if "database" in data else None


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"gateway config: [{key}] must be a table")
    return value


def _upstream(name: str, raw: Any, base: Path | None) -> UpstreamConfig:
    where = f"[upstreams.{name}]"
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"gateway config: {where} must be a table")
    unknown = set(raw) - {"command", "url", "cwd", "env", "timeout", "start_timeout", "expose"}
    if unknown:
        raise ConfigurationError(f"gateway config: {where} has unknown key(s) {', '.join(sorted(unknown))}")
    command, url = raw.get("command"), raw.get("url")
    if (command is None) == (url is None):
        raise ConfigurationError(f"gateway config: {where} needs exactly one of command = [...] or url = \"...\"")
    cmd: tuple[str, ...] = ()
    if command is not None:
        if isinstance(command, str):
            command = [command]
        if not command or not all(isinstance(c, str) and c for c in command):
            raise ConfigurationError(f"gateway config: {where} command must be a non-empty list of strings")
        cmd = tuple(_resolve_arg(c, base) for c in command)
    if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise ConfigurationError(f"gateway config: {where} url must be an http(s) URL, got {url!r}")
    cwd_raw = raw.get("cwd")
    cwd = None
    if cwd_raw is not None:
        cwd = Path(str(cwd_raw)).expanduser()
        if not cwd.is_absolute() and base is not None:
            cwd = base / cwd
    elif base is not None:
        cwd = base
    env = raw.get("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
        raise ConfigurationError(f"gateway config: {where} env must be a table of strings")
    env = {k: expand(v, f"{where} env.{k}", base) for k, v in env.items()}
    bounds = {}
    for key in ("timeout", "start_timeout"):
        value = raw.get(key, 30.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            raise ConfigurationError(f"gateway config: {where} {key} must be a positive number of seconds")
        bounds[key] = float(value)
    expose = raw.get("expose", list(EXPOSABLE))
    if not isinstance(expose, list) or not all(isinstance(e, str) and e in EXPOSABLE for e in expose):
        raise ConfigurationError(f"gateway config: {where} expose must be a list of {', '.join(map(repr, EXPOSABLE))} "
                                 f"(got {expose!r}); write expose = [] to pass through tools alone")
    return UpstreamConfig(name, cmd, url, cwd, dict(env), bounds["timeout"], bounds["start_timeout"],
                          frozenset(expose))


def _resolve_arg(arg: str, base: Path | None) -> str:
    """A relative path that exists beside the config file becomes absolute; anything else is left as written."""
    if base is None or arg.startswith("-") or Path(arg).is_absolute():
        return arg
    candidate = base / arg
    return str(candidate) if candidate.exists() else arg


def _tool(up: str, name: str, raw: Any) -> ToolConfig:
    where = f"[tools.{up}.{name}]"
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"gateway config: {where} must be a table")
    unknown = set(raw) - {"tier", "compensation", "capture", "reason", "risk_tags", "probe", "approval", "decline",
                          "of", "pin"}
    if unknown:
        raise ConfigurationError(f"gateway config: {where} has unknown key(s) {', '.join(sorted(unknown))}")
    try:
        tier = ToolTier(str(raw.get("tier", "")).lower())
    except ValueError:
        raise ConfigurationError(f"gateway config: {where} tier must be safe, compensable or irreversible") from None
    comp = None
    raw_comp = raw.get("compensation")
    if tier is ToolTier.COMPENSABLE:
        comp = parse_template(where, raw_comp, raw.get("capture"))
    elif raw_comp is not None or raw.get("capture") is not None:
        raise ConfigurationError(f"gateway config: {where} is {tier.value}: only a compensable tool has a "
                                 "compensation (and a capture)")
    risk_tags = raw.get("risk_tags", [])
    if not isinstance(risk_tags, list) or not all(isinstance(t, str) for t in risk_tags):
        raise ConfigurationError(f"gateway config: {where} risk_tags must be a list of strings")
    try:
        approval = Approval(str(raw.get("approval", "desk")))
    except ValueError:
        raise ConfigurationError(f"gateway config: {where} approval must be \"desk\" or \"elicit\"") from None
    if approval is Approval.ELICIT and tier is not ToolTier.IRREVERSIBLE:
        raise ConfigurationError(f"gateway config: {where} approval = \"elicit\" is for irreversible tools only")
    try:
        decline = Decline(str(raw.get("decline", "respond")))
    except ValueError:
        raise ConfigurationError(f"gateway config: {where} decline must be \"respond\" or \"reject\"") from None
    if "decline" in raw and approval is not Approval.ELICIT:
        raise ConfigurationError(f"gateway config: {where} decline is for approval = \"elicit\" tools only (it says "
                                 "what the client's form records when its person says no)")
    probe = raw.get("probe")
    if probe is not None and not isinstance(probe, str):
        raise ConfigurationError(f"gateway config: {where} probe must name a tool of the same upstream")
    reason = raw.get("reason")
    of, pin = pinning(where, raw)
    return ToolConfig(up, name, tier, comp, str(reason) if reason is not None else None, tuple(risk_tags), probe,
                      approval, decline, of, pin)
