"""The swarm jobs the delta exchange serves on this daemon: each one's plugin and model size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atomd.model.config import num_parameters
from atomd.spec import JobSpec

if TYPE_CHECKING:  # torch loads with the first swarm job, not when the daemon starts
    from atomd.sync.runner import SyncPlugin


class JobTable:
    """Per job: its trainer-thread plugin (once attached to the exchange) and its model's
    parameter count (known from the spec, before the model is built, to bound its frames)."""

    def __init__(self) -> None:
        self.plugins: dict[str, SyncPlugin] = {}
        self._numel: dict[str, int] = {}

    def expect(self, job_id: str, spec: JobSpec) -> None:
        """``job_id`` is about to train here: its frames are bounded from now on."""
        self._numel[job_id] = num_parameters(spec.model_shape)

    def expected(self, job_id: str) -> bool:
        """Whether ``job_id`` is expected or trains here."""
        return job_id in self._numel

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        self.plugins.pop(job_id, None)
        self._numel.pop(job_id, None)

    def model_bytes(self, job_id: str) -> int:
        """The job's model as fp32 bytes (0 when it does not train here)."""
        return self._numel.get(job_id, 0) * 4

    def max_frame_bytes(self, job_id: str) -> int:
        """The largest frame accepted for ``job_id`` (0: not training it here)."""
        raw = self.model_bytes(job_id)
        if raw == 0:
            return 0
        # Every codec is at most fp32-sized; headroom for framing and the header.
        return int(raw * 1.05) + (2 << 20)

    def codec(self, job_id: str) -> str:
        """The delta codec of a job this daemon trains ("?" once it no longer does)."""
        plugin = self.plugins.get(job_id)
        return plugin.spec.codec if plugin else "?"

    def max_staleness(self, job_id: str) -> int | None:
        """The job's max_staleness (None once it no longer trains here)."""
        plugin = self.plugins.get(job_id)
        return plugin.spec.max_staleness if plugin is not None else None
