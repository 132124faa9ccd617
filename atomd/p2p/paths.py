"""The peer plane's paths, defined once: the server routes and the client calls use these.

Route templates (``JOB_STOP`` ...) are for FastAPI; the functions fill them in for a client.
"""

from __future__ import annotations

PREFIX = "/p2p/v1"

INFO = f"{PREFIX}/info"
PING = f"{PREFIX}/ping"
PING_REQ = f"{PREFIX}/ping-req"
JOIN = f"{PREFIX}/join"
LEAVE = f"{PREFIX}/leave"
ANNOUNCE = f"{PREFIX}/jobs/announce"
JOB_STOP = f"{PREFIX}/jobs/{{job_id}}/stop"
JOB_DELTAS = f"{PREFIX}/jobs/{{job_id}}/deltas"
JOB_STATE = f"{PREFIX}/jobs/{{job_id}}/state"
JOB_STATE_FILE = f"{PREFIX}/jobs/{{job_id}}/state/{{step}}/{{name}}"
JOB_PROGRESS = f"{PREFIX}/jobs/{{job_id}}/progress"


def job_stop(job_id: str) -> str:
    return JOB_STOP.format(job_id=job_id)


def job_deltas(job_id: str) -> str:
    return JOB_DELTAS.format(job_id=job_id)


def job_state(job_id: str) -> str:
    return JOB_STATE.format(job_id=job_id)


def job_state_file(job_id: str, step: int, name: str) -> str:
    return JOB_STATE_FILE.format(job_id=job_id, step=step, name=name)


def job_progress(job_id: str) -> str:
    return JOB_PROGRESS.format(job_id=job_id)
