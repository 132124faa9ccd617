from __future__ import annotations

import itertools
import re

import pytest
from pydantic import BaseModel, ValidationError

from atomd.spec import (
    FREQUENT_MOMENTUM,
    JOB_SPEC_GROUPS,
    OUTER_MOMENTUM,
    REMOVED_SYNC_OPTIONS,
    JobSpec,
    SyncSpec,
    job_spec_group,
    lr_at,
)


def test_minimal_spec_is_valid() -> None:
    spec = JobSpec.model_validate({"preset": "tiny"})
    assert spec.effective_seq_len == 128
    assert spec.effective_lr == 3e-3
    assert spec.total_steps == 600


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"preset": "nope"}, "preset"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"lr": -1}, "lr"),
        ({"typo_field": 1}, "typo_field"),
        ({"shard_mode": "random"}, "shard_mode"),
        # pydantic alone reads false as 0 and true as 1 (schemathesis found the first)
        ({"swap_graph_blocks": False}, "swap_graph_blocks"),
        ({"micro_batch_size": True}, "micro_batch_size"),
        ({"lr": True}, "lr"),
        ({"sync": {"every": True}}, "sync.every"),
        ({"sync": {"zstd": 1}}, "sync.zstd"),
    ],
)
def test_invalid_fields_are_named(body: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        JobSpec.model_validate(body)
    assert any(field in ".".join(map(str, err["loc"])) for err in e.value.errors())


def test_cross_field_checks() -> None:
    with pytest.raises(ValidationError, match="exceeds"):
        JobSpec(seq_len=4096)
    with pytest.raises(ValidationError, match="stop condition"):
        JobSpec(max_steps=None)
    with pytest.raises(ValidationError, match="num_shards"):
        JobSpec(shard_index=2, num_shards=2)
    for name in ("swap_resident_blocks", "swap_graph_blocks"):  # tiny has 4 blocks
        with pytest.raises(ValidationError, match=f"{name} 5 exceeds the 4 blocks"):
            JobSpec(preset="tiny", **{name: 5})
        assert getattr(JobSpec(preset="tiny", **{name: 4}), name) == 4


def test_max_tokens_bounds_the_schedule() -> None:
    spec = JobSpec(max_steps=None, max_tokens=10_000, micro_batch_size=4, seq_len=32)
    assert spec.total_steps == 79  # ceil(10000 / 128)
    assert JobSpec(max_steps=50, max_tokens=10**9).total_steps == 50


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    spec = JobSpec(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(spec, 0) == pytest.approx(0.1)
    assert lr_at(spec, 9) == pytest.approx(1.0)
    assert lr_at(spec, 60) == pytest.approx(0.55)
    assert lr_at(spec, 110) == pytest.approx(0.1)
    lrs = [lr_at(spec, s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_booleans_stay_booleans() -> None:
    spec = JobSpec.model_validate({"sync": {"zstd": False}, "swap_graph_blocks": 0})
    assert spec.sync is not None and spec.sync.zstd is False
    assert spec.swap_graph_blocks == 0


def test_outer_momentum_defaults_by_codec_and_cadence_and_shows_in_the_spec() -> None:
    assert SyncSpec().codec == "topk" and SyncSpec().every == "auto"
    # Frequent rounds (the automatic cadence, or H of 2-5): top-k's momentum for them.
    assert SyncSpec().outer_momentum == FREQUENT_MOMENTUM["topk"] > OUTER_MOMENTUM["topk"] > 0
    assert SyncSpec(every=3).outer_momentum == FREQUENT_MOMENTUM["topk"]
    for every in (1, 10, 50):
        assert SyncSpec(every=every).outer_momentum == OUTER_MOMENTUM["topk"]
    for codec in ("fp32", "bf16", "int8"):
        assert SyncSpec(codec=codec).outer_momentum == 0.0
    assert SyncSpec(codec="topk", outer_momentum=0.0).outer_momentum == 0.0  # explicit wins
    # What the daemon stores (model_dump) reads back the same, whatever the default becomes.
    stored = JobSpec.model_validate({"sync": {"every": 50}}).model_dump()
    assert stored["sync"]["outer_momentum"] == OUTER_MOMENTUM["topk"]
    again = JobSpec.model_validate({**stored, "sync": {**stored["sync"], "every": "auto"}})
    assert again.sync is not None and again.sync.outer_momentum == OUTER_MOMENTUM["topk"]


def test_topk_fraction_help_states_the_cadences_bounds() -> None:
    """The spec names the automatic cadence's floor on the share and its rounds' spacing in
    words (it imports nothing of the sync package); they must be the cadence's own."""
    from atomd.sync.cadence import LINK_EVERY, MIN_FRACTION

    text = SyncSpec.model_fields["topk_fraction"].description or ""
    assert f"down to {MIN_FRACTION:.2%}" in text
    assert f"more than {LINK_EVERY} steps apart" in text


def _nested_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and the models of its fields, but SyncSpec (its own test checks it)."""
    found = [model]
    for field in model.model_fields.values():
        inner = field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel) and inner is not SyncSpec:
            found += _nested_models(inner)
    return found


def test_every_job_field_has_one_short_sentence_of_help() -> None:
    """`atomd train` takes its options' help from these descriptions: one sentence of at most
    120 characters each."""
    for model in _nested_models(JobSpec):
        for name, field in model.model_fields.items():
            text = field.description
            assert text, f"{model.__name__}.{name} has no description"
            assert len(text) <= 120, f"{model.__name__}.{name}: {len(text)} characters"
            assert not re.search(r"[.!?:]\s+[A-Z]", text), f"{name}: more than one sentence"


def test_removed_sync_options_are_accepted_only_at_their_kept_value() -> None:
    """Specs stored by older daemons and adverts of older peers may carry a removed option:
    at the value whose behaviour stays it is dropped, any other value is refused by name."""
    old = {"residual": "replica", "ef_decay": 1.0, "final_tail": 0.0, "value_bits": 4}
    assert set(old) == set(REMOVED_SYNC_OPTIONS)
    stored = JobSpec.model_validate({"sync": {**old, "every": 50}})
    assert stored.sync == JobSpec.model_validate({"sync": {"every": 50}}).sync
    assert SyncSpec.model_validate({"ef_decay": 1, "final_tail": 0}) == SyncSpec()
    assert not set(old) & set(SyncSpec().model_dump())
    refused = {"residual": "feedback", "ef_decay": 0.5, "final_tail": 0.05, "value_bits": 8}
    for name, value in refused.items():
        with pytest.raises(ValidationError, match=rf"sync\.{name} was removed"):
            JobSpec.model_validate({"sync": {name: value}})
    with pytest.raises(ValidationError, match=r"sync\.value_bits was removed"):
        SyncSpec.model_validate({"value_bits": True})
    for codec in ("rice2", "lowrank"):
        removed = rf"sync\.codec '{codec}' was removed: use 'topk'"
        with pytest.raises(ValidationError, match=removed):
            SyncSpec.model_validate({"codec": codec})


def test_syncspec_descriptions_are_one_short_sentence() -> None:
    for name, field in SyncSpec.model_fields.items():
        text = field.description or ""
        assert 0 < len(text) <= 120, (name, len(text))
        body = text.rstrip(".")
        assert text.endswith(".") and ". " not in body, (name, text)


def test_the_groups_of_the_job_spec_hold_every_field_once() -> None:
    grouped = [f for fields in JOB_SPEC_GROUPS.values() for f in fields]
    assert sorted(grouped) == sorted(JobSpec.model_fields)
    assert len(grouped) == len(set(grouped))
    assert job_spec_group("swap_slots") == "Precision and swapping"
    assert job_spec_group("sync") == "Swarm"
