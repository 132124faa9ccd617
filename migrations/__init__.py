"""atomd's Alembic environment (SQLite, batch mode); ``atomd.db.migrate`` runs it."""
