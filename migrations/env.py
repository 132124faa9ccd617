"""Alembic environment for atomd's SQLite database.

``atomd.db.migrate`` hands over an open connection in ``config.attributes["connection"]``.
Developers may run ``alembic`` from the checkout instead; the database is then
``-x db=PATH`` or the ``sqlalchemy.url`` in ``alembic.ini``.
"""

from __future__ import annotations

from logging.config import fileConfig
from pathlib import Path
from typing import Any, Literal

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.engine import make_url

from atomd.db.connection import make_sync_engine
from atomd.db.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    # Generated migrations must not import atomd's models, which change after them.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _migrate(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table instead.
        render_as_batch=True,
        # make_sync_engine BEGINs before DDL too, so a failed migration rolls back whole.
        transactional_ddl=True,
        compare_type=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def _db_path() -> Path:
    db = context.get_x_argument(as_dictionary=True).get("db")
    if db:
        return Path(db)
    url = config.get_main_option("sqlalchemy.url")
    if not url or not make_url(url).database:
        raise SystemExit("give the database: alembic -x db=PATH ... (or sqlalchemy.url)")
    return Path(make_url(url).database or "")


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    # Only the alembic CLI configures logging: from code it would clobber the daemon's.
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    engine = make_sync_engine(_db_path())
    try:
        with engine.connect() as conn:
            _migrate(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    # Batch migrations reflect the live table, which an SQL script cannot do.
    raise SystemExit("atomd's migrations run online only; drop --sql")
run_migrations_online()
