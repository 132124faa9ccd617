"""Schema migrations, run from code: ``upgrade``, ``downgrade``, ``current_revision``.

Blocking; the daemon calls them through ``asyncio.to_thread``. The Alembic environment is the
``migrations/`` folder (the package ``atomd_migrations`` once installed), found beside the
``atomd`` package, so no ``alembic.ini`` is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text

import atomd
from atomd.db.connection import make_sync_engine
from atomd.errors import AtomdError
from atomd.logs import get_logger

log = get_logger(__name__)


def migrations_dir() -> Path:
    """The folder holding ``env.py`` and ``versions/``: beside the ``atomd`` package (in a
    checkout and in site-packages alike), found by path rather than by the import name
    ``atomd_migrations`` (in a checkout the folder is ``migrations/``)."""
    root = Path(atomd.__file__).resolve().parent.parent
    beside = [root / name for name in ("atomd_migrations", "migrations")]
    found = [p for p in beside if (p / "env.py").is_file()]
    path = found[0] if found else Path(str(files("atomd_migrations")))
    if not (path / "env.py").is_file():
        raise AtomdError(f"the migrations package at {path} has no env.py; reinstall atomd")
    return path


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return cfg


def _run(db_path: Path, step: Callable[[Config, str], None], revision: str) -> None:
    cfg = _config()
    engine = make_sync_engine(db_path)
    try:
        # One transaction for the whole run: env.py migrates over this connection, so a
        # failure anywhere leaves the database at the revision it started from.
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, revision)
            # Foreign keys are off while migrating; make sure no migration broke them.
            broken = conn.execute(text("PRAGMA foreign_key_check")).fetchall()
            if broken:
                raise AtomdError(
                    f"migrating {db_path} to {revision} would break {len(broken)} foreign "
                    f"keys, first (table, rowid, parent, fk): {tuple(broken[0])}"
                )
    finally:
        engine.dispose()


def upgrade(db_path: Path, revision: str = "head") -> None:
    """Migrate ``db_path`` up to ``revision``; creates the file and its folder, no-op at head."""
    before = current_revision(db_path)
    _run(db_path, command.upgrade, revision)
    after = current_revision(db_path)
    if after != before:
        log.info("migrated %s from %s to %s", db_path, before or "empty", after)


def downgrade(db_path: Path, revision: str) -> None:
    """Migrate ``db_path`` down to ``revision`` (``"base"`` drops every table)."""
    before = current_revision(db_path)
    _run(db_path, command.downgrade, revision)
    log.info("migrated %s down from %s to %s", db_path, before, current_revision(db_path) or "base")


def current_revision(db_path: Path) -> str | None:
    """The revision ``db_path`` is at; ``None`` if it is empty or does not exist yet."""
    if not db_path.exists():
        return None
    engine = make_sync_engine(db_path)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest revision this atomd ships."""
    head = ScriptDirectory.from_config(_config()).get_current_head()
    if head is None:
        raise AtomdError(f"no migrations found in {migrations_dir()}")
    return head
