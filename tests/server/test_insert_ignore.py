"""The desk's idempotent fan-out insert counts the rows it inserted on both databases.

Failed before on PostgreSQL: psycopg reports rowcount -1 for ``INSERT ... ON CONFLICT DO NOTHING`` there, so
``insert_ignore`` counted -1 per row and ``ServerStore.escalate_once`` always said it had escalated.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from undolog_server.storage import insert_ignore

pytestmark = pytest.mark.storage


def test_insert_ignore_counts_what_it_inserted_and_skips_collisions(db: Any) -> None:
    u = db.open()
    engine = u.store.engine
    meta = sa.MetaData(schema=db.schema)
    table = sa.Table("t_insert_ignore", meta, sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                     sa.Column("k", sa.String(20), nullable=False, unique=True))
    meta.create_all(engine)
    with engine.begin() as conn:
        assert insert_ignore(conn, table, [{"k": "a"}, {"k": "b"}]) == 2
    with engine.begin() as conn:
        assert insert_ignore(conn, table, [{"k": "a"}, {"k": "c"}]) == 1
        assert insert_ignore(conn, table, [{"k": "c"}]) == 0
        assert insert_ignore(conn, table, []) == 0
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(table.c.k)).scalars()) == ["a", "b", "c"]
