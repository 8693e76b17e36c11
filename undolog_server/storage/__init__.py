"""The server's own tables (API keys, approver groups, webhooks, policies, deliveries) and their access.

This is the only module of the server with SQL (and the only one importing SQLAlchemy). Its tables are
created by the server's own migration branch (``undolog_server/storage/migrations``). Every statement runs on the
core store's public transaction helpers: reads on ``store.read()`` (a deferred ``BEGIN`` on SQLite, so a
read never takes the database's write lock), writes on ``store.tx()``. All access is synchronous
SQLAlchemy Core, so FastAPI runs it in its worker threads.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect, Engine

from undolog_core.limits import MAX_ID_LENGTH

# The identity model lives in one public module shared with the MCP gateway; re-exported here for old imports.
from ..identity import KEY_ID_BYTES as KEY_ID_BYTES
from ..identity import KEY_NAME_MAX as KEY_NAME_MAX
from ..identity import ROLES as ROLES
from ..identity import ApiKey as ApiKey
from ..identity import ApproverGroup as ApproverGroup


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Aware UTC datetimes on both databases (SQLite keeps no zone, so it is stored naive UTC).

    The same storage convention as the core's columns, defined here so the server needs no private core module.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the server's storage; use an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        parsed: datetime = datetime.fromisoformat(value) if isinstance(value, str) else value
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=UTC)
        return parsed.astimezone(UTC)


#: The server's own Alembic version table: its migrations are a branch of their own, next to the core's.
SERVER_VERSION_TABLE = "undolog_server_alembic_version"
#: PostgreSQL advisory lock serialising concurrent server migrations (the core's key + 1).
_SERVER_MIGRATION_LOCK_KEY = 0x756E646F6C6F67 + 1
KEY_PREFIX = "ulk_"
#: Seconds the thread recording keys' "last used" waits for more before it ends.
_TOUCHER_IDLE = 5.0
_log = logging.getLogger("undolog.server")

metadata = sa.MetaData()

api_keys = sa.Table(
    "undolog_api_keys",
    metadata,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("roles", sa.JSON, nullable=False),
    sa.Column("groups", sa.JSON, nullable=False),
    sa.Column("secret_hash", sa.String(128), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("created_by", sa.String(200), nullable=True),
    sa.Column("revoked_at", UTCDateTime, nullable=True),
    sa.Column("last_used_at", UTCDateTime, nullable=True),
)

approver_groups = sa.Table(
    "undolog_approver_groups",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("description", sa.Text, nullable=True),
    sa.Column("tools", sa.JSON, nullable=False),
    sa.Column("risk_tags", sa.JSON, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

webhook_targets = sa.Table(
    "undolog_webhook_targets",
    metadata,
    sa.Column("target_id", sa.String(40), primary_key=True),
    sa.Column("name", sa.String(100), nullable=False, unique=True),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("secret", sa.String(200), nullable=False),
    sa.Column("event_types", sa.JSON, nullable=False),
    sa.Column("active", sa.Boolean, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

notification_policies = sa.Table(
    "undolog_notification_policies",
    metadata,
    sa.Column("risk_tag", sa.String(100), primary_key=True),
    sa.Column("notify", sa.JSON, nullable=False),
    sa.Column("escalate_after_seconds", sa.Integer, nullable=True),
    sa.Column("escalate_to", sa.JSON, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

webhook_deliveries = sa.Table(
    "undolog_webhook_deliveries",
    metadata,
    sa.Column("delivery_id", sa.String(40), primary_key=True),
    sa.Column("event_id", sa.String(200), nullable=False),
    sa.Column("target_id", sa.String(40), nullable=False),
    sa.Column("event_type", sa.String(100), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_attempt_at", sa.Float, nullable=False),
    sa.Column("locked_until", sa.Float, nullable=True),
    sa.Column("last_status_code", sa.Integer, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("delivered_at", UTCDateTime, nullable=True),
    sa.UniqueConstraint("event_id", "target_id", name="uq_undolog_webhook_deliveries_event_target"),
    sa.Index("ix_undolog_webhook_deliveries_due", "status", "next_attempt_at"),
)

escalations = sa.Table(
    "undolog_escalations",
    metadata,
    sa.Column("approval_request_id", sa.String(64), primary_key=True),
    sa.Column("risk_tag", sa.String(100), primary_key=True),
    sa.Column("escalated_at", UTCDateTime, nullable=False),
)

dashboard_sessions = sa.Table(
    "undolog_dashboard_sessions",
    metadata,
    sa.Column("session_hash", sa.String(64), primary_key=True),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
    sa.Column("revoked_at", UTCDateTime, nullable=True),
    sa.Index("ix_undolog_dashboard_sessions_expires", "expires_at"),
)

server_settings = sa.Table(
    "undolog_server_settings",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


class CoreStore(Protocol):
    """The public part of the core's store (``UndoLog.store``) this module uses."""

    @property
    def engine(self) -> Engine: ...

    @property
    def schema(self) -> str | None: ...

    @property
    def is_postgres(self) -> bool: ...

    def read(self) -> AbstractContextManager[Connection]: ...

    def tx(self, *, fast: bool = False) -> AbstractContextManager[Connection]: ...


@functools.cache
def _alembic_config() -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    return cfg


@functools.cache
def migration_head() -> str:
    """The newest revision of the server's migration branch."""
    from alembic.script import ScriptDirectory

    return ",".join(sorted(ScriptDirectory.from_config(_alembic_config()).get_heads()))


def migration_current(core: CoreStore) -> str | None:
    """The server branch's revision in this database (None: never migrated)."""
    with core.read() as conn:
        if not sa.inspect(conn).has_table(SERVER_VERSION_TABLE):
            return None
        rows = conn.execute(sa.text(f"SELECT version_num FROM {SERVER_VERSION_TABLE}")).scalars().all()
    return ",".join(sorted(rows)) if rows else None


def migrate(core: CoreStore) -> bool:
    """Create or upgrade the server's tables (the server's own Alembic branch); a no-op at head.

    Runs when the server starts (:func:`undolog_server.create_app`), before ``undolog keys`` commands, and with
    ``undolog db upgrade --server``. The core's tables must be migrated first (``UndoLog.open`` does it).

    Returns:
        True when something was migrated.

    Example:
        >>> migrate(undolog.store)
    """
    if migration_current(core) == migration_head():
        return False
    from alembic import command

    with core.engine.connect() as conn, conn.begin():
        if conn.dialect.name == "postgresql":
            # Two servers starting at once: the loser waits here, then Alembic finds nothing to do.
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_SERVER_MIGRATION_LOCK_KEY})")
        cfg = _alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "heads")
    return True


def utcnow() -> datetime:
    """Return the current time, timezone-aware in UTC."""
    return datetime.now(UTC)


def aware(value: datetime | None) -> datetime | None:
    """Return ``value`` as an aware UTC datetime (SQLite hands back naive ones)."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def hash_secret(secret: str) -> str:
    """Hash an API key secret.

    The secrets are 256 random bits, so a single SHA-256 is as strong as a slow KDF
    here and keeps per-request authentication cheap.
    """
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class WebhookTarget:
    """A receiver of signed webhook events."""

    target_id: str
    name: str
    url: str
    secret: str
    event_types: tuple[str, ...] = ("*",)
    active: bool = True

    def wants(self, event_type: str) -> bool:
        return self.active and ("*" in self.event_types or event_type in self.event_types)


@dataclass(frozen=True)
class NotificationPolicy:
    """Per risk tag (``*`` for any request): who hears of a request and whom to escalate to."""

    risk_tag: str
    notify: tuple[str, ...] = ()
    escalate_after_seconds: int | None = None
    escalate_to: tuple[str, ...] = ()


@dataclass
class ServerStore:
    """Data access for the server's tables.

    Args:
        core: The UndoLog's store (``undolog.store``); the tables live next to the core's.

    Example:
        >>> store = ServerStore(undolog.store)
        >>> key, token = store.create_key("ana", ["approver"], ["billing"])
    """

    core: CoreStore
    _touch_cache: dict[str, float] = field(default_factory=dict)
    _touches: queue.SimpleQueue[tuple[str, datetime]] = field(default_factory=queue.SimpleQueue)
    _toucher: threading.Thread | None = None
    _toucher_lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- settings -------------------------------------------------------------------------------

    def migrate(self) -> bool:
        """Create or upgrade the server's tables; see :func:`migrate`."""
        return migrate(self.core)

    def server_secret(self) -> bytes:
        """Return the secret signing cookies and CSRF tokens, shared by every server on the database.

        Returns:
            32+ random bytes, created on first use.
        """
        with self.core.read() as conn:
            row = conn.execute(sa.select(server_settings.c.value).where(server_settings.c.name == "secret")).first()
            if row is not None:
                return bytes.fromhex(row[0])
        value = secrets.token_hex(32)
        try:
            with self.core.tx() as conn:
                conn.execute(server_settings.insert().values(name="secret", value=value))
        except sa.exc.IntegrityError:
            pass  # another server process created it first; use theirs
        with self.core.read() as conn:
            got = conn.execute(sa.select(server_settings.c.value).where(server_settings.c.name == "secret")).scalar_one()
        return bytes.fromhex(got)

    # ---- API keys -------------------------------------------------------------------------------

    def create_key(
        self, name: str, roles: Sequence[str], groups: Sequence[str] = (), created_by: str | None = None
    ) -> tuple[ApiKey, str]:
        """Create an API key.

        Args:
            name: Who holds it (recorded with every decision).
            roles: Some of ``agent``, ``approver``, ``admin``.
            groups: Approver groups the holder belongs to.
            created_by: Identity of the creator, for the record.

        Returns:
            The stored key and the full bearer token, which is shown once and never stored.

        Raises:
            ValueError: An unknown role or an empty name.
        """
        roles = sorted(set(roles))
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            raise ValueError(f"roles must be a non-empty subset of {', '.join(ROLES)}; got {roles}")
        if not name.strip():
            raise ValueError("a key needs a name")
        if len(name) > KEY_NAME_MAX:
            # The holder's identity, "<name> (key <id>)", is what decisions record; it must fit the one length rule.
            raise ValueError(f"a key name has at most {KEY_NAME_MAX} characters (the recorded identity "
                             f"'<name> (key <id>)' must fit {MAX_ID_LENGTH}); got {len(name)}")
        key_id = secrets.token_hex(KEY_ID_BYTES)
        secret = secrets.token_urlsafe(32)
        now = utcnow()
        with self.core.tx() as conn:
            conn.execute(
                api_keys.insert().values(
                    key_id=key_id,
                    name=name.strip(),
                    roles=list(roles),
                    groups=sorted(set(groups)),
                    secret_hash=hash_secret(secret),
                    created_at=now,
                    created_by=created_by,
                )
            )
        key = ApiKey(key_id, name.strip(), frozenset(roles), frozenset(groups), now, created_by)
        return key, f"{KEY_PREFIX}{key_id}_{secret}"

    def authenticate(self, token: str) -> ApiKey | None:
        """Return the active key matching a bearer token, or None.

        Args:
            token: The full token as presented.
        """
        if not token.startswith(KEY_PREFIX):
            return None
        rest = token[len(KEY_PREFIX) :]
        key_id, sep, secret = rest.partition("_")
        if not sep or not key_id or not secret or len(key_id) > 32:
            return None
        with self.core.read() as conn:
            row = conn.execute(sa.select(api_keys).where(api_keys.c.key_id == key_id)).mappings().first()
        if row is None or row["revoked_at"] is not None:
            return None
        if not hmac.compare_digest(row["secret_hash"], hash_secret(secret)):
            return None
        self._touch(key_id)
        return _key_from_row(row)

    def get_key(self, key_id: str) -> ApiKey | None:
        """Return an active key by id (for cookie sessions), or None."""
        with self.core.read() as conn:
            row = conn.execute(sa.select(api_keys).where(api_keys.c.key_id == key_id)).mappings().first()
        if row is None or row["revoked_at"] is not None:
            return None
        return _key_from_row(row)

    # ---- dashboard login sessions ---------------------------------------------------------------

    def create_dashboard_session(self, key_id: str, max_age: int) -> tuple[str, str]:
        """Start a dashboard login for ``key_id``; returns (the cookie's token, the session's id).

        The token is 256 random bits and only its hash is stored; the id (that hash) is what CSRF tokens are
        bound to. Expired logins are swept here, so the table holds only the live ones.

        Example:
            >>> token, sid = store.create_dashboard_session(key.key_id, 12 * 3600)
        """
        token = secrets.token_urlsafe(32)
        session_hash = hashlib.sha256(token.encode()).hexdigest()
        now = utcnow()
        with self.core.tx() as conn:
            conn.execute(dashboard_sessions.delete().where(dashboard_sessions.c.expires_at < now))
            conn.execute(dashboard_sessions.insert().values(
                session_hash=session_hash, key_id=key_id, created_at=now,
                expires_at=now + timedelta(seconds=max_age),
            ))
        return token, session_hash

    def dashboard_session(self, token: str) -> tuple[ApiKey, str] | None:
        """The live login a cookie's token names and its key, or None (unknown, expired, logged out, key revoked)."""
        if not token or len(token) > 100:
            return None
        session_hash = hashlib.sha256(token.encode()).hexdigest()
        d = dashboard_sessions
        with self.core.read() as conn:
            row = conn.execute(
                sa.select(api_keys, d.c.expires_at, d.c.revoked_at.label("session_revoked_at"))
                .select_from(d.join(api_keys, api_keys.c.key_id == d.c.key_id))
                .where(d.c.session_hash == session_hash)
            ).mappings().first()
        if row is None or row["revoked_at"] is not None or row["session_revoked_at"] is not None:
            return None
        expires = aware(row["expires_at"])
        if expires is None or expires <= utcnow():
            return None
        return _key_from_row(row), session_hash

    def end_dashboard_session(self, session_hash: str) -> None:
        """Log out: the login is revoked, so its cookie stops working everywhere at once."""
        d = dashboard_sessions
        with self.core.tx() as conn:
            conn.execute(d.update().where(d.c.session_hash == session_hash, d.c.revoked_at.is_(None))
                         .values(revoked_at=utcnow()))

    def _touch(self, key_id: str) -> None:
        # One write a minute per key is enough for "last used" and keeps reads write-free. It is made by a thread of
        # its own, never on the request's path: a read must not wait for the write lock (SQLite's, or a PostgreSQL
        # row lock) because its key was not used in the last minute, nor fail when the lock is not had in time.
        now = time.monotonic()
        if now - self._touch_cache.get(key_id, -1e9) < 60:
            return
        self._touch_cache[key_id] = now
        self._touches.put((key_id, utcnow()))
        with self._toucher_lock:
            if self._toucher is None:
                self._toucher = threading.Thread(target=self._record_touches, name="undolog-key-touch", daemon=True)
                self._toucher.start()

    def _record_touches(self) -> None:
        """Write the queued "last used" times; the thread ends once nothing was queued for a few seconds."""
        while True:
            try:
                key_id, at = self._touches.get(timeout=_TOUCHER_IDLE)
            except queue.Empty:
                with self._toucher_lock:
                    if self._touches.empty():
                        self._toucher = None
                        return
                continue
            try:
                with self.core.tx() as conn:
                    conn.execute(api_keys.update().where(api_keys.c.key_id == key_id).values(last_used_at=at))
            except Exception:  # noqa: BLE001 - best effort: "last used" must never cost a request or the thread
                _log.debug("could not record the last use of key %s", key_id, exc_info=True)

    def list_keys(self) -> list[ApiKey]:
        with self.core.read() as conn:
            rows = conn.execute(sa.select(api_keys).order_by(api_keys.c.created_at)).mappings().all()
        return [_key_from_row(r) for r in rows]

    def revoke_key(self, key_id: str) -> bool:
        with self.core.tx() as conn:
            res = conn.execute(
                api_keys.update()
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
        return bool(res.rowcount)

    # ---- approver groups ------------------------------------------------------------------------

    def groups(self) -> list[ApproverGroup]:
        with self.core.read() as conn:
            rows = conn.execute(sa.select(approver_groups).order_by(approver_groups.c.name)).mappings().all()
        return [
            ApproverGroup(r["name"], tuple(r["tools"] or ()), tuple(r["risk_tags"] or ()), r["description"])
            for r in rows
        ]

    def put_group(self, group: ApproverGroup) -> None:
        values = {
            "tools": list(group.tools),
            "risk_tags": list(group.risk_tags),
            "description": group.description,
            "updated_at": utcnow(),
        }
        with self.core.tx() as conn:
            res = conn.execute(approver_groups.update().where(approver_groups.c.name == group.name).values(**values))
            if not res.rowcount:
                conn.execute(approver_groups.insert().values(name=group.name, **values))

    def delete_group(self, name: str) -> bool:
        with self.core.tx() as conn:
            return bool(conn.execute(approver_groups.delete().where(approver_groups.c.name == name)).rowcount)

    # ---- webhooks -------------------------------------------------------------------------------

    def targets(self) -> list[WebhookTarget]:
        with self.core.read() as conn:
            rows = conn.execute(sa.select(webhook_targets).order_by(webhook_targets.c.name)).mappings().all()
        return [_target_from_row(r) for r in rows]

    def get_target(self, target_id: str) -> WebhookTarget | None:
        with self.core.read() as conn:
            row = conn.execute(
                sa.select(webhook_targets).where(webhook_targets.c.target_id == target_id)
            ).mappings().first()
        return _target_from_row(row) if row else None

    def create_target(
        self, name: str, url: str, secret: str | None = None, event_types: Sequence[str] = ("*",)
    ) -> WebhookTarget:
        """Create a webhook target; a secret is generated when none is given.

        Raises:
            ValueError: The name is taken.
        """
        target = WebhookTarget(
            "wh_" + uuid.uuid4().hex[:16], name, url, secret or secrets.token_urlsafe(32), tuple(event_types) or ("*",)
        )
        try:
            with self.core.tx() as conn:
                conn.execute(
                    webhook_targets.insert().values(
                        target_id=target.target_id,
                        name=target.name,
                        url=target.url,
                        secret=target.secret,
                        event_types=list(target.event_types),
                        active=True,
                        created_at=utcnow(),
                    )
                )
        except sa.exc.IntegrityError:
            raise ValueError(f"a webhook target named {name!r} already exists") from None
        return target

    def delete_target(self, target_id: str) -> bool:
        with self.core.tx() as conn:
            return bool(conn.execute(webhook_targets.delete().where(webhook_targets.c.target_id == target_id)).rowcount)

    # ---- notification policies ------------------------------------------------------------------

    def policies(self) -> list[NotificationPolicy]:
        with self.core.read() as conn:
            rows = conn.execute(sa.select(notification_policies).order_by(notification_policies.c.risk_tag)).mappings()
            return [
                NotificationPolicy(
                    r["risk_tag"], tuple(r["notify"] or ()), r["escalate_after_seconds"], tuple(r["escalate_to"] or ())
                )
                for r in rows
            ]

    def put_policy(self, policy: NotificationPolicy) -> None:
        values = {
            "notify": list(policy.notify),
            "escalate_after_seconds": policy.escalate_after_seconds,
            "escalate_to": list(policy.escalate_to),
            "updated_at": utcnow(),
        }
        with self.core.tx() as conn:
            res = conn.execute(
                notification_policies.update().where(notification_policies.c.risk_tag == policy.risk_tag).values(**values)
            )
            if not res.rowcount:
                conn.execute(notification_policies.insert().values(risk_tag=policy.risk_tag, **values))

    def delete_policy(self, risk_tag: str) -> bool:
        with self.core.tx() as conn:
            return bool(
                conn.execute(notification_policies.delete().where(notification_policies.c.risk_tag == risk_tag)).rowcount
            )

    # ---- deliveries -----------------------------------------------------------------------------

    def deliveries(self, target_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        q = sa.select(webhook_deliveries).order_by(webhook_deliveries.c.created_at.desc()).limit(limit)
        if target_id is not None:
            q = q.where(webhook_deliveries.c.target_id == target_id)
        with self.core.read() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    # ---- delivery queue (webhooks.py decides what and when; the SQL is here) ---------------------

    def enqueue(self, conn: Connection, event_id: str, event_type: str, body: str, target_ids: Iterable[str]) -> int:
        """Add one pending delivery per target, inside the caller's transaction; repeats are ignored.

        Args:
            conn: An open transaction (the outbox claim, or an escalation).
            event_id: The event's stable id; ``(event_id, target)`` is unique, so a fan-out done twice
                (two servers, a retry) delivers once.
            event_type: The event type, sent as ``UndoLog-Event``.
            body: The exact JSON body that will be signed and sent.
            target_ids: Who receives it.

        Returns:
            How many deliveries were added.
        """
        now = utcnow()
        rows = [
            {
                "delivery_id": "dl_" + uuid.uuid4().hex[:20],
                "event_id": event_id,
                "target_id": target_id,
                "event_type": event_type,
                "payload": body,
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": time.time(),
                "created_at": now,
            }
            for target_id in target_ids
        ]
        return insert_ignore(conn, webhook_deliveries, rows)

    def enqueue_now(self, event_id: str, event_type: str, body: str, target_ids: Iterable[str]) -> int:
        """:meth:`enqueue` in a transaction of its own (events the server raises itself, not the outbox)."""
        with self.core.tx() as conn:
            return self.enqueue(conn, event_id, event_type, body, target_ids)

    def escalated(self, approval_request_ids: Sequence[str]) -> set[tuple[str, str]]:
        """The (request, risk tag) pairs already escalated among these requests."""
        if not approval_request_ids:
            return set()
        with self.core.read() as conn:
            return {
                (r.approval_request_id, r.risk_tag)
                for r in conn.execute(
                    sa.select(escalations.c.approval_request_id, escalations.c.risk_tag).where(
                        escalations.c.approval_request_id.in_(list(approval_request_ids))
                    )
                )
            }

    def escalate_once(
        self, approval_request_id: str, risk_tag: str, event_id: str, body: str, target_ids: Iterable[str]
    ) -> bool:
        """Record an escalation and enqueue its deliveries in one transaction, unless another server did.

        Returns:
            True when this call escalated (False: it had been done already).
        """
        with self.core.tx() as conn:
            won = insert_ignore(
                conn,
                escalations,
                [{"approval_request_id": approval_request_id, "risk_tag": risk_tag, "escalated_at": utcnow()}],
            )
            if not won:
                return False
            self.enqueue(conn, event_id, "approval.escalated", body, target_ids)
        return True

    def claim_due(self, limit: int, lease_until: float, exclude_targets: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Lease up to ``limit`` due deliveries until ``lease_until`` (unix seconds), so no other server sends them.

        Args:
            limit: Most rows to claim.
            lease_until: When the lease runs out (unix seconds).
            exclude_targets: Targets whose deliveries are left alone (this process is at their ceiling).
        """
        d = webhook_deliveries
        now = time.time()
        with self.core.tx() as conn:
            q = (
                sa.select(d.c.delivery_id, d.c.target_id, d.c.event_type, d.c.payload, d.c.attempts)
                .where(
                    d.c.status == "pending",
                    d.c.next_attempt_at <= now,
                    sa.or_(d.c.locked_until.is_(None), d.c.locked_until < now),
                )
                .order_by(d.c.next_attempt_at)
                .limit(limit)
            )
            if exclude_targets:
                q = q.where(d.c.target_id.not_in(list(exclude_targets)))
            if self.core.is_postgres:
                q = q.with_for_update(skip_locked=True)
            rows = [dict(r._mapping) for r in conn.execute(q)]
            if rows:
                conn.execute(
                    d.update().where(d.c.delivery_id.in_([r["delivery_id"] for r in rows])).values(locked_until=lease_until)
                )
        return rows

    def release(self, delivery_ids: Sequence[str]) -> None:
        """Drop this server's lease on deliveries it claimed but will not send now (another pass may)."""
        if not delivery_ids:
            return
        d = webhook_deliveries
        with self.core.tx() as conn:
            conn.execute(d.update().where(d.c.delivery_id.in_(list(delivery_ids))).values(locked_until=None))

    def record_attempt(
        self,
        delivery_id: str,
        *,
        attempts: int,
        status_code: int | None,
        error: str | None,
        status: str | None = None,
        next_attempt_at: float | None = None,
    ) -> None:
        """Store one attempt's outcome: ``status`` ``delivered``/``failed``, or a retry at ``next_attempt_at``."""
        values: dict[str, Any] = {
            "attempts": attempts, "last_status_code": status_code, "last_error": error, "locked_until": None,
        }
        if status is not None:
            values["status"] = status
            if status == "delivered":
                values["delivered_at"] = utcnow()
        if next_attempt_at is not None:
            values["next_attempt_at"] = next_attempt_at
        d = webhook_deliveries
        with self.core.tx() as conn:
            conn.execute(d.update().where(d.c.delivery_id == delivery_id).values(**values))

    def ping(self) -> None:
        """Run ``SELECT 1`` on the read path (health check); raises when the database does not answer."""
        with self.core.read() as conn:
            conn.execute(sa.text("SELECT 1"))


def _key_from_row(row: Any) -> ApiKey:
    return ApiKey(
        key_id=row["key_id"],
        name=row["name"],
        roles=frozenset(row["roles"] or ()),
        groups=frozenset(row["groups"] or ()),
        created_at=aware(row["created_at"]) or utcnow(),
        created_by=row["created_by"],
        revoked_at=aware(row["revoked_at"]),
        last_used_at=aware(row["last_used_at"]),
    )


def _target_from_row(row: Any) -> WebhookTarget:
    return WebhookTarget(
        row["target_id"], row["name"], row["url"], row["secret"], tuple(row["event_types"] or ("*",)), bool(row["active"])
    )


def insert_ignore(conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> int:
    """Insert rows, skipping those that collide with a unique key (idempotent fan-out).

    Args:
        conn: Open connection inside a transaction.
        table: Target table.
        rows: Rows to insert.

    Returns:
        How many rows were inserted.
    """
    if not rows:
        return 0
    dialect = conn.dialect.name
    stmt: Any
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stmt = pg_insert(table).on_conflict_do_nothing()
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        stmt = sqlite_insert(table).on_conflict_do_nothing()
    else:  # pragma: no cover - only the two supported databases reach here
        stmt = table.insert()
    total = 0
    # Counted from RETURNING, not rowcount: psycopg reports -1 for INSERT ... ON CONFLICT DO NOTHING, which made
    # every caller see an insert (escalate_once always "escalated" on PostgreSQL).
    key = next(iter(table.primary_key.columns), None)
    for row in rows:
        if key is None or dialect not in ("postgresql", "sqlite"):
            total += max(conn.execute(stmt.values(**row)).rowcount or 0, 0)
        else:
            total += len(conn.execute(stmt.values(**row).returning(key)).all())
    return total


def later(seconds: float) -> datetime:
    """Return now + ``seconds`` as an aware datetime."""
    return utcnow() + timedelta(seconds=seconds)


# The email approvals' tables join ``metadata`` (the migrations' target) whenever the storage is imported.
from . import email as email  # noqa: E402
