"""Every statement UndoLog issues, behind one interface, one implementation per database.

``Storage`` composes one mixin per service (``approvals``, ``audit``, ``registry``, ``policy``, ``sessions``,
``calls``, ``saga``, ``recovery``) over ``Store`` (engines, ``tx()``, ``read()``, ``for_update()``, ``is_postgres``);
the engine, the saga, recovery and the other services hold no SQL of their own. Each method is one unit of work:
it opens its own transaction, or, named ``*_in(conn, ...)``, joins the caller's. The services' methods return
records (``storage.records``) or plain dicts. The hot path's two statements (the pre-write and the commit mark)
are written per database. ``tests/conformance`` is the contract every database's implementation must pass.

Example:
    >>> storage = open_storage("sqlite:///undolog.db")
    >>> storage.migrate()
    >>> storage.get_policy().approval_timeout_seconds
    3600
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from .approvals import ApprovalsSQL
from .audit import AuditSQL
from .base import Store
from .calls import CallsSQL
from .outbox import OutboxSQL
from .policy import PolicySQL
from .recovery import InFlight, RecoverySQL
from .registry import RegistrySQL
from .saga import SagaSQL
from .sessions import SessionsSQL

#: The exceptions a database (not UndoLog) raises: unreachable server, missing schema, locked file...
DATABASE_ERRORS: tuple[type[Exception], ...] = (sa_exc.SQLAlchemyError,)


class Storage(ApprovalsSQL, AuditSQL, RegistrySQL, PolicySQL, SessionsSQL, RecoverySQL, SagaSQL, CallsSQL, OutboxSQL,
              Store):
    """The store of one database: engines and pools (``Store``) with every service's statements."""

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
    "DATABASE_ERRORS",
    "ApprovalsSQL",
    "AuditSQL",
    "CallsSQL",
    "InFlight",
    "PolicySQL",
    "RecoverySQL",
    "RegistrySQL",
    "SagaSQL",
    "SessionsSQL",
    "Storage",
    "Store",
    "database_error_detail",
    "open_storage",
    "safe_url",
    "sqlite_file",
]
