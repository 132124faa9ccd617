"""Hypothesis fuzz of every peer-plane message type and of the robust merge (issue #15).

Messages: whatever JSON arrives, parsing gives the model or a ``MessageError`` (a 422), never
another exception, and no number that passes can overflow SQLite. The merge: whatever one
hostile member sends, the honest peers' anchors stay finite, bounded, and equal to each other.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomd.errors import MessageError
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Membership
from atomd.p2p.messages import (
    Ack,
    Announce,
    DeltaAccepted,
    Gossip,
    JoinReply,
    MemberRecord,
    Message,
    PeerInfo,
    PingReq,
    PingReqReply,
    StateManifest,
    StopJob,
    parse,
    sign_record,
)
from atomd.sync.codecs import decode
from atomd.sync.intake import Contribution
from tests.unit.test_sync_state import SHAPES, received, spec, swarm, train

MODELS: list[type[Message]] = [
    Gossip, PingReq, PingReqReply, JoinReply, Announce, StopJob, Ack, DeltaAccepted, PeerInfo,
    StateManifest, MemberRecord,
]  # fmt: skip

ME = Identity.generate()
GOOD = sign_record(
    MemberRecord(id=ME.peer_id, url="http://127.0.0.1:28001", public_key=ME.public_key_hex,
                 state="alive", incarnation=3), ME, "default",
).model_dump(mode="json")  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["alive", "left", "dead", "http://x:1", ME.peer_id, ME.public_key_hex]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=25,
)  # fmt: skip
keys = st.sampled_from(
    ["from", "updates", "job", "target", "ok", "members", "id", "url", "public_key", "state",
     "incarnation", "signature", "step", "files", "format_version", "bytes", "accepted"]
)  # fmt: skip


def _counters_fit(obj: Any) -> bool:
    if isinstance(obj, bool):
        return True
    if isinstance(obj, int):
        return -(2**63) <= obj < 2**63
    if isinstance(obj, dict):
        return all(_counters_fit(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return all(_counters_fit(v) for v in obj)
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), value=json_values)
def test_any_json_is_a_model_or_a_422(model: type[Message], value: Any) -> None:
    for data in (value, json.dumps(value, allow_nan=True).encode()):
        try:
            msg = parse(model, data)
        except MessageError:
            continue
        assert _counters_fit(msg.model_dump())


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from([Gossip, PingReq, JoinReply, StopJob]), key=keys, value=json_values)
def test_a_valid_message_with_one_field_mutated_is_a_model_or_a_422(
    model: type[Message], key: str, value: Any
) -> None:
    base: dict[str, Any] = {"from": GOOD}
    if model is PingReq:
        base["target"] = ME.peer_id
    mutated = {**base, key: value}
    try:
        msg = parse(model, mutated)
    except MessageError:
        return
    assert _counters_fit(msg.model_dump())
    if isinstance(msg, Gossip):  # whatever got through, merging it cannot raise
        m = Membership(
            MemberRecord(id=Identity.generate().peer_id, url="http://127.0.0.1:28002",
                         public_key="00" * 32, state="alive", incarnation=1)
        )  # fmt: skip
        m.apply(msg.sender, direct=True)
        for u in msg.updates:
            m.apply(u)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["const", "scale", "noise", "one"]),
    magnitude=st.floats(min_value=-30, max_value=30),
    sign=st.sampled_from([1.0, -1.0]),
)
def test_one_hostile_delta_leaves_honest_anchors_finite_bounded_and_equal(
    kind: str, magnitude: float, sign: float
) -> None:
    replicas, states = swarm(3, spec())
    for i in range(3):
        train(replicas[i], seed=i)
    outs = [s.round_boundary([], n_peers=4) for s in states]
    c = 10.0**magnitude * sign
    honest = received("p2", outs[2])
    g = torch.Generator().manual_seed(7)
    tensors = {
        "const": {n: torch.full(s, c) for n, s in SHAPES.items()},
        "scale": {n: c * t for n, t in honest.tensors.items()},
        "noise": {n: c * torch.randn(s, generator=g) for n, s in SHAPES.items()},
        "one": {n: torch.zeros(s).flatten().index_fill(0, torch.tensor([0]), c).reshape(s)
                for n, s in SHAPES.items()},
    }[kind]  # fmt: skip
    hostile = Contribution("evil", 0, 0, tensors)
    own_norms = []
    for i in (0, 1):
        other = received(f"p{1 - i}", outs[1 - i])
        states[i].absorb([other, honest, hostile])
        own_norms.append(max(float(decode(e).abs().max()) for _, e in outs[i].tensors))
    for i in (0, 1):
        for t in states[i].start_point().values():
            assert bool(torch.isfinite(t).all())
    # Equal (the hostile delta refused or clipped alike by both) or apart by at most what a
    # clipped delta may carry: its entries are at most 8x the reference's largest entry.
    a, b = states[0].start_point(), states[1].start_point()
    gap = max(float((a[n] - b[n]).abs().max()) for n in SHAPES)
    assert gap <= 8 * max(own_norms) + 1e-6, gap
    assert not math.isnan(gap)
