"""The one exception tree of atomd. Only ``api/`` maps these to HTTP status codes."""

from __future__ import annotations


class AtomdError(Exception):
    """Base of every error atomd raises on purpose; the message is meant for the user."""


class NotFoundError(AtomdError):
    """A job, peer or other record asked for by id does not exist."""


class ConfigError(AtomdError):
    """A setting, flag or job spec is invalid."""


class DataError(AtomdError):
    """A dataset cannot be found, read or used as asked."""


class CheckpointError(AtomdError):
    """A checkpoint is missing, corrupt, truncated or does not fit the model."""


class DonorStateError(CheckpointError):
    """A state taken from another peer evaluates far worse than it should: not trained on.
    ``step``: the step of its checkpoint."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class TrainingError(AtomdError):
    """Training cannot continue (for example the loss became NaN)."""


class SwarmMovedOnError(TrainingError):
    """The swarm has closed more rounds than this peer can still merge (it was stopped, asleep
    or cut off meanwhile): what it missed would part its model from theirs for good, so the job
    takes the swarm's state again (``JobManager``). ``step``: where this peer stopped; its
    checkpoint of that step is where it goes on if no peer's state can be fetched."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class SwapError(AtomdError):
    """The swapping engine cannot run as asked (for example the model does not fit its slots)."""


class PlanError(SwapError):
    """No swap plan fits the device-memory budget; the message says what would."""


class JobConflictError(AtomdError):
    """The request conflicts with the daemon's state (a job already runs, or is not active)."""


class UnauthorizedError(AtomdError):
    """A request lacks valid credentials (bearer token, peer signature)."""


class PeerAuthError(AtomdError):
    """A peer-plane request failed authentication (401) or admission to the swarm (403)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class MessageError(AtomdError):
    """A peer-plane message that does not fit its model (a field missing, out of range, of the
    wrong type, or unknown); the message names the field and the reason."""


class TooLargeError(AtomdError):
    """A request body over its route's limit; refused before (or while) it is read."""


class RateLimitedError(AtomdError):
    """Too many refused requests from one source: it must wait ``retry_after_s`` seconds."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PeerRequestError(AtomdError):
    """A request to another daemon's peer plane failed: unreachable, timed out or non-2xx.

    ``status`` is the peer's HTTP status, or None when no response came back."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class WireError(AtomdError):
    """A delta frame or tensor payload is refused; it never touches a model.

    ``reason`` is a short machine code for records and metrics: oversize, truncated, bad_hash,
    bad_signature, unknown_sender, stale, replayed, wrong_shape, non_finite, malformed,
    wrong_job, wrong_codec or unsupported_version. The message says what was expected."""

    MAX_MESSAGE = 1000

    def __init__(self, reason: str, message: str = "") -> None:
        # Some messages quote what the sender sent (tensor names, shapes): a frame of a few
        # hundred bytes listed a thousand 900-character names, and the refusal written to the
        # rounds' records and answered was 2,800x its size.
        if len(message) > self.MAX_MESSAGE:
            message = message[: self.MAX_MESSAGE - 3] + "..."
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason


class SpecError(ConfigError):
    """A job spec is valid in form but cannot run here; ``field`` names the culprit."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field
