"""Signed webhooks fed from the core's outbox, with retries, a delivery log and escalation.

The engine only writes outbox rows in its own transactions; everything here runs in
the server's background loops, so a slow or dead receiver can delay notifications but
never an approval, a call or a rollback.

Signing and verifying live in :mod:`undolog_core.webhooks` (stdlib only, so receivers need not
install the server); they are re-exported here.

Signature: ``UndoLog-Signature: t=<unix seconds>,v2=<hex HMAC-SHA256(secret, "<t>.<delivery id>." + body)>``.

Slow and hostile receivers: each attempt has one total deadline (``webhook_timeout``, name resolution,
connect, sending and the response headers together; the response body is never read), each target has
its own ceiling of concurrent sends (``webhook_per_target``) besides the process's (``webhook_max_inflight``),
and a claimed delivery is leased for ``webhook_lease`` seconds, longer than the deadline, so no server
sends it again while it is still in flight.

Target policy: a target's host must resolve to public addresses only, unless the admin opts in with
``webhook_allow_private``. It is checked when the target is registered and again at every send, after
resolution, and the request goes to the address that was checked (a DNS answer that changes between the
check and the connect cannot redirect it). The delivery log's error text is generic, so the log is no
oracle for probing which hosts and ports answer.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import ipaddress
import json
import logging
import random
import socket
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from undolog_core.records import OutboxEvent
from undolog_core.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, sign, verify_signature

from .storage import NotificationPolicy, WebhookTarget, utcnow

if TYPE_CHECKING:
    from .state import ServerState

__all__ = [
    "DELIVERY_HEADER",
    "EVENT_TYPES",
    "SIGNATURE_HEADER",
    "DeliveryError",
    "TargetRefused",
    "WebhookDispatcher",
    "address_allowed",
    "check_target",
    "parse_target_url",
    "route",
    "sign",
    "verify_signature",
]

log = logging.getLogger("undolog.server.webhooks")

#: Name lookups of webhook sends (see ``_pin``).
_RESOLVER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="undolog-webhook-dns")

EVENT_TYPES = (
    "approval.requested",
    "approval.decided",
    "approval.timed_out",
    "approval.expired",
    "approval.escalated",
    "session.halted",
    "session.rolled_back",
    "audit.checkpoint",
)

#: Sent only to targets that name it in their ``event_types`` (not to ``*``): it comes every interval.
CHECKPOINT_EVENT = "audit.checkpoint"


class DeliveryError(enum.StrEnum):
    """What the delivery log says about a failed attempt: deliberately coarse (the details go to the server log).

    Distinguishing "connection refused" from "timed out" or "TLS error" would let an admin key map which
    hosts and ports answer from inside the server's network.
    """

    NO_RESPONSE = "no response"
    BAD_STATUS = "receiver answered with a non-2xx status"
    ADDRESS_REFUSED = "target address not allowed"
    INVALID_URL = "invalid target url"
    TARGET_REMOVED = "target removed"


class TargetRefused(ValueError):
    """A webhook target URL that is malformed or points where the target policy forbids.

    Attributes:
        code: ``invalid_webhook_url`` or ``webhook_target_refused``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TargetURL:
    """A parsed, checked webhook URL: scheme, host (IP literals without brackets) and port."""

    url: str
    scheme: str
    host: str
    port: int


def parse_target_url(url: str) -> TargetURL:
    """Check a target URL's syntax: ``http``/``https``, a host, a valid port, no credentials, no whitespace.

    Raises:
        TargetRefused: With code ``invalid_webhook_url`` and what is wrong.

    Example:
        >>> parse_target_url("https://hooks.example.com/undolog").port
        443
    """

    def bad(why: str) -> TargetRefused:
        return TargetRefused("invalid_webhook_url", f"invalid webhook url {url!r}: {why}")

    if not isinstance(url, str) or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise bad("it contains whitespace or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        # httpx must read it the same way, or a send would fail forever on a URL accepted here.
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise bad(str(exc)) from None
    if parts.scheme not in ("http", "https"):
        raise bad("the scheme must be http or https")
    host = parts.hostname
    if not host:
        raise bad("it names no host")
    if parts.username is not None or parts.password is not None:
        raise bad("credentials in the url are not allowed (they would be shown to every admin); use the secret")
    if not host.isascii() or not all(c.isalnum() or c in ".-:_" for c in host):
        raise bad("the host must be an ASCII name (punycode for IDNs) or an IP literal")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad("malformed IPv6 literal") from None
    if port == 0:
        raise bad("port 0 is no port a request can be sent to")
    return TargetURL(url, parts.scheme, host, port or (443 if parts.scheme == "https" else 80))


def address_allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a webhook may be sent to this address without the admin's opt-in.

    Only globally routable unicast addresses are: private, loopback, link-local, unspecified, reserved,
    shared (CGNAT), documentation and multicast ranges are refused, also when written as an IPv6 address that
    carries an IPv4 one: IPv4-mapped, NAT64 (``64:ff9b::/96``; a NAT64 gateway of an IPv6-only subnet reaches the
    private IPv4 hosts behind it), 6to4 (``2002::/16``). The local-use NAT64 prefix (``64:ff9b:1::/48``) and the
    deprecated IPv4-compatible form (``::/96``) are refused whatever they carry.

    Example:
        >>> address_allowed(ipaddress.ip_address("93.184.216.34")), address_allowed(ipaddress.ip_address("::1"))
        (True, False)
        >>> address_allowed(ipaddress.ip_address("64:ff9b::a00:1"))  # NAT64 of 10.0.0.1
        False
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _LOCAL_NAT64 or ip in _IPV4_COMPATIBLE:
            return False
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
    return ip.is_global and not ip.is_multicast


# Python's is_global says yes to these; what they carry (or are) is checked in address_allowed.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def _addresses(infos: Sequence[Any]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return [ipaddress.ip_address(str(i[4][0]).split("%", 1)[0]) for i in infos]


def _refuse_private(target: TargetURL, ips: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> None:
    bad = [ip for ip in ips if not address_allowed(ip)]
    if bad:
        raise TargetRefused(
            "webhook_target_refused",
            f"webhook host {target.host!r} resolves to {bad[0]}, a private, loopback, link-local or other "
            "non-public address; the server refuses those unless started with webhook_allow_private "
            "(undolog serve --webhook-allow-private)",
        )


def check_target(url: str, *, allow_private: bool) -> TargetURL:
    """Check a URL at registration: its syntax, and (unless ``allow_private``) where its host resolves now.

    A name that does not resolve yet is accepted; every send resolves and checks again.

    Raises:
        TargetRefused: A malformed URL, or a host that resolves to a refused address.

    Example:
        >>> check_target("http://127.0.0.1:9/x", allow_private=False)
        Traceback (most recent call last):
        ...
        undolog_server.webhooks.TargetRefused: webhook host '127.0.0.1' resolves to 127.0.0.1, ...
    """
    target = parse_target_url(url)
    if allow_private:
        return target
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return target
    _refuse_private(target, _addresses(infos))
    return target


async def _pin(target: TargetURL, *, allow_private: bool) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Resolve once, check every address, and aim the request at the checked one.

    Returns:
        The URL with the host replaced by the address, the ``Host`` header, and httpx extensions (the TLS
        server name stays the original host, so certificates are verified against it).
    """
    # socket.getaddrinfo in a thread, not the loop's resolver (uvloop's is libuv's): the same resolver as
    # the registration check, looked up at call time.
    # Its own threads: a slow DNS server must not tie up the default executor the sweeper and the
    # delivery records run on (a lookup goes on after the deadline cancels the wait for it).
    infos = await asyncio.get_running_loop().run_in_executor(
        _RESOLVER, functools.partial(socket.getaddrinfo, target.host, target.port, type=socket.SOCK_STREAM)
    )
    ips = _addresses(infos)
    if not ips:
        raise OSError(f"{target.host} has no address")
    if not allow_private:
        _refuse_private(target, ips)
    url = httpx.URL(target.url)
    headers = {"Host": url.netloc.decode("ascii")}
    extensions: dict[str, Any] = {}
    if target.scheme == "https":
        extensions["sni_hostname"] = target.host
    return str(url.copy_with(host=str(ips[0]))), headers, extensions


def route(
    event_type: str,
    risk_tags: Sequence[str],
    targets: Sequence[WebhookTarget],
    policies: Sequence[NotificationPolicy],
) -> list[WebhookTarget]:
    """Pick the targets that hear of an event.

    A notification policy matching one of the request's risk tags (or ``*``) names the
    targets; without a matching policy every target subscribed to the event type hears it.
    """
    wanting = [t for t in targets if t.wants(event_type)]
    matching = [p for p in policies if p.risk_tag == "*" or p.risk_tag in risk_tags]
    named = {n for p in matching for n in p.notify}
    if not matching or not named:
        return wanting
    return [t for t in wanting if t.name in named]


class WebhookDispatcher:
    """Fans outbox events out into deliveries and sends due deliveries.

    What to send to whom, and when to retry, is decided here; the rows live in :class:`.store.ServerStore`
    and the outbox is read through the core's public ``undolog.outbox``.

    Args:
        state: The server state (UndoLog, store, settings).
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state
        #: Sends in flight per target id, in this process (the per-target ceiling counts against it).
        self._busy: Counter[str] = Counter()
        #: Other consumers of the outbox (Slack, email): each is called before a drain and returns the handler run
        #: for every event inside the drain's transaction, so what it queues commits with the claim.
        self.consumers: list[Callable[[], Callable[[Any, OutboxEvent], None]]] = []

    # ---- fan-out (sync, in a worker thread) -----------------------------------------------------

    def fan_out(self, limit: int = 200) -> int:
        """Turn undelivered outbox events into delivery rows, once, whichever server gets there first.

        Returns:
            How many outbox events were handled.
        """
        store = self.state.store
        targets = store.targets()
        policies = store.policies()
        now = utcnow()

        handlers = [c() for c in self.consumers]

        def handle(conn: Any, events: Sequence[OutboxEvent]) -> None:
            for e in events:
                for h in handlers:
                    h(conn, e)
                envelope = {
                    "id": f"evt_{e.outbox_id}",
                    "type": e.event_type,
                    "created_at": (e.created_at or now).isoformat(),
                    "data": e.payload,
                }
                chosen = route(e.event_type, e.risk_tags, targets, policies)
                store.enqueue(conn, f"outbox:{e.outbox_id}", e.event_type, _body(envelope), [t.target_id for t in chosen])

        return self.state.undolog.outbox.drain(handle, limit=limit)

    # ---- signed audit checkpoints (sync) ---------------------------------------------------------

    def announce_checkpoint(self, path: str | Path) -> int:
        """Queue a signed audit checkpoint for the targets subscribed to ``audit.checkpoint`` by name.

        The event's ``data`` is the checkpoint file's document unchanged: a receiver that saves it as a
        ``.json`` file has a directory ``undolog audit verify --checkpoints`` reads, held away from the server.

        Returns:
            How many deliveries were queued.
        """
        chosen = [t.target_id for t in self.state.store.targets() if t.active and CHECKPOINT_EVENT in t.event_types]
        if not chosen:
            return 0
        path = Path(path)
        doc = json.loads(path.read_text(encoding="utf-8"))
        envelope = {
            "id": f"ckp_{path.stem}",
            "type": CHECKPOINT_EVENT,
            "created_at": doc["checkpoint"]["created_at"],
            "data": doc,
        }
        return self.state.store.enqueue_now(f"checkpoint:{path.stem}", CHECKPOINT_EVENT, _body(envelope), chosen)

    # ---- escalation (sync) ----------------------------------------------------------------------

    def escalate(self) -> int:
        """Escalate pending requests left undecided longer than their policy allows.

        Returns:
            How many escalations were sent.
        """
        store = self.state.store
        policies = [p for p in store.policies() if p.escalate_after_seconds and p.escalate_to]
        if not policies:
            return 0
        targets = {t.name: t for t in store.targets() if t.active}
        now = utcnow()
        sent = 0
        pending = self.state.views.pending_approvals()
        if not pending:
            return 0
        done = store.escalated([a["approval_request_id"] for a in pending])
        for a in pending:
            age = (now - a["created_at"]).total_seconds()
            for p in policies:
                if p.risk_tag != "*" and p.risk_tag not in a["risk_tags"]:
                    continue
                if age < (p.escalate_after_seconds or 0) or (a["approval_request_id"], p.risk_tag) in done:
                    continue
                envelope = {
                    "id": f"esc_{a['approval_request_id']}_{p.risk_tag}",
                    "type": "approval.escalated",
                    "created_at": now.isoformat(),
                    "data": {
                        "approval_request_id": a["approval_request_id"],
                        "session_id": a["session_id"],
                        "tool_name": a["tool_name"],
                        "risk_tags": a["risk_tags"],
                        "risk_tag": p.risk_tag,
                        "pending_seconds": round(age, 3),
                        "timeout_at": a["timeout_at"].isoformat(),
                    },
                }
                chosen = [targets[n].target_id for n in p.escalate_to if n in targets]
                if store.escalate_once(
                    a["approval_request_id"],
                    p.risk_tag,
                    f"escalation:{a['approval_request_id']}:{p.risk_tag}",
                    _body(envelope),
                    chosen,
                ):
                    sent += 1
        return sent

    # ---- delivery -------------------------------------------------------------------------------

    def claim_due(self, limit: int = 50, exclude_targets: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Lease due deliveries so no other server sends them at the same time.

        The lease (``webhook_lease``) outlasts an attempt's whole deadline, so a delivery still in flight is
        never claimed again; it only runs out when the server sending it died.
        """
        return self.state.store.claim_due(limit, time.time() + self.state.settings.webhook_lease, exclude_targets)

    def record(self, delivery_id: str, attempts: int, status_code: int | None, error: str | None) -> None:
        """Store one attempt's outcome and schedule the retry with exponential backoff."""
        s = self.state.settings
        ok = status_code is not None and 200 <= status_code < 300
        if ok:
            self.state.store.record_attempt(
                delivery_id, attempts=attempts, status_code=status_code, error=error, status="delivered"
            )
        elif attempts >= s.webhook_max_attempts:
            self.state.store.record_attempt(
                delivery_id, attempts=attempts, status_code=status_code, error=error, status="failed"
            )
        else:
            delay = min(s.webhook_backoff_base * 2 ** (attempts - 1), s.webhook_backoff_max)
            # Jitter spreads retries of many deliveries to one recovering receiver.
            self.state.store.record_attempt(
                delivery_id,
                attempts=attempts,
                status_code=status_code,
                error=error,
                next_attempt_at=time.time() + delay * random.uniform(0.8, 1.2),
            )

    async def deliver_due(self, client: httpx.AsyncClient) -> int:
        """Send every due delivery once (concurrently), wait for all and record the outcomes.

        Returns:
            How many deliveries were attempted.
        """
        tasks = await self.start_due(client, set())
        if tasks:
            await asyncio.gather(*tasks)
        return len(tasks)

    async def start_due(
        self, client: httpx.AsyncClient, inflight: set[asyncio.Task[None]], max_inflight: int | None = None
    ) -> list[asyncio.Task[None]]:
        """Claim due deliveries and start sending them without waiting for the answers.

        A receiver that stalls holds only its own sends open, each until the attempt's deadline
        (``webhook_timeout``), and at most ``webhook_per_target`` of them: its further deliveries are not
        even claimed meanwhile, so the process's ``max_inflight`` slots stay free for the other targets.

        Args:
            client: The HTTP client.
            inflight: Tasks still sending; started tasks are added and remove themselves when done.
            max_inflight: Ceiling of concurrent sends for this process (default ``webhook_max_inflight``).

        Returns:
            The tasks started now.
        """
        s = self.state.settings
        room = (max_inflight or s.webhook_max_inflight) - len(inflight)
        if room <= 0:
            return []
        busy = self._busy
        full = sorted(t for t, n in busy.items() if n >= s.webhook_per_target)
        rows = await asyncio.to_thread(self.claim_due, room, full)
        if not rows:
            return []
        taken: Counter[str] = Counter()
        send: list[dict[str, Any]] = []
        give_back: list[str] = []
        for r in rows:
            tid = r["target_id"]
            if busy[tid] + taken[tid] < s.webhook_per_target:
                taken[tid] += 1
                send.append(r)
            else:
                give_back.append(r["delivery_id"])
        if give_back:
            # Claimed in the same batch beyond the target's ceiling: free them for the next pass now
            # rather than holding a lease nobody is using.
            await asyncio.to_thread(self.state.store.release, give_back)
        targets = {t.target_id: t for t in await asyncio.to_thread(self.state.store.targets)}
        started = []
        for r in send:
            tid = r["target_id"]
            busy[tid] += 1
            task = asyncio.create_task(self._send(client, r, targets.get(tid)), name="undolog-webhook-send")
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            task.add_done_callback(functools.partial(self._done, tid))
            started.append(task)
        return started

    def _done(self, target_id: str, _task: asyncio.Task[None]) -> None:
        busy = self._busy
        busy[target_id] -= 1
        if busy[target_id] <= 0:
            del busy[target_id]

    async def _send(self, client: httpx.AsyncClient, row: dict[str, Any], target: WebhookTarget | None) -> None:
        """One attempt: never raises (an exception here would only surface as "Task exception was never retrieved")."""
        s = self.state.settings
        delivery_id = row["delivery_id"]
        attempts = int(row["attempts"]) + 1
        status: int | None = None
        error: DeliveryError | None = None
        try:
            if target is None:
                attempts, error = s.webhook_max_attempts, DeliveryError.TARGET_REMOVED
            else:
                status = await self._post(client, row, target)
                if not 200 <= status < 300:
                    error = DeliveryError.BAD_STATUS
        except TargetRefused as exc:
            error = DeliveryError.INVALID_URL if exc.code == "invalid_webhook_url" else DeliveryError.ADDRESS_REFUSED
            if error is DeliveryError.INVALID_URL:
                attempts = max(attempts, s.webhook_max_attempts)  # it will not get better by retrying
            log.warning("webhook delivery %s refused: %s", delivery_id, exc)
        except (TimeoutError, OSError, httpx.HTTPError) as exc:
            error = DeliveryError.NO_RESPONSE
            log.info("webhook delivery %s got no response: %s: %s", delivery_id, type(exc).__name__, exc)
        except Exception:
            error = DeliveryError.NO_RESPONSE
            log.exception("webhook delivery %s failed unexpectedly", delivery_id)
        try:
            await asyncio.to_thread(self.record, delivery_id, attempts, status, error.value if error else None)
        except Exception:
            # The lease runs out and the delivery is sent again: at least once, never lost.
            log.exception("could not record webhook delivery %s; it will be retried after its lease", delivery_id)

    async def _post(self, client: httpx.AsyncClient, row: dict[str, Any], target: WebhookTarget) -> int:
        """POST within one total deadline (resolution, connect, send, response headers); returns the status."""
        s = self.state.settings
        checked = parse_target_url(target.url)
        body = row["payload"].encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "undolog-webhooks/1",
            # No reuse: the pool keys connections by the pinned address, so a kept-alive TLS connection made
            # for one host name could otherwise carry a request for another name on the same address.
            "Connection": "close",
            "UndoLog-Event": row["event_type"],
            DELIVERY_HEADER: row["delivery_id"],
            SIGNATURE_HEADER: sign(target.secret, int(time.time()), body, delivery_id=row["delivery_id"]),
        }
        # httpx's own timeout is per read: a receiver sending a byte now and then would hold the send for
        # as long as it likes. This deadline covers the whole attempt.
        async with asyncio.timeout(s.webhook_timeout):
            url, host, extensions = await _pin(checked, allow_private=s.webhook_allow_private)
            async with client.stream(
                "POST", url, content=body, headers={**headers, **host}, extensions=extensions, timeout=s.webhook_timeout
            ) as resp:
                # The body is never read: only the status matters, and a huge or endless body costs nothing.
                return resp.status_code


def _body(envelope: dict[str, Any]) -> str:
    """The exact JSON body sent (and signed) for an event."""
    return json.dumps(envelope, separators=(",", ":"), sort_keys=True, default=str)
