"""Migration scripts, one revision per file, each with a working ``downgrade``."""
