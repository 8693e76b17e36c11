"""What one server process holds: the UndoLog, the server store, settings and loaded tools."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from undolog_core import UndoLog

from .storage import ServerStore
from .views import CoreViews

if TYPE_CHECKING:
    from .proxy import ProxyTools


#: Seconds a delivery's lease must outlast the attempt's deadline (time to record the outcome).
WEBHOOK_LEASE_MARGIN = 10.0


@dataclass(frozen=True)
class EmailSettings:
    """How the desk sends approval mail (see ``docs/how-to/email.md``).

    Passwords never sit here: the SMTP password is read from the environment variable named by ``password_env``
    at each send, and the key signing the links from ``token_key_file`` or ``UNDOLOG_EMAIL_TOKEN_KEY``.

    Attributes:
        smtp_host: The SMTP server's host.
        sender: The ``From`` address.
        smtp_port: Its port (587 for STARTTLS, 465 for implicit TLS, 25 for neither).
        security: ``starttls`` (upgrade after connecting; refused if the server cannot), ``tls`` (implicit TLS)
            or ``none`` (plain text: only for a relay on the same host).
        username: The SMTP login, if the server wants one; its password comes from ``password_env``.
        password_env: The environment variable holding the SMTP password.
        token_key_file: A file holding the key that signs the links (32 bytes or more); without it the key is read
            from ``UNDOLOG_EMAIL_TOKEN_KEY``. It is kept outside the database: a database dump cannot forge a link.
        ca_file: A PEM file of the certificate authorities the SMTP server's certificate is checked against (a
            private CA); the system's store when None. The certificate and host name are always checked.
        timeout: Seconds each SMTP network operation may take.
        max_attempts: Attempts before a mail is given up as ``failed``.
        backoff_base: First retry delay in seconds; doubles each attempt.
        backoff_max: Ceiling of the retry delay.
        code_ttl: Seconds a one-time code stays valid.
        max_codes: Codes one link may have sent (so a link cannot be used to flood the approver's mailbox).

    Example:
        >>> EmailSettings(smtp_host="smtp.example.com", sender="undolog@example.com", username="undolog")
        EmailSettings(smtp_host='smtp.example.com', ...)
    """

    smtp_host: str
    sender: str
    smtp_port: int = 587
    security: Literal["starttls", "tls", "none"] = "starttls"
    username: str | None = None
    password_env: str = "UNDOLOG_SMTP_PASSWORD"
    token_key_file: str | None = None
    ca_file: str | None = None
    timeout: float = 10.0
    max_attempts: int = 8
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    code_ttl: float = 600.0
    max_codes: int = 3

    def __post_init__(self) -> None:
        if self.security not in ("starttls", "tls", "none"):
            raise ValueError(f"email security must be starttls, tls or none, not {self.security!r}")
        if not self.smtp_host or not self.sender or "@" not in self.sender:
            raise ValueError("email needs an SMTP host and a sender address (--smtp-host, --email-from)")
        if self.timeout <= 0 or self.max_attempts < 1 or self.max_codes < 1 or self.code_ttl <= 0:
            raise ValueError("email timeout and code_ttl must be positive, max_attempts and max_codes at least 1")


@dataclass
class ServerSettings:
    """Tunables of one server process.

    Attributes:
        background: Run the sweeper and webhook loops (tests of single pieces turn it off).
        sweep_interval: Seconds between sweeps (expire due approvals, escalate, fan out events).
        recover_interval: Seconds between recovery runs.
        webhook_interval: Seconds between polls for due webhook deliveries.
        webhook_timeout: Total deadline of one webhook attempt in seconds (resolution, connect, sending and
            the response headers together, not per read), after which it counts as failed.
        webhook_per_target: Most sends in flight to one target, per process, so one slow receiver cannot take
            every slot.
        webhook_max_inflight: Most sends in flight per process, all targets together.
        webhook_lease: Seconds a claimed delivery stays leased to the server sending it; longer than the
            deadline, so nothing is sent twice while in flight (it only matters when that server dies).
        webhook_allow_private: Let webhook targets resolve to private, loopback, link-local and other
            non-public addresses (off: such targets are refused at registration and at send time).
        webhook_max_attempts: Attempts before a delivery is given up as ``failed``.
        webhook_backoff_base: First retry delay; doubles each attempt.
        webhook_backoff_max: Ceiling of the retry delay.
        audit_checkpoint_key: Ed25519 private key file (PEM) signing audit checkpoints; with
            ``audit_checkpoint_dir``, the server signs the chain head every ``audit_checkpoint_interval``.
        audit_checkpoint_dir: Directory (outside the database) the signed checkpoints are written to.
        audit_checkpoint_interval: Seconds between checkpoints: the window in which a rewrite of the newest
            events is caught only by the chain, not by a signature.
        context_calls: How many of the session's last calls a request page shows.
        cookie_max_age: Dashboard login lifetime in seconds.
        secure_cookies: Force the cookie ``Secure`` flag; None sets it on HTTPS requests only.
        poll_seconds: Dashboard queue refresh period.
        max_body_bytes: The largest request body accepted (bytes); a larger one is answered 413 before it is
            buffered.
        max_concurrent_requests: Most requests inside the desk at once (not counting decisions, the liveness
            probe and static files); the others wait in arrival order. See :mod:`undolog_server.lanes`.
        decision_lane: Most decisions (approve, reject, modify, respond) inside at once, in a lane of their own so
            they never queue behind the agents' traffic.
        queue_timeout: Seconds a request may wait for admission before it is answered 503 ``server_busy`` with
            ``Retry-After``.
        slack: Approvals in Slack (:class:`undolog_server.slack.SlackConfig`); None: off.
        docs: Serve the interactive API docs at ``/docs`` (Swagger UI, loaded from a CDN); off by default.
            ``/openapi.json`` is always served.
        public_url: The desk's address as approvers reach it (``https://desk.example.com``): the links in mail
            are built from it.
        email: How approval mail is sent; None sends none.
        email_interval: Seconds between polls for due mail.
    """

    background: bool = True
    sweep_interval: float = 1.0
    recover_interval: float = 30.0
    webhook_interval: float = 0.5
    webhook_timeout: float = 5.0
    webhook_per_target: int = 4
    webhook_max_inflight: int = 64
    webhook_lease: float = 60.0
    webhook_allow_private: bool = False
    audit_checkpoint_key: str | None = None
    audit_checkpoint_dir: str | None = None
    audit_checkpoint_interval: float = 300.0
    webhook_max_attempts: int = 8
    webhook_backoff_base: float = 1.0
    webhook_backoff_max: float = 300.0
    context_calls: int = 10
    cookie_max_age: int = 12 * 3600
    secure_cookies: bool | None = None
    poll_seconds: float = 3.0
    max_body_bytes: int = 1 << 20
    max_concurrent_requests: int = 8
    decision_lane: int = 4
    queue_timeout: float = 30.0
    docs: bool = False
    public_url: str | None = None
    email: EmailSettings | None = None
    email_interval: float = 0.5
    # An undolog_server.slack.SlackConfig; typed Any so this module imports nothing that imports it back.
    slack: Any = None

    def __post_init__(self) -> None:
        if self.email is not None and not self.public_url:
            raise ValueError("email approvals need the desk's public URL for their links (--public-url)")
        if self.public_url is not None and not self.public_url.startswith(("https://", "http://")):
            raise ValueError(f"public_url must start with https:// (or http:// for a local desk), not {self.public_url!r}")
        if self.webhook_timeout <= 0:
            raise ValueError(f"webhook_timeout must be positive, not {self.webhook_timeout}")
        if self.webhook_per_target < 1 or self.webhook_max_inflight < 1:
            raise ValueError("webhook_per_target and webhook_max_inflight must be at least 1")
        if self.max_concurrent_requests < 1 or self.decision_lane < 1:
            raise ValueError("max_concurrent_requests and decision_lane must be at least 1")
        if self.queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be positive, not {self.queue_timeout}")
        if (self.audit_checkpoint_key is None) != (self.audit_checkpoint_dir is None):
            raise ValueError("audit checkpoints need both audit_checkpoint_key and audit_checkpoint_dir")
        if self.audit_checkpoint_interval <= 0:
            raise ValueError(f"audit_checkpoint_interval must be positive, not {self.audit_checkpoint_interval}")
        # The lease must outlast a whole attempt plus recording its outcome, or another pass (or server)
        # would claim and send a delivery that is still in flight.
        if self.webhook_lease < self.webhook_timeout + WEBHOOK_LEASE_MARGIN:
            raise ValueError(
                f"webhook_lease ({self.webhook_lease} s) must exceed webhook_timeout ({self.webhook_timeout} s) "
                f"by at least {WEBHOOK_LEASE_MARGIN} s"
            )


@dataclass
class ServerState:
    """Everything the routes need, attached to ``app.state.undolog_server``."""

    undolog: UndoLog
    store: ServerStore
    views: CoreViews
    settings: ServerSettings
    secret: bytes
    proxy: ProxyTools | None = None
    app_spec: str | None = None
    worker_id: str = ""
    stats: dict[str, int] = field(default_factory=dict)
    #: More background loops the sweeper starts and stops with its own, each ``loop(stop_event)``.
    background_loops: list[Callable[[Any], Coroutine[Any, Any, None]]] = field(default_factory=list)
    #: The Slack integration (an ``undolog_server.slack.SlackDesk``) when ``settings.slack`` is set.
    slack: Any = None

