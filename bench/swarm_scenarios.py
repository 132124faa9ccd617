"""What the swarm benchmark runs: the task every daemon trains (``Task``), the scenarios
(``Scenario``), the fault a scenario strikes a peer with (``Fault``) and what one scenario's
loop sees (``ScenarioRecord``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atomd_bench.sync_runs import BATCH, LR, PEERS, PRESET, SEED, STEPS, VAL_BATCHES, WARMUP


@dataclass(frozen=True)
class Task:
    """What every run trains (bench sync's task unless ``--quick``)."""

    peers: int = PEERS
    steps: int = STEPS
    batch: int = BATCH
    seq_len: int | None = None  # the preset's 128
    eval_batches: int = VAL_BATCHES
    every: int | str = "auto"
    sync: dict[str, Any] = field(default_factory=dict)  # more of the job's sync settings
    idle_s: float = 10.0  # membership measured while the swarm idles
    restart_after_s: float = 20.0
    deadline_s: float = 3600.0  # per scenario, and for the references
    tcp_congestion: str | None = None  # the daemons' ATOMD_TCP_CONGESTION; None: their default

    def spec(self, batch: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "preset": PRESET,
            "micro_batch_size": batch,
            "max_steps": self.steps,
            "lr": LR,
            "warmup_steps": min(WARMUP, self.steps // 4),
            "eval_batches": self.eval_batches,
            "seed": SEED,
        }
        if self.seq_len is not None:
            spec["seq_len"] = self.seq_len
        return spec


# A smoke test (a few minutes): long enough that the peers that join after the first still
# train most of the job alongside it.
QUICK = Task(
    peers=3, steps=150, batch=8, seq_len=64, eval_batches=2, idle_s=3.0, restart_after_s=5.0,
    deadline_s=600.0,
)  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    name: str
    upload_kbit: int | None = None
    # What befalls the last peer at 40 % of its steps, undone restart_after_s later: "sigkill"
    # (restarted), "sigstop" (continued), "partition" (its link cut: it trains on alone).
    fault: str | None = None

    @property
    def needs_namespaces(self) -> bool:
        return self.upload_kbit is not None or self.fault == "partition"


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("unlimited"),
        Scenario("upload-1mbit", upload_kbit=1000),
        Scenario("upload-256kbit", upload_kbit=256),
        Scenario("sigkill", fault="sigkill"),
        Scenario("sigstop", fault="sigstop"),
        Scenario("partition", fault="partition"),
    )
}


FAULT_AT = 0.4  # the share of its steps at which the victim's fault comes (``Scenario.fault``)


@dataclass
class Fault:
    """The victim's fault (``Scenario.fault``), struck at ``at_step`` and undone after
    ``Task.restart_after_s``."""

    victim: int
    at_step: int
    how: str = "sigkill"
    killed_at: float | None = None
    killed_step: int | None = None
    restarted_at: float | None = None
    resumed_from: int | None = None


@dataclass
class ScenarioRecord:
    """What one scenario's loop saw, for its report."""

    job_id: str = ""
    started: float = 0.0
    ended: float = 0.0
    finished: dict[int, float] = field(default_factory=dict)
    timed_out: bool = False
    fault: Fault | None = None
