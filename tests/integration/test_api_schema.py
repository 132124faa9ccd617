"""Property-based check of the control API against its own OpenAPI schema (schemathesis),
on a real daemon: no 5xx, no undocumented status code, bodies match the documented schemas,
and invalid input is rejected."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from atomd.launch import DaemonProcess

TOKEN = "schema-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("schema") / "d0", env={"ATOMD_CONTROL_TOKEN": TOKEN})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def api_schema(daemon: DaemonProcess) -> Any:
    # The schema needs the token too when one is set (issue #15).
    return schemathesis.openapi.from_url(
        daemon.url + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}
    )


def _keep_jobs_cheap(body: Any) -> None:
    """Accepted jobs really train: keep them to the tiny model on the bundled data, so the
    fuzz exercises the API rather than this machine's two cores (and never scans '/')."""
    if isinstance(body, dict):
        for key in ("preset", "data", "micro_batch_size", "eval_batches", "seq_len"):
            body.pop(key, None)
        body.update(micro_batch_size=2, eval_batches=1, seq_len=16)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_api_conforms_to_its_schema(
    api_schema: Any, daemon: DaemonProcess, mode: GenerationMode
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    operations = _operations(api_schema)
    assert len(operations) >= 10  # every route is documented

    # schemathesis's pytest plugin does not run under this pytest; drive its strategies here.
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        op = data.draw(st.sampled_from(operations))
        case = data.draw(op.as_strategy(generation_mode=mode))
        if mode is GenerationMode.POSITIVE and case.method == "POST" and case.path == "/v1/jobs":
            _keep_jobs_cheap(case.body)
        case.call_and_validate(base_url=daemon.url, headers=auth, checks=CHECKS)
        # Do not let a fuzzed job run on: stop whatever is active.
        with httpx.Client(base_url=daemon.url, headers=auth) as c:
            job = c.get("/v1/status").json().get("job")
            if job and job["state"] in ("pending", "running"):
                c.post(f"/v1/jobs/{job['id']}/stop")

    check()
