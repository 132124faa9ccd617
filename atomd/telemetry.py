"""Prometheus metrics of one daemon (its own registry, so several daemons can share a process).

Besides the daemon's own metrics, the registry carries the process's (``process_*``: CPU
seconds, resident memory, open file descriptors, start time) and ``atomd_build_info``, whose
labels name the versions of atomd, Python, torch and CUDA that run it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import platform
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from atomd import __version__

JOB_STATES = ["none", "pending", "running", "stopping", "stopped", "finished", "failed"]


def torch_build() -> tuple[str, str]:
    """torch's version and the CUDA version it was built with (``none``: without CUDA), read
    from its installed ``torch/version.py`` rather than by importing torch, which takes seconds
    and which the control plane never needs."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none", "none"
    values: dict[str, object] = {}
    try:
        tree = ast.parse(Path(str(dist.locate_file("torch/version.py"))).read_text())
    except (OSError, SyntaxError):
        return dist.version, "unknown"
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    return str(values.get("__version__", dist.version)), str(values.get("cuda") or "none")


def build_labels() -> dict[str, str]:
    """The versions this daemon runs with; ``cuda`` is ``none`` for a torch built without it."""
    torch_version, cuda = torch_build()
    return {
        "version": __version__,
        "python": platform.python_version(),
        "torch": torch_version,
        "cuda": cuda,
    }


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The default registry's process collector is not in this one: register it here.
        ProcessCollector(registry=r)
        labels = build_labels()
        self.build_info = Gauge(
            "atomd_build_info", "Versions this daemon runs with (always 1)", list(labels),
            registry=r,
        )  # fmt: skip
        self.build_info.labels(**labels).set(1)
        # The newest job's: NaN from its launch until it reports (never the job before's).
        job = {
            "step": "Optimizer steps done by the newest job (NaN before it reports)",
            "loss": "Training loss (nats/token) of the newest job's last step",
            "val_loss": "The newest job's last validation loss (nats/token)",
            "tokens_per_second": "Training throughput (0 while no job trains)",
        }
        self.step, self.loss, self.val_loss, self.tokens_per_s = (
            Gauge(f"atomd_job_{name}", text, registry=r) for name, text in job.items()
        )
        self.tokens = Counter("atomd_tokens_trained", "Tokens trained by this daemon", registry=r)
        self.job_state = Enum(
            "atomd_job_state", "State of the current job", states=JOB_STATES, registry=r
        )
        self.bytes_sent = Counter("atomd_sync_sent_bytes", "Delta bytes sent to peers", registry=r)
        self.bytes_received = Counter(
            "atomd_sync_received_bytes", "Delta bytes received from peers", registry=r
        )
        self.rounds = Counter(
            "atomd_sync_rounds", "Sync rounds", ["direction", "applied"], registry=r
        )
        # Where a round's time goes on a slow link: each upload until its answer, the round's
        # whole traffic time, which the automatic cadence spaces rounds by, and on the receiving
        # side how long its checks of each frame held the answer.
        seconds = (0.01, 0.03, 0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
        self.upload_seconds = Histogram(
            "atomd_sync_upload_seconds", "One delta frame to one peer, until its answer",
            buckets=seconds, registry=r,
        )  # fmt: skip
        self.round_traffic_seconds = Histogram(
            "atomd_sync_round_traffic_seconds",
            "A round's frame from the trainer's hand-off to the last peer's answer",
            buckets=seconds, registry=r,
        )  # fmt: skip
        self.answer_held_seconds = Histogram(
            "atomd_sync_answer_held_seconds",
            "A delta upload received: from its whole body to this daemon's answer (the checks)",
            buckets=seconds, registry=r,
        )  # fmt: skip
        self.peers_alive = Gauge("atomd_peers_alive", "Peers currently alive", registry=r)
        self.checkpoints = Counter("atomd_checkpoints_written", "Checkpoints written", registry=r)
        self.job_state.state("none")

    def job_launched(self) -> None:
        """A job launches: the gauges stop showing the job before's values."""
        for gauge in (self.step, self.loss, self.val_loss):
            gauge.set(float("nan"))
        self.tokens_per_s.set(0)
        self.job_state.state("pending")

    def job_ended(self) -> None:
        """The job's trainer has returned: its last values stay, but nothing trains now."""
        self.tokens_per_s.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
