"""Alembic environment of the server's own tables (see ``undolog_server.storage.migrate``).

A branch of its own, with its own version table, so the core's migrations and its "database is at head"
check never depend on whether the server is installed.
"""

from alembic import context

from undolog_server.storage import SERVER_VERSION_TABLE, metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=SERVER_VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
