"""Alembic environment: always driven programmatically with a live connection (see storage/migrate.py.py)."""

from alembic import context

from undolog_core.storage.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table="undolog_alembic_version",
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
