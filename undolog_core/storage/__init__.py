"""Every statement UndoLog issues, behind one interface, one implementation per database.

``Storage`` is a ``Store`` (engines, ``tx()``, ``read()``, ``for_update()``, ``is_postgres``) holding one small
repository per table (``storage.sessions``, ``storage.effects``, ``storage.undo``, ``storage.owners``,
``storage.approvals``, ``storage.audit``, ``storage.registry``, ``storage.policy``, ``storage.outbox``,
``storage.archive``: each built here with exactly what it needs) and one service over them whose transactions
span tables (``storage.recovery``: recovery's verdicts). ``contract.py`` writes down what each
repository guarantees (a ``Protocol`` per repository); ``tests/conformance`` holds every database's
implementation to it. The engine, the saga, recovery and the other services hold no SQL of their own. Each
method is one unit of work: it opens its own transaction, or, named ``*_in(conn, ...)``, joins the caller's. The
methods return records (``storage.records``) or plain dicts. The hot path's two statements (the pre-write and the
commit mark) are written per database.

Example:
    >>> storage = open_storage("sqlite:///undolog.db")
    >>> storage.migrate()
    >>> storage.policy.get().approval_timeout_seconds
    3600
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, make_url

from ..errors import ConfigurationError
from . import postgres, schema, sqlite
from .approvals import ApprovalsSQL
from .archive import ArchiveSQL, GcBatch
from .audit import AuditSQL
from .base import Store, resolve_url
from .effects import EffectsSQL, InFlight
from .hotpath import HotPath
from .outbox import OutboxSQL
from .owners import OwnersSQL
from .policy import PolicySQL
from .recovery import RecoverySQL
from .registry import RegistrySQL
from .sessions import SessionsSQL
from .undo import UndoSQL

#: The exceptions a database (not UndoLog) raises: unreachable server, missing schema, locked file...
DATABASE_ERRORS: tuple[type[Exception], ...] = (sa_exc.SQLAlchemyError,)


class Storage(Store):
    """The store of one database: engines and pools (``Store``) and its repositories, each built here with what it
    writes in its own transactions.

    Example:
        >>> storage = open_storage("sqlite:///undolog.db")
        >>> storage.registry.history("refund")
        []
    """

    #: The repositories (``contract.REPOSITORIES`` names each one's Protocol).
    sessions: SessionsSQL
    effects: EffectsSQL
    undo: UndoSQL
    recovery: RecoverySQL
    owners: OwnersSQL
    approvals: ApprovalsSQL
    audit: AuditSQL
    registry: RegistrySQL
    policy: PolicySQL
    outbox: OutboxSQL
    archive: ArchiveSQL

    #: How this database's effect log finds what is in flight (a cursor on SQLite, an index on PostgreSQL).
    _effects_class: type[EffectsSQL] = EffectsSQL

    def __init__(self, url: str | None = None, *, schema: str | None = None, pool_size: int = 5) -> None:
        super().__init__(url, schema=schema, pool_size=pool_size)
        # Each repository receives what it uses and nothing more: the store, and the other repositories whose rows
        # it writes in its own transactions (through their ``*_in`` methods).
        self.outbox = OutboxSQL(self)
        self.audit = AuditSQL(self, outbox=self.outbox)
        self.sessions = SessionsSQL(self, audit=self.audit, outbox=self.outbox)
        self.undo = UndoSQL(self)
        self.effects = self._effects_class(self, sessions=self.sessions, undo=self.undo, audit=self.audit)
        self.recovery = RecoverySQL(self, effects=self.effects, undo=self.undo, sessions=self.sessions,
                                    audit=self.audit)
        self.owners = OwnersSQL(self)
        self.policy = PolicySQL(self, audit=self.audit)
        self.approvals = ApprovalsSQL(self, audit=self.audit, policy=self.policy, halt_in=self.sessions.halt_in,
                                      refresh_changes_in=self.sessions.refresh_changes_in,
                                      await_approval_in=self.sessions.await_approval_in)
        self.registry = RegistrySQL(self, cancel_request_in=self.approvals.cancel_request_in,
                                    refresh_changes_in=self.sessions.refresh_changes_in)
        self.archive = ArchiveSQL(self, audit=self.audit)

    def schema_revision(self) -> str | None:
        """The database's migration revision (None: no UndoLog tables yet)."""
        from . import migrate as _migrate  # Alembic is imported only by what migrates or checks revisions

        return _migrate.current(self.engine)

    @staticmethod
    def head_revision() -> str:
        """The revision this code migrates to."""
        from . import migrate as _migrate

        return _migrate.head()

    def where(self) -> str:
        """The database for messages: its URL without the password, and the schema if one is set."""
        return safe_url(self.url) + (f" (schema {self.schema})" if self.schema else "")

    def __new__(cls, url: str | None = None, *, schema: str | None = None, pool_size: int = 5) -> Storage:
        # ``Storage(url)`` is the storage of that database: one implementation per database (DBOS's shape).
        if cls is Storage:
            cls = SQLiteStorage if resolve_url(url).startswith("sqlite") else PostgresStorage
        return super().__new__(cls)

    def hot_path(self, *, pool_size: int, fast_pool_size: int) -> HotPath:
        """The COMPENSABLE pre-write and commit mark on raw connections of their own."""
        raise ConfigurationError(f"no hot path for {self.dialect}")


class SQLiteEffects(EffectsSQL):
    """SQLite's effect log: one writer, so ids become visible in order, and recovery reads what was written since
    its cursor."""

    def back_in_flight_in(self, conn: Connection, seq: int) -> None:
        sqlite.back_in_flight_in(conn, seq)

    def effects_in_flight_in(self, conn: Connection) -> tuple[list[Any], tuple[Any, int] | None]:
        # SQLite has one writer, so ids become visible in order: what was written since the cursor is all that
        # can be in flight (the one way back, a claim, moves the cursor back in its own transaction).
        cursor, newest = sqlite.cursor_in(conn)
        effects = list(conn.execute(self.in_flight_q().where(schema.effect_log.c.seq > cursor.effect_seq)).all())
        # Everything up to the oldest effect still in flight (or up to the newest row) has been seen settled.
        return effects, (cursor, effects[0].seq - 1 if effects else newest)

    def advance_cursor(self, cursor: Any, upto: int) -> None:
        if upto > cursor.effect_seq:
            with self._store.tx() as conn:
                sqlite.advance_cursor_in(conn, cursor, upto)


class PostgresEffects(EffectsSQL):
    """PostgreSQL's effect log: a partial index holds exactly the effects in flight."""

    def back_in_flight_in(self, conn: Connection, seq: int) -> None:
        return None  # the partial index finds it again by its state

    def effects_in_flight_in(self, conn: Connection) -> tuple[list[Any], tuple[Any, int] | None]:
        return list(conn.execute(self.in_flight_q()).all()), None

    def advance_cursor(self, cursor: Any, upto: int) -> None:
        return None


class SQLiteStorage(Storage):
    """A SQLite file: one writer (queued on an in-process lock), the hot path's pre-write one statement (a view's
    trigger writes the effect and its undo entry), recovery reading what was written since its cursor."""

    _effects_class = SQLiteEffects

    def hot_path(self, *, pool_size: int, fast_pool_size: int) -> HotPath:
        return sqlite.SQLiteHotPath(self, pool_size=pool_size, fast_pool_size=fast_pool_size)


class PostgresStorage(Storage):
    """PostgreSQL through psycopg 3: the pre-write as one CTE statement, row locks (``FOR UPDATE SKIP LOCKED``)
    for claims, a partial index holding exactly the effects in flight."""

    _effects_class = PostgresEffects

    def hot_path(self, *, pool_size: int, fast_pool_size: int) -> HotPath:
        return postgres.PostgresHotPath(self, pool_size=pool_size, fast_pool_size=fast_pool_size)


def open_storage(url: str | None = None, *, schema: str | None = None, pool_size: int = 5) -> Storage:
    """The storage on ``url`` (default ``$UNDOLOG_DATABASE_URL``, else ``./undolog.db``); not migrated yet.

    Example:
        >>> storage = open_storage("postgresql+psycopg://u@db/agents", schema="undolog")
    """
    return Storage(url, schema=schema, pool_size=pool_size)


def safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL we cannot parse is shown as given
        return url


def sqlite_file(url: str) -> str | None:
    """The file a ``sqlite:///`` URL names (None for another database or a URL without one)."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL at all
        return None
    return parsed.database if parsed.get_backend_name() == "sqlite" else None


def database_error_detail(exc: BaseException) -> str:
    """One line saying what the database driver reported."""
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {detail[0] if detail else ''}"


__all__ = [
    "PostgresStorage",
    "SQLiteStorage",
    "DATABASE_ERRORS",
    "ApprovalsSQL",
    "ArchiveSQL",
    "AuditSQL",
    "GcBatch",
    "EffectsSQL",
    "InFlight",
    "OutboxSQL",
    "PolicySQL",
    "RecoverySQL",
    "RegistrySQL",
    "OwnersSQL",
    "PostgresEffects",
    "SQLiteEffects",
    "SessionsSQL",
    "Storage",
    "Store",
    "UndoSQL",
    "database_error_detail",
    "open_storage",
    "safe_url",
    "sqlite_file",
]
