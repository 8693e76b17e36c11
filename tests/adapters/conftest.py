"""Adapter-test setup that must happen before any framework is imported.

CrewAI writes under ``$HOME`` on import and per kickoff, checks PyPI, sends telemetry and may prompt
on first run; these variables keep it offline and quiet. HOME is swapped only while CrewAI is
imported here (once per test process, ~6 s), so the rest of the suite keeps the real HOME; the
kickoff database goes under XDG_DATA_HOME, which stays pointed at a temporary directory.
"""

from __future__ import annotations

import os
import tempfile

_TMP = tempfile.mkdtemp(prefix="undolog-adapter-tests-")

for _key, _value in {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TESTING": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "CREWAI_DISABLE_VERSION_CHECK": "true",
}.items():
    os.environ[_key] = _value
os.environ["XDG_DATA_HOME"] = os.path.join(_TMP, "data")

_real_home = os.environ.get("HOME")
os.environ["HOME"] = os.path.join(_TMP, "home")
try:
    import crewai  # noqa: F401,E402
    import crewai.hooks  # noqa: F401,E402
finally:
    if _real_home is None:
        os.environ.pop("HOME", None)
    else:
        os.environ["HOME"] = _real_home
