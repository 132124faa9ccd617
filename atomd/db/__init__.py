"""atomd's records: SQLite through async SQLAlchemy, schema migrations by Alembic.

``connection`` opens the database, ``migrate`` brings its schema to head, ``repo`` reads and
writes it, returning the frozen records of ``schemas``; ``models`` maps the tables.
"""
