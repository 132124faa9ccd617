"""What the repository's functions share: a job's row, and a check of an enumerated value."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from atomd.db.models import (
    Job,
)
from atomd.errors import NotFoundError

# Rows one retention call deletes or looks at (``prune_rounds``, ``thin_progress``): a few
# milliseconds of SQLite each, so the daemon's other writers wait no longer than that.
PRUNE_BATCH = 5000


async def job_row(s: AsyncSession, job_id: str) -> Job:
    job = await s.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job {job_id!r}")
    return job


def check_allowed(what: str, value: str, allowed: tuple[str, ...]) -> None:
    # The database has a CHECK too; this names the allowed values instead of "constraint failed".
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")
