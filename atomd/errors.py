"""The one exception tree of atomd. Only ``api/`` maps these to HTTP status codes."""

from __future__ import annotations


class AtomdError(Exception):
    """Base of every error atomd raises on purpose; the message is meant for the user."""


class ConfigError(AtomdError):
    """A setting, flag or job spec is invalid."""


class DataError(AtomdError):
    """A dataset cannot be found, read or used as asked."""


class CheckpointError(AtomdError):
    """A checkpoint is missing, corrupt, truncated or does not fit the model."""


class TrainingError(AtomdError):
    """Training cannot continue (for example the loss became NaN)."""
