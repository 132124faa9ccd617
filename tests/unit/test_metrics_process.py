"""/metrics of the control app: the process's own metrics and the build info, besides the
daemon's, although the daemon keeps its metrics in a registry of its own."""

from __future__ import annotations

import os
import platform
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from atomd import __version__
from atomd.telemetry import Telemetry
from tests.unit.conftest import Factory


@pytest.fixture
async def metrics_text(make_client: Factory) -> str:
    """The body of GET /metrics from a control app with its own job manager and telemetry."""
    client = await make_client(started=False)
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of every sample in a Prometheus text exposition."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_metrics_carry_the_process_metrics(metrics_text: str) -> None:
    samples = _samples(metrics_text)
    ((_, cpu),) = samples["process_cpu_seconds_total"]
    ((_, rss),) = samples["process_resident_memory_bytes"]
    ((_, fds),) = samples["process_open_fds"]
    ((_, start),) = samples["process_start_time_seconds"]
    assert cpu > 0
    assert rss > 10 * 2**20  # this process has torch loaded: far more than 10 MiB
    assert 3 <= fds <= len(os.listdir("/proc/self/fd")) + 100
    assert 0 < start <= time.time()


def test_metrics_carry_the_build_info(metrics_text: str) -> None:
    ((labels, value),) = _samples(metrics_text)["atomd_build_info"]
    assert value == 1
    assert labels == {
        "version": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
    }


def test_the_daemons_own_metrics_are_still_there(metrics_text: str) -> None:
    samples = _samples(metrics_text)
    assert "atomd_job_step" in samples and "atomd_tokens_trained_total" in samples


def test_two_daemons_in_one_process_each_have_the_process_metrics() -> None:
    """Each daemon's registry holds its own collectors: a second one registers without clash."""
    first, second = Telemetry(), Telemetry()
    for telemetry in (first, second):
        samples = _samples(telemetry.render().decode())
        assert "process_resident_memory_bytes" in samples and "atomd_build_info" in samples
