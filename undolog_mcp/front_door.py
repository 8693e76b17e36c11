"""The HTTP gateway's front door: which Host and Origin are served, and how many MCP sessions a key may hold.

Kept apart from ``gateway.py`` so the transport's admission rules read in one place. The Host/Origin check runs
before authentication: a page of another site reached through DNS rebinding learns nothing, not even whether a
key is valid (421 for a Host not served, 403 for a foreign Origin, as the SDK's transport security answers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Loopback names served by default; a port is allowed on each (``host:*``).
LOOPBACK_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "[::1]")
#: Default idle timeout of an MCP session over HTTP (seconds).
DEFAULT_IDLE_SECONDS = 5 * 60
#: Default number of open MCP sessions one key may hold.
DEFAULT_SESSIONS_PER_KEY = 50
#: Default number of open MCP sessions in all.
DEFAULT_MAX_SESSIONS = 1000


@dataclass(frozen=True)
class FrontDoor:
    """What the ``--http`` gateway admits.

    Example:
        >>> door = FrontDoor.loopback(extra_hosts=["gw.internal"])
        >>> door.host_ok("gw.internal:8765"), door.host_ok("evil.example")
        (True, False)
    """

    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]
    idle_seconds: float = DEFAULT_IDLE_SECONDS
    sessions_per_key: int = DEFAULT_SESSIONS_PER_KEY
    max_sessions: int = DEFAULT_MAX_SESSIONS

    @classmethod
    def loopback(cls, extra_hosts: Iterable[str] = (), extra_origins: Iterable[str] = (), **limits: Any) -> FrontDoor:
        """Loopback names (any port) plus what ``--allowed-host`` / ``--allowed-origin`` added."""
        hosts = [*LOOPBACK_HOSTS, *(f"{h}:*" for h in LOOPBACK_HOSTS), *extra_hosts]
        origins = [f"http://{h}:*" for h in LOOPBACK_HOSTS] + [f"http://{h}" for h in LOOPBACK_HOSTS]
        for bad, what in ((limits.get("idle_seconds", 1), "--idle-timeout"),
                          (limits.get("sessions_per_key", 1), "--sessions-per-key"),
                          (limits.get("max_sessions", 1), "--max-sessions")):
            if not bad or bad <= 0:
                raise ValueError(f"{what} must be a positive number; got {bad}")
        return cls(tuple(hosts), tuple([*origins, *extra_origins]), **limits)

    @staticmethod
    def _matches(value: str, allowed: Iterable[str]) -> bool:
        for pattern in allowed:
            if value == pattern or (pattern.endswith(":*") and value.startswith(pattern[:-1])
                                    and value[len(pattern) - 1:].isdigit()):
                return True
        return False

    def host_ok(self, host: str | None) -> bool:
        return bool(host) and self._matches(host or "", self.allowed_hosts)

    def origin_ok(self, origin: str | None) -> bool:
        # A request with no Origin is not from a browser page (same-origin requests of non-browsers send none).
        return not origin or self._matches(origin, self.allowed_origins)

    def refusal(self, headers: Mapping[str, str]) -> tuple[int, str] | None:
        """(status, message) when the request's Host or Origin is not served, else None."""
        if not self.host_ok(headers.get("host")):
            return 421, ("the Host header names no host this gateway serves (DNS rebinding protection): serve it "
                         "with --allowed-host NAME")
        if not self.origin_ok(headers.get("origin")):
            return 403, ("the Origin header names a site this gateway does not serve (DNS rebinding protection): "
                         "allow it with --allowed-origin URL")
        return None


@dataclass
class SessionBook:
    """Which open MCP session belongs to which principal, kept in step with the SDK's own live sessions.

    The SDK ends a session on DELETE, on idle timeout and on a crash; it has no hook to say so, so the book is
    pruned against the manager's live ids before each admission (``prune``): an idle end frees its key's place.
    """

    per_key: int
    owners: dict[str, str] = field(default_factory=dict)

    def prune(self, live: Iterable[str]) -> None:
        alive = set(live)
        for sid in [s for s in self.owners if s not in alive]:
            del self.owners[sid]

    def open_for(self, principal: str) -> int:
        return sum(1 for p in self.owners.values() if p == principal)

    def full_for(self, principal: str) -> bool:
        return self.open_for(principal) >= self.per_key


def live_sessions(manager: Any) -> Iterable[str]:
    """The ids of the sessions the SDK's ``StreamableHTTPSessionManager`` still serves (SDK 1.x keeps them in
    ``_server_instances``; there is no public accessor). Its absence is said at once, not guessed around."""
    instances = getattr(manager, "_server_instances", None)
    if instances is None:
        raise RuntimeError("the MCP SDK's session manager no longer exposes its sessions: pin mcp<2")
    return list(instances)
