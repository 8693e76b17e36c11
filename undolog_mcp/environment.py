"""Values gateway.toml takes from the environment: ``${VAR}`` and ``${CONFIG_DIR}`` in an upstream's ``env``, and the
optional ``database`` URL, whose password may only come from there.

A config file is copied, committed and pasted into issues: a secret written in it leaks with it. So a password in
``database`` must be a whole ``${VAR}``; ``${CONFIG_DIR}`` is the config file's folder (an upstream's data beside
it, wherever the gateway is started). Only ``${NAME}`` is expanded; any other ``$`` is left as written.

Example::

    database = "postgresql+psycopg://undolog:${UNDOLOG_DB_PASSWORD}@db.internal/undolog"

    [upstreams.memory]
    command = ["npx", "-y", "@modelcontextprotocol/server-memory"]
    env = { MEMORY_FILE_PATH = "${CONFIG_DIR}/memory.jsonl", API_TOKEN = "${MEMORY_TOKEN}" }
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit

from undolog_core.errors import ConfigurationError

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# scheme://user:password@host...: the password as written (before any expansion).
_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@:]*:(?P<password>[^/?#@]*)@")


def expand(value: str, where: str, base: Path | None, environ: Mapping[str, str] | None = None) -> str:
    """``value`` with each ``${VAR}`` replaced by the environment's value and ``${CONFIG_DIR}`` by the config
    file's folder.

    Raises:
        ConfigurationError: a variable that is not set (naming it and where it is used).

    Example:
        >>> expand("${CONFIG_DIR}/memory.jsonl", "env", Path("/srv/agent"))
        '/srv/agent/memory.jsonl'
    """
    env = os.environ if environ is None else environ

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "CONFIG_DIR":
            if base is None:
                raise ConfigurationError(f"gateway config: {where} uses ${{CONFIG_DIR}}, but the config was not read "
                                         "from a file")
            return str(base)
        if name not in env:
            raise ConfigurationError(f"gateway config: {where} uses ${{{name}}}, which is not set in the "
                                     f"environment; export {name}=... before starting (or write the value)")
        return env[name]

    return _VAR.sub(one, value)


def database_url(raw: object, base: Path | None, environ: Mapping[str, str] | None = None) -> str:
    """The ``database`` URL of gateway.toml, checked and expanded.

    Raises:
        ConfigurationError: not a string, a password written in it (it must be a whole ``${VAR}``), or a variable
            that is not set.

    Example:
        >>> database_url("postgresql+psycopg://u:${PW}@db/undolog", None, {"PW": "p@ss"})
        'postgresql+psycopg://u:p%40ss@db/undolog'
    """
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigurationError("gateway config: database must be a database URL, like "
                                 "\"sqlite:///${CONFIG_DIR}/undolog.db\" or \"postgresql+psycopg://user:${PGPASSWORD}"
                                 "@host/db\"")
    m = _PASSWORD.match(raw)
    written = [m.group("password")] if m else []
    written += [v for k, v in parse_qsl(urlsplit(raw).query) if k.lower() == "password"]
    for password in written:
        if password and not _VAR.fullmatch(password):
            raise ConfigurationError(
                "gateway config: database has a password written in it; a config file is copied and committed, "
                "so the password must come from the environment: write it as ${VAR} (for example "
                "postgresql+psycopg://user:${UNDOLOG_DB_PASSWORD}@host/db) and export UNDOLOG_DB_PASSWORD")
    if m and m.group("password"):
        # The password's value may hold URL characters (@, /, :): quoted in its place, expanded elsewhere as is.
        start, end = m.span("password")
        password = quote(expand(raw[start:end], "database", base, environ), safe="")
        return expand(raw[:start], "database", base, environ) + password + expand(raw[end:], "database", base,
                                                                                   environ)
    return expand(raw, "database", base, environ)
