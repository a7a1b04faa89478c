"""Alembic environment. Run through gateway.db.migrate, which passes an open connection in
`config.attributes["connection"]`; with the alembic command line, `sqlalchemy.url` is used."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from alembic import context

from gateway.db.database import make_database
from gateway.db.schema import metadata

config = context.config


def _configure(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations(connection: sa.Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_url(url: str) -> None:
    engine = make_database(url)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
elif (connection := config.attributes.get("connection")) is not None:
    run_migrations(connection)
else:
    asyncio.run(_run_with_url(config.get_main_option("sqlalchemy.url") or ""))
