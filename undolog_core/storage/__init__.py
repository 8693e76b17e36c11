"""Every statement UndoLog issues, behind one interface, one implementation per database.

``Storage`` is composed of one part per service (calls, saga, recovery, ...), each holding that service's SQL;
the engine, the saga, recovery and the other services hold no SQL of their own. The hot path's two statements
(the pre-write and the commit mark) are written per database. ``tests/conformance`` is the contract every
database's implementation must pass.

Example:
    >>> from undolog_core.storage import open_storage
    >>> store = open_storage("sqlite:///undolog.db")
    >>> store.migrate()
"""

from __future__ import annotations

from .._store import Store
from .calls import CallsSQL
from .outbox import OutboxSQL
from .recovery import InFlight, RecoverySQL
from .saga import SagaSQL


class Storage(RecoverySQL, SagaSQL, CallsSQL, OutboxSQL, Store):
    """The store of one database: engines and pools (``Store``) with every service's statements."""


def open_storage(url: str | None = None, *, schema: str | None = None, pool_size: int = 5) -> Storage:
    """A ``Storage`` for ``url`` (SQLite file or PostgreSQL through psycopg 3); not migrated yet."""
    return Storage(url, schema=schema, pool_size=pool_size)


__all__ = ["InFlight", "Storage", "open_storage"]
