"""Benchmarks: each prints one JSON object with what it measured (no timed assertions)."""
