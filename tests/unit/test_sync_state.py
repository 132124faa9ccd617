"""SyncState: the round boundary's merge, staleness, error feedback and state round-trip."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from atomd.spec import SyncSpec
from atomd.sync.codecs import decode, kept
from atomd.sync.intake import Contribution
from atomd.sync.outer import NesterovOuter, staleness_weight
from atomd.sync.pace import CLAIM_FRESH_ROUNDS
from atomd.sync.state import Outgoing, SyncState

SHAPES = {"w": (8, 6), "b": (6,), "e": (300,)}


def params(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def spec(**kw: Any) -> SyncSpec:
    base: dict[str, Any] = {"codec": "fp32", "outer_lr": 1.0, "outer_momentum": 0.0}
    base.update(kw)
    return SyncSpec(**base)


def swarm(n: int, s: SyncSpec) -> tuple[list[dict[str, Tensor]], list[SyncState]]:
    """n peers from the same initial weights, each with its own live replica tensors."""
    init = params()
    replicas = [{k: v.clone() for k, v in init.items()} for _ in range(n)]
    states = [SyncState(r, s, peer_id=f"p{i}") for i, r in enumerate(replicas)]
    return replicas, states


def train(replica: dict[str, Tensor], seed: int) -> None:
    """Stand-in for H inner steps: move the replica in place."""
    g = torch.Generator().manual_seed(1000 + seed)
    for t in replica.values():
        t.add_(0.1 * torch.randn(t.shape, generator=g))


def received(sender: str, out: Outgoing) -> Contribution:
    return Contribution(
        sender=sender,
        round=out.round,
        base_version=out.base_version,
        tensors={n: decode(e) for n, e in out.tensors},
    )


def rel(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    num = sum(float((a[k] - b[k]).square().sum()) for k in a)
    return math.sqrt(num / sum(float(a[k].square().sum()) for k in a))


def sync_round(replicas: list[dict[str, Tensor]], states: list[SyncState], rnd: int) -> None:
    for i, r in enumerate(replicas):
        train(r, seed=100 * rnd + i)
    outs = [s.prepare() for s in states]
    for i, s in enumerate(states):
        s.merge([received(f"p{j}", o) for j, o in enumerate(outs) if j != i], n_peers=len(states))


def test_anchor_becomes_the_mean_of_the_replicas() -> None:
    replicas, states = swarm(3, spec())
    for i, r in enumerate(replicas):
        train(r, seed=i)
    mean = {k: torch.stack([r[k] for r in replicas]).mean(0) for k in SHAPES}
    outs = [s.prepare() for s in states]
    for i, s in enumerate(states):
        report = s.merge([received(f"p{j}", o) for j, o in enumerate(outs) if j != i], n_peers=3)
        assert len(report.applied) == 2 and not report.refused
    for s, r in zip(states, replicas, strict=True):
        assert s.version == 1
        for k in SHAPES:
            torch.testing.assert_close(s.anchor[k], mean[k], rtol=0, atol=1e-6)
            assert torch.equal(r[k], s.anchor[k])  # the replica is reset to the anchor
    for s in states[1:]:
        assert s.committed.divergence(states[0].anchor) < 1e-7


def test_replica_reset_in_place_keeps_dtype() -> None:
    replica = {k: v.to(torch.bfloat16) for k, v in params().items()}
    live = dict(replica)
    state = SyncState(replica, spec())
    train(replica, seed=0)
    state.round_boundary([], n_peers=1)
    for k, t in live.items():
        assert t is replica[k] and t.dtype == torch.bfloat16
        assert torch.equal(t, state.anchor[k].to(torch.bfloat16))


def test_outgoing_reports_sizes() -> None:
    replicas, states = swarm(1, spec())
    train(replicas[0], seed=0)
    out = states[0].round_boundary([], n_peers=1)
    assert (out.round, out.base_version) == (0, 0)
    assert out.raw_bytes == 4 * sum(torch.Size(s).numel() for s in SHAPES.values())
    assert out.wire_ratio == pytest.approx(out.raw_bytes / out.payload_bytes)
    assert {n for n, _ in out.tensors} == set(SHAPES)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_arrival_order_does_not_matter_in_sync(momentum: float) -> None:
    """Two observers merging the same deltas, arriving in different orders: same anchors."""
    replicas, states = swarm(4, spec(outer_lr=0.7, outer_momentum=momentum))
    for rnd in range(2):
        for i in (2, 3):
            train(replicas[i], seed=10 * rnd + i)
        o2, o3 = states[2].prepare(), states[3].prepare()
        c2, c3 = received("p2", o2), received("p3", o3)
        states[0].round_boundary([c2, c3], n_peers=4)
        states[1].round_boundary([c3, c2], n_peers=4)
        states[2].merge([c3], n_peers=4)
        states[3].merge([c2], n_peers=4)
    assert all(torch.equal(states[0].anchor[k], states[1].anchor[k]) for k in SHAPES)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_late_delta_counts_a_round_later(momentum: float) -> None:
    """Observer A gets a delta on time, B one round late: the same anchors, commit by commit."""
    s = spec(outer_lr=0.7, outer_momentum=momentum)
    replicas, states = swarm(3, s)
    a, b, sender = states
    train(replicas[2], seed=1)
    c0 = received("p2", sender.round_boundary([], n_peers=3))
    train(replicas[2], seed=2)
    c1 = received("p2", sender.round_boundary([], n_peers=3))
    for r in replicas[:2]:  # the observers train alike: their own deltas are equal
        train(r, seed=3)
    a.round_boundary([c0], n_peers=3)
    b.round_boundary([], n_peers=3)
    # Round 0 is not complete anywhere: the anchors wait, A's start point already holds c0.
    assert a.committed.divergence(b.anchor) == 0.0
    assert rel(a.start_point(), b.start_point()) > 1e-3
    torch.testing.assert_close(replicas[0]["w"], a.start_point()["w"])
    a.round_boundary([c1], n_peers=3)
    b.round_boundary([c0, c1], n_peers=3)
    assert sorted(d.staleness for d in b.last_merge.applied) == [0, 1]
    assert all(d.weight == 1.0 for d in b.last_merge.applied)
    # Both committed round 0 (with c0) at their round 1: equal anchors, and equal start points.
    assert a.committed.divergence(b.anchor) < 1e-7
    assert rel(a.start_point(), b.start_point()) < 1e-7


def test_a_peer_nobody_has_reached_yet_keeps_its_own_progress() -> None:
    """Missing deltas are estimated by the mean of those in: alone in its round, a peer restarts
    from its own replica (not from anchor + delta / n); with one more delta in, from their mean."""
    replicas, states = swarm(3, spec())
    for i in range(3):
        train(replicas[i], seed=i)
    before = [{k: v.clone() for k, v in r.items()} for r in replicas]
    c1 = received("p1", states[1].round_boundary([], n_peers=3))
    states[0].round_boundary([], n_peers=3)
    states[2].round_boundary([c1], n_peers=3)
    for k in SHAPES:
        torch.testing.assert_close(replicas[0][k], before[0][k])
        torch.testing.assert_close(replicas[2][k], (before[1][k] + before[2][k]) / 2)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_start_point_is_the_anchor_the_commit_will_make(momentum: float) -> None:
    """Once every delta of a round is in, the start point (a look-ahead of the outer step,
    momentum included) is exactly where the next commit puts the anchor."""
    replicas, states = swarm(2, spec(outer_lr=0.7, outer_momentum=momentum))
    for rnd in range(3):
        for i in range(2):
            train(replicas[i], seed=10 * rnd + i)
        outs = [s.prepare() for s in states]
        for i, s in enumerate(states):
            s.merge([received(f"p{1 - i}", outs[1 - i])], n_peers=2, commit_complete=False)
        predicted = {k: v.clone() for k, v in states[0].start_point().items()}
        for s in states:  # the next round, with nothing new: commits the last one
            s.prepare()
            s.merge([], n_peers=2, commit_complete=False)
        torch.testing.assert_close(states[0].anchor, predicted, rtol=0, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.7])
def test_a_counted_peer_that_sends_nothing_shrinks_no_round(momentum: float) -> None:
    """Issue #14: a round commits the mean of the deltas it gets. A peer counting a second one
    that sends nothing (it joined and fetches the swarm's state) commits its own delta whole,
    and its replica restarts exactly where the commit puts the anchor (no jump back at the
    next boundary, with momentum either); a delta of the joiner that comes after all counts
    in the start point as the commit will count it."""
    replicas, states = swarm(1, spec(outer_momentum=momentum))
    donor, state = replicas[0], states[0]
    for rnd in range(3):
        train(donor, seed=rnd)
        state.round_boundary([], n_peers=2)
        predicted = {k: v.clone() for k, v in state.start_point().items()}
        for k in SHAPES:  # fp32: nothing kept, the replica restarts at the start point
            torch.testing.assert_close(donor[k], predicted[k])
        train(donor, seed=10 + rnd)
        state.round_boundary([], n_peers=2)  # commits the round before
        for k in SHAPES:
            torch.testing.assert_close(state.anchor[k], predicted[k], rtol=0, atol=1e-6)
    # The joiner's delta of the last closed round comes after all: the start point takes it
    # as the commit will (the mean of 2 deltas), and the commit lands there.
    g = torch.Generator().manual_seed(7)
    late = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    before = {k: v.clone() for k, v in state.start_point().items()}
    state.absorb([Contribution("j", 0, state.version - 1, late)])
    predicted = {k: v.clone() for k, v in state.start_point().items()}
    assert not torch.allclose(predicted["w"], before["w"], atol=1e-3)
    state.prepare()
    state.merge([], n_peers=2, commit_complete=False)
    for k in SHAPES:
        torch.testing.assert_close(state.anchor[k], predicted[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("codec", ["fp32", "topk"])
def test_anchors_agree_whoever_each_peer_counts(codec: str) -> None:
    """Issue #14: 4 real daemons at 256 kbit/s (2026-12-05) counted 2, 3, 2 and 3 peers in
    round 0 (each starts as the job's adverts reach it), and one merged the round's three
    other deltas only after committing it. Divided by the peers counted, that peer weighed
    each at 1/2 and the anchors ended 2 % apart. A round is now the mean of its deltas, a late
    one committing the change of that mean: A counts 2 and gets the others' round-0 deltas
    after its commit, B counts 3 and gets every delta in time, C counts 4 (one more than
    train) and gets B's round-0 delta after its commit; all three anchors agree once every
    delta is in. Fails when a round is divided by the peers counted."""
    replicas, states = swarm(3, spec(codec=codec, topk_fraction=0.2))
    a, b, c = states
    counts = (2, 3, 4)

    def full_round(rnd: int) -> None:  # every delta in time, everywhere
        for i in range(3):
            train(replicas[i], seed=50 + 10 * rnd + i)
        outs = [st.prepare() for st in states]
        for i, st in enumerate(states):
            inbox = [received(f"p{j}", o) for j, o in enumerate(outs) if j != i]
            st.merge(inbox, n_peers=counts[i], commit_complete=False)

    for i in range(3):
        train(replicas[i], seed=40 + i)
    oa, ob, oc = (st.prepare() for st in states)
    a.merge([], n_peers=2, commit_complete=False)
    b.merge([received("p0", oa), received("p2", oc)], n_peers=3, commit_complete=False)
    c.merge([received("p0", oa)], n_peers=4, commit_complete=False)
    full_round(1)
    full_round(2)  # round 0 was committed at round 1's close: these come after it
    a.absorb([received("p1", ob), received("p2", oc)])
    c.absorb([received("p1", ob)])
    assert len(a.last_merge.applied) == 2 and len(c.last_merge.applied) == 1
    full_round(3)
    full_round(4)
    assert a.version == b.version == c.version == 5
    assert b.committed.divergence(a.anchor) < 1e-6, b.committed.divergence(a.anchor)
    assert b.committed.divergence(c.anchor) < 1e-6, b.committed.divergence(c.anchor)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_absorb_between_boundaries_keeps_what_the_replica_trained(momentum: float) -> None:
    """A late delta absorbed mid-round moves the replica exactly as far as the start point moves;
    the next boundary then ends where one with the delta in its inbox would have."""
    s = spec(outer_lr=0.7, outer_momentum=momentum)
    replicas, states = swarm(3, s)
    twin_replicas, twins = swarm(3, s)  # the same swarm, the late delta kept for the boundary
    outs = []
    for reps, sts in ((replicas, states), (twin_replicas, twins)):
        for i in range(3):
            train(reps[i], seed=i)
        sts[0].round_boundary([], n_peers=3)
        outs.append(sts[1].round_boundary([], n_peers=3))
    late = received("p1", outs[0])
    for reps in (replicas, twin_replicas):
        train(reps[0], seed=7)  # peer 0 trains on into round 1
    trained = {k: v.clone() for k, v in replicas[0].items()}
    start = {k: v.clone() for k, v in states[0].start_point().items()}
    report = states[0].absorb([late])
    assert [a.sender for a in report.applied] == ["p1"]
    moved = {k: replicas[0][k] - trained[k] for k in SHAPES}
    expected = {k: states[0].start_point()[k] - start[k] for k in SHAPES}
    torch.testing.assert_close(moved, expected, rtol=0, atol=1e-6)
    assert rel(moved, {k: torch.zeros_like(v) for k, v in moved.items()}) > 0
    states[0].round_boundary([], n_peers=3)
    twins[0].round_boundary([received("p1", outs[1])], n_peers=3)
    assert states[0].committed.divergence(twins[0].anchor) < 1e-6
    assert rel(states[0].start_point(), twins[0].start_point()) < 1e-6


def test_a_delta_of_a_round_already_committed_counts_as_its_commit_will() -> None:
    """Two rounds late (in full, as every receiver counts it): absorbed mid-round as the change
    of its round's mean that the next commit makes (round 0 was committed with this peer's
    delta alone: (d - mine) / 2), so the boundary does not move the replica again; nor does
    round 1, whose only delta was committed as the mean it was estimated at."""
    replicas, states = swarm(3, spec())
    me, other = states[0], states[1]
    train(replicas[1], seed=5)
    old = received("p1", other.round_boundary([], n_peers=3))  # round 0 of p1
    start = {k: v.clone() for k, v in replicas[0].items()}
    train(replicas[0], seed=1)
    d0 = {k: replicas[0][k] - start[k] for k in SHAPES}
    me.round_boundary([], n_peers=3)  # round 0: only mine
    train(replicas[0], seed=2)
    me.round_boundary([], n_peers=3)  # round 1: only mine; round 0 committed without p1's
    before = {k: v.clone() for k, v in replicas[0].items()}
    report = me.absorb([old])
    assert [(a.staleness, a.weight) for a in report.applied] == [(2, 1.0)]
    for k in SHAPES:
        moved = replicas[0][k] - before[k]
        torch.testing.assert_close(moved, (old.tensors[k] - d0[k]) / 2, rtol=0, atol=1e-6)
    mid = {k: v.clone() for k, v in replicas[0].items()}
    me.round_boundary([], n_peers=3)  # nothing trained: commits rounds 0 (late part) and 1
    for k in SHAPES:
        torch.testing.assert_close(replicas[0][k], mid[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(me.anchor[k], mid[k], rtol=0, atol=1e-6)


def test_absorb_waits_with_a_round_this_peer_has_not_closed() -> None:
    """A delta from a peer ahead (its round is still this peer's current one) does not move the
    replica: this peer's own delta of that round is still being trained, and with it the
    reference the delta is judged by. It is judged and counts at the boundary."""
    replicas, states = swarm(2, spec())
    for i in range(2):
        train(replicas[i], seed=i)
    ahead = received("p1", states[1].round_boundary([], n_peers=2))
    before = {k: v.clone() for k, v in replicas[0].items()}
    report = states[0].absorb([ahead])
    assert report.applied == [] and report.refused == [] and states[0].deltas_in(0) == 1
    assert all(torch.equal(replicas[0][k], before[k]) for k in SHAPES)
    states[0].round_boundary([], n_peers=2)
    assert [a.sender for a in states[0].last_merge.applied] == ["p1"]
    for k in SHAPES:  # both deltas of round 0 in: the replica restarts from their mean
        torch.testing.assert_close(replicas[0][k], (before[k] + states[1].params[k]) / 2)


def test_absorb_refuses_bad_deltas_without_touching_the_replica() -> None:
    replicas, states = swarm(2, spec())
    train(replicas[1], seed=1)
    out = states[1].round_boundary([], n_peers=2)
    states[0].round_boundary([], n_peers=2)
    bad = received("p1", out)
    bad.tensors["w"][0, 0] = float("nan")
    before = {k: v.clone() for k, v in replicas[0].items()}
    report = states[0].absorb([bad])
    assert report.applied == [] and "NaN" in report.refused[0].reason
    assert all(torch.equal(replicas[0][k], before[k]) for k in SHAPES)


def test_stale_duplicate_and_non_finite_deltas_are_refused() -> None:
    replicas, states = swarm(2, spec(max_staleness=1))
    me, other = states
    train(replicas[1], seed=0)
    train(replicas[0], seed=1)
    old = received("p1", other.round_boundary([], n_peers=2))
    me.round_boundary([old], n_peers=2)
    before = {k: v.clone() for k, v in me.start_point().items()}
    # Version 1 now; the same delta again is a duplicate.
    me.round_boundary([old], n_peers=2)
    assert me.last_merge.refused and "duplicate" in me.last_merge.refused[0].reason
    assert rel(me.start_point(), before) < 1e-7
    # Version 2, then 3: a delta on base version 0 lags 3 rounds (> 1 allowed).
    me.round_boundary([], n_peers=2)
    stale = Contribution("p9", 0, 0, {k: torch.ones(s) for k, s in SHAPES.items()})
    me.round_boundary([stale], n_peers=2)
    assert "stale" in me.last_merge.refused[0].reason
    assert not me.last_merge.applied
    bad = {k: torch.zeros(s) for k, s in SHAPES.items()}
    bad["w"][0, 0] = float("nan")
    me.round_boundary([Contribution("p9", 4, me.version, bad)], n_peers=2)
    assert "NaN" in me.last_merge.refused[0].reason
    ahead = Contribution("p9", 9, me.version + 2, {k: torch.ones(s) for k, s in SHAPES.items()})
    me.round_boundary([ahead], n_peers=2)  # max_staleness 1: two rounds ahead is too far
    assert "ahead" in me.last_merge.refused[0].reason
    wrong = {k: torch.zeros(3) for k in SHAPES}
    me.round_boundary([Contribution("p9", 5, me.version, wrong)], n_peers=2)
    assert "shape" in me.last_merge.refused[0].reason
    assert rel(me.start_point(), before) < 1e-7
    assert rel(me.anchor, before) < 1e-7


def test_alone_a_peer_commits_its_whole_delta() -> None:
    """Nobody to average with: the anchor (what a joiner starts from) becomes the model, the
    residual top-k held back included, without an outer step's momentum; the frame is still
    top-k's. A peer joining later starts where this one is, not from the anchor top-k has
    moved by 5 % a round."""
    s = spec(codec="topk", topk_fraction=0.05, outer_momentum=0.7)
    replica = params()
    state = SyncState(replica, s)
    start = {k: v.clone() for k, v in replica.items()}
    for rnd in range(3):
        train(replica, seed=rnd)
        trained = {k: v.clone() for k, v in replica.items()}
        out = state.round_boundary([], n_peers=1)
        assert out.wire_ratio > 5  # the codec's frame, for whoever listens
        for k in SHAPES:
            torch.testing.assert_close(state.anchor[k], trained[k], rtol=0, atol=1e-5)
            assert torch.equal(replica[k], state.anchor[k])
        assert all(float(t.abs().max()) == 0 for t in state.feedback.state_tensors().values())
    assert rel(state.anchor, start) > 0.05  # it did move


def test_alone_with_a_stragglers_delta_the_round_is_averaged() -> None:
    """A delta of the same round from a peer no longer counted (silent, or gone): the round is
    the mean of the two, by the outer step, as with any two deltas."""
    replicas, states = swarm(2, spec(codec="topk", topk_fraction=0.05))
    init = {k: v.clone() for k, v in replicas[0].items()}
    train(replicas[0], seed=1)
    train(replicas[1], seed=2)
    mine = {k: replicas[0][k] - init[k] for k in SHAPES}
    theirs = received("p1", states[1].round_boundary([], n_peers=2))
    states[0].round_boundary([theirs], n_peers=1)
    for k in SHAPES:
        want = init[k] + (mine[k] + theirs.tensors[k].reshape(init[k].shape)) / 2
        torch.testing.assert_close(states[0].anchor[k], want, rtol=0, atol=1e-5)


def test_residual_kept_in_the_replica() -> None:
    """Error reset: the replica restarts from the anchor plus what was not sent; the error
    feedback holds nothing, and the next delta carries it. Nothing is lost."""
    s = spec(codec="topk", topk_fraction=0.05)
    replica = params()
    state = SyncState(replica, s)
    start = {k: v.clone() for k, v in replica.items()}
    train(replica, seed=0)
    moved = {k: replica[k] - start[k] for k in SHAPES}
    sent = {n: decode(e) for n, e in state.round_boundary([], n_peers=2).tensors}
    ef = state.feedback.state_tensors()
    at = state.start_point()  # the anchor once the round commits (the other's delta = ours)
    for k in SHAPES:
        torch.testing.assert_close(ef[k], torch.zeros_like(ef[k]), rtol=0, atol=1e-6)
        torch.testing.assert_close(at[k], start[k] + sent[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(replica[k] - at[k], moved[k] - sent[k], rtol=0, atol=1e-6)
    # The next delta carries the residual: with no new progress it is exactly the residual.
    out = state.prepare()
    assert {n: decode(e).abs().sum() > 0 for n, e in out.tensors} == {k: True for k in SHAPES}


def test_state_round_trip() -> None:
    s = spec(codec="topk", topk_fraction=0.1, outer_lr=0.7, outer_momentum=0.9)
    replicas, states = swarm(2, s)
    for rnd in range(2):
        sync_round(replicas, states, rnd)
    saved = states[0].state_tensors()
    assert int(saved["sync.version"]) == 2
    fresh_replica = params(seed=5)
    fresh = SyncState(fresh_replica, s, peer_id="p0")
    fresh.load_state_tensors(saved)
    assert fresh.version == 2 and fresh.round == 2
    fresh.reset_replica()  # after a state transfer: train from the anchor
    for k in SHAPES:
        assert torch.equal(fresh.anchor[k], states[0].anchor[k])
        assert torch.equal(fresh_replica[k], states[0].anchor[k])
    for k in SHAPES:  # a checkpoint restores the replica too (it holds the unsent residual)
        fresh_replica[k].copy_(replicas[0][k])
    # Same state, same progress -> the same next round, bit for bit.
    train(replicas[0], seed=77)
    train(fresh_replica, seed=77)
    a, b = states[0].round_boundary([], n_peers=2), fresh.round_boundary([], n_peers=2)
    assert [e.payload for _, e in a.tensors] == [e.payload for _, e in b.tensors]
    for k in SHAPES:
        assert torch.equal(fresh.anchor[k], states[0].anchor[k])
    with pytest.raises(ValueError, match="does not fit"):
        SyncState({"x": torch.zeros(2)}, s).load_state_tensors(saved)


def test_a_state_carries_the_deltas_it_merged() -> None:
    """A peer that takes another's state (a join, a restart) refuses the deltas that state
    already holds when they reach it too: merged twice, they would count twice in its anchor
    and in no other peer's. What does not read as "sender<TAB>round" is skipped."""
    s = spec(codec="topk", topk_fraction=0.1)
    replicas, states = swarm(3, s)
    train(replicas[2], seed=3)
    late = received("p2", states[2].round_boundary([], n_peers=3))  # round 0 of p2
    sync_round(replicas[:2], states[:2], 0)
    states[0].absorb([late])  # the donor has it ...
    saved = states[0].state_tensors()
    joiner = SyncState(params(seed=5), s, peer_id="p9")
    joiner.load_state_tensors(saved)
    joiner.adopt()
    report = joiner.absorb([late])  # ... and it reaches the joiner too
    assert not report.applied and "duplicate" in report.refused[0].reason
    bad = torch.tensor(list(b"p2\tzero\n\tp3\nnot a line\np4\t0\n\xff\xfe\t1\n"), dtype=torch.uint8)
    joiner.load_state_tensors({**saved, "sync.seen": bad})
    assert joiner.intake.seen == {("p4", 0), ("\ufffd\ufffd", 1)}
    joiner.load_state_tensors({**saved, "sync.seen": torch.zeros(3)})  # not bytes: nothing
    assert joiner.intake.seen == set()


def test_the_switch_to_the_plain_average_survives_a_restart() -> None:
    """A peer restarted in the middle of consolidation must go on averaging plainly, as the
    others do, or its commits (with momentum) would move its anchor away from theirs."""
    s = spec(codec="topk", topk_fraction=0.1, outer_momentum=0.5)
    replicas, states = swarm(2, s)
    for rnd in range(2):
        sync_round(replicas, states, rnd)
    assert "sync.averaging" not in states[0].state_tensors()
    for st in states:
        st.average_from_now()
    saved = states[0].state_tensors()
    fresh = SyncState(params(seed=5), s, peer_id="p0")
    assert fresh.committed.outer.momentum == 0.5
    fresh.load_state_tensors(saved)
    assert fresh.averaging and (fresh.committed.outer.lr, fresh.committed.outer.momentum) == (
        1.0,
        0.0,
    )


def test_nesterov_step_matches_the_formula() -> None:
    opt = NesterovOuter(lr=0.5, momentum=0.9)
    anchor = {"x": torch.zeros(3)}
    g = torch.tensor([1.0, -2.0, 0.5])
    opt.step(anchor, {"x": g})
    torch.testing.assert_close(anchor["x"], -0.5 * (g + 0.9 * g))
    opt.step(anchor, {"x": g})
    buf = 0.9 * g + g
    torch.testing.assert_close(anchor["x"], -0.5 * (g + 0.9 * g) - 0.5 * (g + 0.9 * buf))


def test_staleness_weight() -> None:
    assert staleness_weight(0) == staleness_weight(1) == 1.0
    assert staleness_weight(4) == 1.0  # late deltas count in full: the anchors' sums agree
    with pytest.raises(ValueError):
        staleness_weight(-1)


def test_prepare_and_merge_pair_up() -> None:
    _, states = swarm(1, spec())
    with pytest.raises(RuntimeError):
        states[0].merge([], n_peers=1)
    states[0].prepare()
    with pytest.raises(RuntimeError):
        states[0].prepare()
    with pytest.raises(ValueError):
        states[0].merge([], n_peers=0)


def test_the_next_rounds_delta_waits_even_with_max_staleness_0() -> None:
    """A delta of the round after this peer's current one is the normal spread of an
    asynchronous swarm: it waits (and counts for rounds_behind) even when no staleness is
    allowed; two rounds ahead is refused, and still counted. How far behind this peer is
    comes from the (lower) median of the senders' claims: one member cannot set the pace."""
    (me,) = swarm(1, spec(max_staleness=0))[1]
    ones = {k: torch.ones(s) for k, s in SHAPES.items()}
    me.absorb([Contribution("p1", 1, me.version + 1, ones)])
    assert not me.last_merge.refused and me.deltas_in(1) == 1 and me.rounds_behind() == 2
    me.absorb([Contribution("p2", 2, me.version + 2, ones)])
    assert "ahead" in me.last_merge.refused[0].reason and me.rounds_behind() == 2
    me.absorb([Contribution("p3", 2, me.version + 2, ones)])
    assert me.rounds_behind() == 3  # two of three senders are there
    me.absorb([Contribution("liar", 7, 10**9, ones)])  # far-future: refused, counts for nothing
    assert "ahead" in me.last_merge.refused[0].reason and me.rounds_behind() == 3
    # Refused as ahead, those deltas of round 2 will not come again: no round waits for them
    # (p1's of round 1 is held until this peer closes that round; the liar's counts nowhere).
    assert me.senders_in(2) == {"p2", "p3"} and me.senders_in(1) == {"p1"}
    assert me.senders_in(10**9) == set()


def test_an_excluded_senders_claims_and_held_deltas_are_forgotten() -> None:
    """A member quarantined after it sent leaves nothing behind: its held delta is not merged
    when this peer closes that round, and the rounds it claimed no longer pace this peer's
    (``rounds_behind``: it was this peer's only other member, so its claim alone set it)."""
    (me,) = swarm(1, spec(max_staleness=4))[1]
    ones = {k: torch.ones(s) for k, s in SHAPES.items()}
    # Held: rounds this peer has not closed yet; the newer one is claimed.
    me.absorb([Contribution("bad", 1, me.version + 1, ones), Contribution("bad", 2, 3, ones)])
    assert me.held() == 2 and me.rounds_behind() == 4 and me.senders_in(1) == {"bad"}
    assert me.drop_excluded(lambda sender: sender == "other") == 0  # others stay
    assert me.held() == 2 and me.rounds_behind() == 4
    assert me.drop_excluded(lambda sender: sender == "bad") == 2
    assert me.held() == 0 and me.rounds_behind() == 0 and me.senders_in(1) == set()


def test_a_delta_refused_as_ahead_then_merged_counts_once() -> None:
    """A peer's delta of round 4 reaches this one at round 0 and is refused as ahead: its
    sender counts as in for round 4 (``senders_in``), since it will not come again. When it
    sends it again after this peer has closed round 4 and it is merged, it is among the
    round's deltas (``deltas_in``), and its sender is still in once: rounds wait for peers,
    not for counts (by count, 9f8dc6e took it twice, and a round waited for one delta fewer
    than it missed)."""
    (mine, theirs), (me, ahead) = swarm(2, spec(max_staleness=2))
    for rnd in range(5):  # the other peer runs five rounds on alone
        train(theirs, seed=rnd)
        out = ahead.prepare()
        ahead.merge([], n_peers=1)
    late = received("p1", out)
    assert late.base_version == 4
    me.absorb([late])
    assert me.last_merge.refused[0].reason.startswith("ahead") and me.senders_in(4) == {"p1"}
    for rnd in range(5):
        train(mine, seed=rnd)
        me.round_boundary([], n_peers=2)
    assert me.version == 5 and me.senders_in(4) == {"p0", "p1"} and me.deltas_in(4) == 1
    me.absorb([late])  # sent again
    assert not me.last_merge.refused
    assert me.deltas_in(4) == 2 and me.senders_in(4) == {"p0", "p1"}


def test_a_peer_far_ahead_knows_it_from_the_stale_deltas_it_refuses() -> None:
    """A peer that ran 10 rounds on alone refuses the others' deltas as stale, yet they tell
    it how far ahead it is (``rounds_ahead``: the lower median of the fresh claims of the
    peers training the job and its own last round), which ``rounds_behind`` leaves out. One
    low claim beside a peer in step does not set it; peers no longer training count for
    nothing, nor do the claims of peers that stop sending, after ``CLAIM_FRESH_ROUNDS``."""
    (me,) = swarm(1, spec(max_staleness=4))[1]
    for _ in range(10):
        me.round_boundary([], n_peers=1)
    everyone = {"p1", "p2", "p3"}
    assert me.version == 10 and me.rounds_ahead(everyone) == 0  # nobody heard from
    ones = {k: 0.01 * torch.ones(s) for k, s in SHAPES.items()}
    me.absorb([Contribution("p1", 2, 2, ones), Contribution("p2", 3, 3, ones)])
    assert [r.reason[:5] for r in me.last_merge.refused] == ["stale", "stale"]
    assert me.rounds_ahead({"p1", "p2"}) == 9 - 3 and me.rounds_behind() == 0  # of 2, 3, 9
    assert me.rounds_ahead({"p1"}) == 9 - 2  # a swarm of two: the other one sets it
    me.absorb([Contribution("p3", 9, 9, ones)])
    assert me.rounds_ahead({"p1", "p3"}) == 0  # 2, 9, 9: one low claim does not set it
    assert me.rounds_ahead(everyone) == 9 - 3  # 2, 3, 9, 9: two of three behind do
    assert me.rounds_ahead({"p3"}) == 0  # p1 and p2 gone or done: they hold nobody
    for _ in range(CLAIM_FRESH_ROUNDS + 1):  # p1 and p2 send nothing more; p3 does
        me.round_boundary([Contribution("p3", me.version, me.version, ones)], n_peers=2)
    assert me.rounds_ahead(everyone) == 0  # only p3's claim is fresh: in step


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_finished_peer_follows_the_last_rounds_of_the_others(momentum: float) -> None:
    """Peer A sends its last delta at round 1; B and C train two rounds more, averaged over
    the two of them. A follows those rounds (no delta of its own) and ends with their model
    of the swarm; without following it would end two rounds behind. What A trained and had
    not sent stays in its replica."""
    s = spec(codec="topk", topk_fraction=0.2, outer_momentum=momentum)
    replicas, states = swarm(3, s)
    a, b, c = states
    for rnd in range(2):
        sync_round(replicas, states, rnd)
    resid = {k: replicas[0][k] - a.start_point()[k] for k in SHAPES}  # A's unsent part
    assert rel(resid, {k: torch.zeros_like(v) for k, v in resid.items()}) > 0
    behind = a.start_point()
    for rnd in (2, 3):
        for i in (1, 2):
            train(replicas[i], seed=100 * rnd + i)
        ob, oc = b.prepare(), c.prepare()
        b.merge([received("p2", oc)], n_peers=2)
        c.merge([received("p1", ob)], n_peers=2)
        # A: the round's deltas in any order, some held before it closes the round.
        a.absorb([received("p2", oc)])
        assert a.held() == 1 and a.version == rnd
        assert a.follow([received("p1", ob)])
        assert a.version == rnd + 1 and len(a.last_merge.applied) == 2
    assert rel(a.start_point(), b.start_point()) < 1e-6
    assert rel(a.start_point(), c.start_point()) < 1e-6
    assert rel(behind, b.start_point()) > 1e-3
    now = {k: replicas[0][k] - a.start_point()[k] for k in SHAPES}
    assert rel(now, resid) < 1e-6


def test_a_follower_divides_a_round_by_the_peers_that_trained_it() -> None:
    """A sends its last delta at round 1, which all three trained; C's delta of it reaches A
    only after A has started following round 2, which B and C train without A (divided by
    2). Round 1 is still divided by 3 at A, as at B and C, and so is C's late delta of it,
    so the anchors agree. (Divided by the followed round's count, A weighed round 1 at 1/2
    and the late delta at 1/2: 4 real daemons at 256 kbit/s, the first to finish ended 1.8 %
    from the others and on the worst model.) Without momentum, so that the late delta's
    commit a round later than at B and C leaves no trace of its timing."""
    s = spec(codec="topk", topk_fraction=0.2)
    replicas, states = swarm(3, s)
    a, b, c = states
    sync_round(replicas, states, 0)
    for i in range(3):
        train(replicas[i], seed=100 + i)
    oa, ob, oc = (st.prepare() for st in states)
    # Asynchronous: each round commits a round later everywhere (``round_boundary``).
    a.merge([received("p1", ob)], n_peers=3, commit_complete=False)  # C's delta comes late
    b.merge([received("p0", oa), received("p2", oc)], n_peers=3, commit_complete=False)
    c.merge([received("p0", oa), received("p1", ob)], n_peers=3, commit_complete=False)
    for rnd in (2, 3):  # B and C train on; A follows
        for i in (1, 2):
            train(replicas[i], seed=100 * rnd + i)
        ob, oc2 = b.prepare(), c.prepare()
        b.merge([received("p2", oc2)], n_peers=2, commit_complete=False)
        c.merge([received("p1", ob)], n_peers=2, commit_complete=False)
        assert a.follow([received("p1", ob), received("p2", oc2)])
        if rnd == 2:
            a.absorb([received("p2", oc)])  # round 1's last delta, after A committed round 1
    assert a.version == b.version == c.version == 4
    assert b.committed.divergence(c.anchor) < 1e-6
    assert a.committed.divergence(b.anchor) < 1e-6
    assert rel(a.start_point(), b.start_point()) < 1e-6


def test_a_late_delta_after_a_whole_close_moves_the_replica_where_the_commit_will() -> None:
    """X and Y close round 1 counting 2; Y's delta of it is late and Y is gone, so X closes
    round 2 alone (whole), committing round 1 as it is. When Y's delta comes, the replica
    moves by as much as the next commit moves the anchor: no jump at that boundary (the whole
    close's divisor is the round's from then on; found by review, 2026-12-04)."""
    replicas, (x, y) = swarm(2, spec())
    for i in range(2):
        train(replicas[i], seed=1 + i)
    ox, oy = x.prepare(), y.prepare()
    x.merge([received("p1", oy)], n_peers=2, commit_complete=False)
    y.merge([received("p0", ox)], n_peers=2, commit_complete=False)
    for i in range(2):
        train(replicas[i], seed=3 + i)
    x.prepare()
    late = received("p1", y.prepare())
    x.merge([], n_peers=2, commit_complete=False)  # Y's delta of round 1 is late
    train(replicas[0], seed=5)
    x.round_boundary([], n_peers=1, whole=True)  # alone now
    x.absorb([late])
    before = {k: v.clone() for k, v in replicas[0].items()}
    x.round_boundary([], n_peers=1, whole=True)  # nothing trained since
    assert rel(before, replicas[0]) < 1e-6
    assert rel(before, x.anchor) < 1e-6


@pytest.mark.parametrize("codec", ["fp32", "topk"])
def test_a_state_carries_its_recent_rounds_committed_sums(codec: str) -> None:
    """A peer restored from a state commits a late delta of a round closed before the state
    was taken as the peer that wrote it does (the change of the round's mean, from the sum
    committed: dense, or its nonzero entries where mostly zero); a round whose entries do not
    fit is left out whole."""
    s = spec(codec=codec, topk_fraction=0.05)
    replicas, states = swarm(3, s)
    sync_round(replicas, states, 0)
    me, other = states[0], states[1]
    train(replicas[0], seed=9)
    late = received("p1", other.prepare())
    me.round_boundary([], n_peers=3)  # round 1: only its own delta
    train(replicas[0], seed=10)
    me.round_boundary([], n_peers=3)  # commits round 1
    saved = me.state_tensors()
    assert int(saved["committed_count.1"]) == 1 and int(saved["committed_count.0"]) == 3
    kind = "committed_at.1.e" if codec == "topk" else "committed.1.e"
    assert kind in saved  # top-k: one delta is 5 % of the entries, kept sparse
    fresh = swarm(1, s)[1][0]
    fresh.load_state_tensors(saved)
    for st in (me, fresh):
        st.absorb([late])
        assert len(st.last_merge.applied) == 1
    assert rel(me.start_point(), fresh.start_point()) < 1e-7
    before = me.start_point()
    assert rel(before, me.anchor) > 1e-4  # the late delta moved it
    bad = dict(saved, **{"committed_count.0": torch.tensor(0)})
    if codec == "topk":
        at = saved["committed_at.1.e"].clone()
        at[-1] = 300  # out of range
        bad["committed_at.1.e"] = at
    else:
        bad["committed.1.e"] = torch.full((300,), float("nan"))
    broken = swarm(1, s)[1][0]
    broken.load_state_tensors(bad)
    assert broken.rounds.committed == {}


def test_a_follow_round_bounds_what_it_merges() -> None:
    """A followed round's deltas are judged by the norms of the finished peer's newest own
    delta: a delta 1e6 times too large is refused (a strike). A peer that never moved has
    nothing to judge by and follows nothing."""
    replicas, states = swarm(3, spec(codec="topk", topk_fraction=0.2))
    sync_round(replicas, states, 0)
    a, b = states[0], states[1]
    train(replicas[1], seed=7)
    ob = b.prepare()
    huge = received("p1", ob)
    huge = Contribution(
        huge.sender, huge.round, huge.base_version, {k: v * 1e6 for k, v in huge.tensors.items()}
    )
    assert a.follow([huge])
    assert not a.last_merge.applied and a.last_merge.refused[0].strike
    fresh = swarm(1, spec(codec="topk", topk_fraction=0.2))[1][0]
    assert not fresh.follow([]) and fresh.version == 0


def test_a_peer_that_takes_a_state_judges_by_the_donors_reference_at_first() -> None:
    """After a state transfer the taker's error feedback is empty: its first top-k deltas are
    top-k of a near-empty accumulator, the others' of theirs (a real restarted peer: 0.047
    against honest 1.53, refused as 16x outliers, a strike each). The donor's newest own
    statistics travel with the state and are the floor of its reference for a few rounds, and
    the reference of the rounds closed before it took the state."""
    s = spec(codec="topk", topk_fraction=0.1)
    replicas, states = swarm(2, s)
    donor = states[0]
    for t in replicas[0].values():  # the donor's steady-state deltas: large
        t.add_(5.0)
    donor.round_boundary([], n_peers=2)
    saved = donor.state_tensors()
    assert "sync.ref.norms" in saved
    big = {n: torch.full_like(t, 4.0) for n, t in replicas[0].items()}  # an honest-size delta

    def taker(d: dict[str, Tensor]) -> SyncState:
        t = SyncState(params(seed=5), s, peer_id="p9")
        t.load_state_tensors(d)
        t.adopt()
        train(t.params, seed=1)  # a small own delta: one step
        t.round_boundary([], n_peers=2)
        return t

    joiner = taker(saved)
    report = joiner.absorb([Contribution("p0", 1, 1, big)])
    assert report.applied and not report.refused, report.refused  # judged by the floor
    report = joiner.absorb([Contribution("p7", 0, 0, big)])  # closed before the transfer
    assert report.applied and not report.refused, report.refused
    # Without the donor's statistics (or with ones that do not read): an outlier, as before.
    for bad in (None, torch.tensor([1.0, -2.0]), torch.full((len(SHAPES) + 1,), float("nan"))):
        d = {k: v for k, v in saved.items() if not k.startswith("sync.ref")}
        if bad is not None:
            d |= {"sync.ref.norms": bad, "sync.ref.maxabs": saved["sync.ref.maxabs"]}
        fresh = taker(d)
        report = fresh.absorb([Contribution("p0", 1, 1, big)])
        assert not report.applied and "outlier" in report.refused[0].reason


def test_the_donors_reference_holds_until_the_takers_own_deltas_reach_it() -> None:
    """A restarted real daemon (SIGKILL scenario, 2026-12-05) clipped the others' honest deltas
    in LayerNorm tensors for ~40 rounds after the donor's floor lapsed (max_staleness + 1
    rounds): its fresh error feedback sends small deltas there for that long, and its anchor
    ended 3.5 % from theirs. Each statistic of the floor now holds until an own delta reaches
    it (at most INHERIT_ROUNDS rounds): here ``b`` is reached at once and dropped, ``w`` and
    ``e`` are not and still admit an honest-size delta rounds after the old lapse."""
    from atomd.sync.intake import INHERIT_ROUNDS

    s = spec(codec="topk", topk_fraction=0.1)
    replicas, states = swarm(2, s)
    for t in replicas[0].values():  # the donor's steady-state deltas: large
        t.add_(5.0)
    states[0].round_boundary([], n_peers=2)
    # The taker's model: the donor's start point (no inherited progress, which it would send
    # as its own once the donor is silent for max_staleness + 1 rounds, as here).
    taker = SyncState({n: t.clone() for n, t in states[0].start_point().items()}, s,
                      peer_id="p9")  # fmt: skip
    taker.load_state_tensors(states[0].state_tensors())
    taker.adopt()
    assert taker.intake._inherited is not None and s.max_staleness + 1 < INHERIT_ROUNDS
    for rnd in range(s.max_staleness + 3):
        train(taker.params, seed=rnd)  # small own deltas ...
        taker.params["b"].add_(100.0)  # ... but in b, larger than the donor's
        taker.round_boundary([], n_peers=2)
    assert taker.intake._inherited is not None and s.max_staleness + 1 < INHERIT_ROUNDS
    inherited = taker.intake._inherited
    assert inherited.tensor_norms["b"] == 0.0 and inherited.tensor_norms["w"] > 0
    big = {n: torch.full(sh, 4.0) for n, sh in SHAPES.items()}
    report = taker.absorb([Contribution("p0", 9, taker.version - 1, big)])
    assert [a.note for a in report.applied] == [None], (report.applied, report.refused)


def test_a_whole_commit_keeps_the_frame_as_the_rounds_reference() -> None:
    """Alone (or before a snapshot) a peer commits its whole delta, but the deltas it judges
    are frames: its reference is its frame, not the whole delta (whose norm, handed to a joiner
    as the floor of its reference, let a poisoned frame through: test_hostile)."""
    s = spec(codec="topk", topk_fraction=0.05)
    replica = params()
    state = SyncState(replica, s)
    train(replica, seed=0)
    out = state.round_boundary([], n_peers=1)
    frame = {n: decode(e) for n, e in out.tensors}
    ref = state.screen.newest_own() if state.screen is not None else None
    assert ref is not None and ref.norm == pytest.approx(rel_norm(frame), rel=1e-5)
    assert int(state.state_tensors()["sync.version"]) == 1


def rel_norm(t: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float(x.double().square().sum()) for x in t.values()))


def test_own_progress_is_what_this_peer_trained_and_has_not_sent() -> None:
    """The direction reference of the robust rule: the own steps since the boundary plus the
    part of the own delta top-k did not send (kept in the replica),
    and nothing of the others' deltas, which move the replica and the start point alike."""
    s = spec(codec="topk", topk_fraction=0.1, outer_momentum=0.5)
    replicas, states = swarm(2, s)
    train(replicas[0], seed=1)
    train(replicas[1], seed=2)
    before = {k: v.clone() for k, v in replicas[0].items()}
    outs = [st.prepare() for st in states]
    states[0].merge([], n_peers=2)  # p1's delta of round 0 comes later
    sent = {n: decode(e) for n, e in outs[0].tensors}
    step = {k: 0.01 * torch.ones_like(v) for k, v in before.items()}
    for k in SHAPES:
        replicas[0][k].add_(step[k])
    expected = {k: before[k] - params()[k] - sent[k] + step[k] for k in SHAPES}
    progress = states[0].own_progress()
    for k in SHAPES:
        torch.testing.assert_close(progress[k], expected[k], rtol=0, atol=1e-5)
    states[0].absorb([received("p1", outs[1])])  # moves the replica, not the own progress
    assert any(not torch.equal(replicas[0][k], before[k] + step[k]) for k in SHAPES)
    for k in SHAPES:
        torch.testing.assert_close(states[0].own_progress()[k], expected[k], rtol=0, atol=1e-5)


def test_the_model_beyond_the_anchor_averages_to_the_mean_model() -> None:
    """The final average's share (``atomd.sync.average``): the replica minus the anchor, plus
    the error feedback's residual. Where the anchors agree (every delta merged alike), the
    anchor plus the mean of the shares is the mean of the peers' models, whatever top-k has
    sent of them and however the outer step amplified it."""
    s = spec(codec="topk", topk_fraction=0.1, outer_momentum=0.7)
    replicas, states = swarm(2, s)
    for r in range(2):
        train(replicas[0], seed=10 * r + 1)
        train(replicas[1], seed=10 * r + 2)
        outs = [st.prepare() for st in states]
        states[0].merge([received("p1", outs[1])], n_peers=2)
        states[1].merge([received("p0", outs[0])], n_peers=2)
    fb = [st.feedback.state_tensors() for st in states]
    models = [{k: r[k] + fb[i].get(k, torch.zeros_like(r[k])) for k in SHAPES}
              for i, r in enumerate(replicas)]  # fmt: skip
    shares = [st.unsent_from(st.anchor) for st in states]
    for k in SHAPES:
        torch.testing.assert_close(states[0].anchor[k], states[1].anchor[k])
        torch.testing.assert_close(shares[0][k], models[0][k] - states[0].anchor[k])
        got = states[0].anchor[k] + (shares[0][k] + shares[1][k]) / 2
        torch.testing.assert_close(got, (models[0][k] + models[1][k]) / 2, rtol=0, atol=1e-5)


@pytest.mark.parametrize("codec", ["fp32", "topk"])
def test_the_settled_anchor_agrees_whenever_each_peer_committed(codec: str) -> None:
    """The final average's reference (``settled``): with outer momentum the anchors differ by
    when each peer committed a late delta, and at the job's end by a late delta still pending
    at one peer; where the anchor would end with every pending delta committed and the
    momentum run out is the same at all of them."""
    replicas, states = swarm(3, spec(codec=codec, topk_fraction=0.2, outer_momentum=0.7))
    for i in range(3):
        train(replicas[i], seed=i)
    outs = [st.round_boundary([], n_peers=3) for st in states]  # round 0
    late = received("p1", outs[1])  # reaches p2 only after p2 committed round 0
    inbox = [[received(f"p{j}", outs[j]) for j in range(3) if j != i and (i, j) != (2, 1)]
             for i in range(3)]  # fmt: skip
    for rnd in (1, 2, 3):
        for i in range(3):
            train(replicas[i], seed=10 * rnd + i)
        outs = [st.round_boundary(inbox[i], n_peers=3) for i, st in enumerate(states)]
        inbox = [[received(f"p{j}", outs[j]) for j in range(3) if j != i] for i in range(3)]
        if rnd == 2:
            states[2].absorb([late])
    last = inbox[0].pop()  # p0 ends with p2's delta of round 3 in hand, the others with all
    for i in range(3):
        states[i].absorb(inbox[i])
    assert states[0].deltas_in(3) == 2 and states[1].deltas_in(3) == 3
    assert states[0].committed.divergence(states[2].anchor) > 1e-3  # the momentum's timing
    settled = [st.settled() for st in states]
    assert rel(settled[0], settled[1]) > 1e-3  # p0 still misses one
    states[0].absorb([last])
    settled[0] = states[0].settled()
    for i in (1, 2):
        assert rel(settled[0], settled[i]) < 1e-6, (i, rel(settled[0], settled[i]))


def test_a_delta_two_rounds_late_at_one_peer_leaves_the_anchors_in_agreement() -> None:
    """p1's delta of round 0 reaches p0 in time and p2 two rounds late. Every delta counts in
    full wherever it lands, so once all are in the anchors agree (until 2026-12-03 the late
    one counted 1/2 at p2 only, and the anchors stayed apart for good). With outer momentum
    they differ for a while by when each committed it, a difference that decays."""
    replicas, states = swarm(3, spec())
    for i in range(3):
        train(replicas[i], seed=i)
    outs = [st.round_boundary([], n_peers=3) for st in states]  # round 0
    late = received("p1", outs[1])
    inbox: list[list[Contribution]] = [
        [received(f"p{j}", outs[j]) for j in range(3) if j != i and (i, j) != (2, 1)]
        for i in range(3)
    ]
    for i in range(3):  # round 1: on time everywhere
        train(replicas[i], seed=10 + i)
    outs = [st.round_boundary(inbox[i], n_peers=3) for i, st in enumerate(states)]
    inbox = [[received(f"p{j}", outs[j]) for j in range(3) if j != i] for i in range(3)]
    report = states[2].absorb([late])
    assert [(a.sender, a.staleness, a.weight) for a in report.applied] == [("p1", 2, 1.0)]
    for i in range(3):  # round 2 commits the rest everywhere
        states[i].round_boundary(inbox[i], n_peers=3)
    assert states[0].committed.divergence(states[2].anchor) < 1e-6
    assert states[0].committed.divergence(states[1].anchor) < 1e-6


def test_one_stale_member_does_not_hold_a_swarm_of_three() -> None:
    """M sends stale deltas; B trains but has sent nothing lately (fetching the state, or
    stalled): B counts as in step with this peer, so M's claim alone does not make this peer
    hold its rounds as if the swarm were far behind. With B's own stale claim it does."""
    (me,) = swarm(1, spec(max_staleness=4))[1]
    for _ in range(10):
        me.round_boundary([], n_peers=1)
    ones = {k: 0.01 * torch.ones(s) for k, s in SHAPES.items()}
    me.absorb([Contribution("M", 0, 0, ones)])
    assert me.rounds_ahead({"M", "B"}) == 0  # of 0, 9, 9
    assert me.rounds_ahead({"M"}) == 9  # a swarm of two: the other sets it
    me.absorb([Contribution("B", 1, 1, ones)])
    assert me.rounds_ahead({"M", "B"}) == 9 - 1  # of 0, 1, 9


@pytest.mark.parametrize(
    ("rank", "every"), [("moment", "auto"), ("moment", 50), ("magnitude", "auto")]
)
def test_topk_ranks_by_the_second_moment_it_is_given(rank: str, every: Any) -> None:
    """``topk_rank`` 'moment': each round's frame keeps the largest |delta| / v per chunk, v
    read from the engine when the round is prepared (a weight no gradient reached, v = 0,
    ranks as AdamW's eps would have it), where a chunk keeps RANK_MIN_K entries or more;
    'magnitude' keeps the largest |delta|, as do tensors of fewer (here "b": 1 entry, "w":
    5). Either way the anchors of two peers agree: the robust rule clips no honest frame
    (ranked by moment, "b"'s one entry differed between the peers beyond its tensor bound)."""
    from atomd.sync.encoder import RANK_EPS, RANK_POWER

    s = spec(codec="topk", topk_fraction=0.1, topk_rank=rank, every=every)
    replicas, states = swarm(2, s)
    g = torch.Generator().manual_seed(7)
    moments = {n: torch.rand(shape, generator=g) ** 2 for n, shape in SHAPES.items()}
    moments["e"][:10] = 0.0
    reads: list[int] = []

    def second_moments() -> dict[str, Tensor]:
        reads.append(1)
        return moments

    for st in states:
        st.encoder.rank_by(second_moments)
    train(replicas[0], 0)
    train(replicas[1], 1)
    out = states[0].prepare()
    delta = replicas[0]["e"] - params()["e"]

    def top(power: float) -> Tensor:
        score = delta.abs() * (moments["e"] + RANK_EPS) ** power
        chosen = torch.zeros(300, dtype=torch.bool)
        chosen[score.topk(30).indices] = True
        return chosen

    power = RANK_POWER["frequent" if every == "auto" else "rare"] if rank == "moment" else 0.0
    sent = kept(dict(out.tensors)["e"]).mask  # the positions (a 4-bit value may round to 0)
    assert torch.equal(sent, top(power))
    assert {bool(torch.equal(sent, top(p))) for p in (0.0, -0.5, -1.0, -2.0)} == {True, False}
    small = params()["b"] - replicas[0]["b"]
    assert torch.equal(decode(dict(out.tensors)["b"]) != 0, small.abs() == small.abs().max())
    outs = [out, states[1].prepare()]
    assert reads == ([1, 1] if power else [])  # power 0: no moments read
    for i, st in enumerate(states):
        st.merge([received(f"p{1 - i}", outs[1 - i])], n_peers=2)
    for rnd in range(1, 4):
        sync_round(replicas, states, rnd)
    for k in SHAPES:
        torch.testing.assert_close(states[0].anchor[k], states[1].anchor[k], rtol=0, atol=1e-6)


def _joined(s: SyncSpec, rounds: int = 3) -> tuple[list[dict[str, Tensor]], list[SyncState]]:
    """Peers p0 and p1 train ``rounds`` rounds and p0 a little more; then p2 takes p0's state
    and model in the middle of that round (a join: ``adopt``). Returns the three replicas and
    states."""
    replicas, states = swarm(2, s)
    for rnd in range(rounds):
        sync_round(replicas, states, rnd)
    train(replicas[0], seed=99)
    joiner = {k: v.clone() for k, v in replicas[0].items()}  # the donor's model ...
    state = SyncState(joiner, s, peer_id="p2")
    state.load_state_tensors(states[0].state_tensors())  # ... and its sync state
    state.adopt()
    return [*replicas, joiner], [*states, state]


def test_a_joiner_trains_on_from_the_donors_model_and_sends_only_its_own_progress() -> None:
    """Top-k sends little of a peer's progress a round: the donor's model is far from the
    anchor. The joiner keeps that model (it evaluates as well as the donor's, not as the
    anchor) and its deltas hold only what it trained from it: the donor sends its own."""
    s = spec(codec="topk", topk_fraction=0.1, zstd=False)
    replicas, states = _joined(s)
    donor, joiner = replicas[0], replicas[2]
    start = states[2].start_point()
    assert rel(joiner, donor) == 0.0 and rel(joiner, start) > 0.05
    assert states[2].feedback.state_tensors() == {}
    before = {k: v.clone() for k, v in joiner.items()}
    train(joiner, seed=7)
    own = {k: joiner[k] - before[k] for k in SHAPES}
    out = states[2].prepare()
    for n, e in out.tensors:  # what it sends is top-k of its own steps, not of the donor's
        mine = decode(states[2].codec.encode(own[n].flatten()))
        torch.testing.assert_close(decode(e).flatten(), mine, rtol=1e-5, atol=1e-6)
    states[2].merge([], n_peers=3)  # the replica restarts with the offset still in it
    assert rel(joiner, donor) < rel(joiner, states[2].start_point())


def _given_way(o: Tensor, x: Tensor) -> Tensor:
    """``o`` after giving way by ``x`` entry by entry, towards zero and never past it."""
    same = o * x > 0
    return torch.where(same, o - o.sign() * torch.minimum(o.abs(), x.abs()), o)


@pytest.mark.parametrize("codec", ["topk", "fp32"])
def test_the_inherited_progress_gives_way_as_the_donor_sends_it(codec: str) -> None:
    """The donor's delta merged at the joiner shrinks the joiner's offset by as much as it
    sent, entry by entry, towards zero and never past it (the donor's own replica gives way
    by what it sends), whatever the codec: top-k's entries or every entry; the
    replica moves with it, and the anchors of all three peers stay equal."""
    kw: dict[str, Any] = {"topk_fraction": 0.1} if codec == "topk" else {}
    s = spec(codec=codec, zstd=False, **kw)
    replicas, states = _joined(s)
    offset = {n: o.clone() for n, o in states[2].offset.tensors.items()}
    assert states[2].offset.sources == {"p0"} and all(o.any() for o in offset.values())
    outs = [st.prepare() for st in states]
    from_p0 = received("p0", outs[0]).tensors
    before = {k: v.clone() for k, v in replicas[2].items()}
    for i, st in enumerate(states):
        st.merge([received(f"p{j}", o) for j, o in enumerate(outs) if j != i], n_peers=3)
    for k in SHAPES:
        for b in states[1:]:
            torch.testing.assert_close(states[0].anchor[k], b.anchor[k], rtol=0, atol=1e-6)
    for n, o in offset.items():
        want = _given_way(o, from_p0[n].reshape(o.shape))
        assert float(want.norm()) < float(o.norm())
        torch.testing.assert_close(states[2].offset.tensors[n], want)
    # The replica: the new start point plus the offset left, nothing trained since the join.
    start = states[2].start_point()
    for k in SHAPES:
        torch.testing.assert_close(replicas[2][k], start[k] + states[2].offset.tensors[k])
        assert not torch.equal(replicas[2][k], before[k])


def test_a_retracted_delta_of_the_donors_gives_its_share_of_the_offset_back() -> None:
    """The loss guard's rollback takes a merged delta out again: what it cleared of the
    inherited offset comes back, and the replica with it."""
    s = spec(codec="topk", topk_fraction=0.1, zstd=False)
    replicas, states = _joined(s)
    outs = [st.prepare() for st in states[:2]]
    for st in states[:2]:
        st.merge([], n_peers=3)
    joiner = states[2]
    train(replicas[2], seed=9)
    joiner.prepare()
    joiner.merge([], n_peers=3)  # closes the round the donor's delta belongs to
    offset = {n: o.clone() for n, o in joiner.offset.tensors.items()}
    replica = {k: v.clone() for k, v in replicas[2].items()}
    report = joiner.absorb([received("p0", outs[0])])
    assert [t.contribution.sender for t in report.taken] == ["p0"] and report.taken[0].drained
    assert any(not torch.equal(joiner.offset.tensors[n], o) for n, o in offset.items())
    joiner.retract(report.taken)
    for n, o in offset.items():
        torch.testing.assert_close(joiner.offset.tensors[n], o)
        torch.testing.assert_close(replicas[2][n], replica[n])


def test_a_donors_own_inherited_sources_drain_the_takers_offset_too() -> None:
    """A peer that takes the state of a peer that itself holds an offset (p3 takes p2's, which
    took p0's): the deltas of both donors drain it; the transfer's donor id wins over the id
    the state names; a state's own sources are bounded, and this peer is never one."""
    s = spec(codec="topk", topk_fraction=0.1)
    replicas, states = _joined(s)
    taker = SyncState({k: v.clone() for k, v in replicas[2].items()}, s, peer_id="p3")
    taker.load_state_tensors(states[2].state_tensors())
    taker.adopt()
    assert taker.offset.sources == {"p0", "p2"}
    taker.load_state_tensors(states[2].state_tensors())
    taker.adopt("p7")  # as the transfer verified it
    assert taker.offset.sources == {"p0", "p7"}
    many = "\n".join(f"q{i}" for i in range(40)) + "\np3"
    saved = states[2].state_tensors()
    taker.load_state_tensors(
        {**saved, "sync.inherited_from": torch.tensor(list(many.encode()), dtype=torch.uint8)}
    )
    taker.adopt()
    assert len(taker.offset.sources) <= 16 and "p2" in taker.offset.sources
    assert "p3" not in taker.offset.sources


def test_the_joiner_sends_the_inherited_progress_once_the_donor_has_left() -> None:
    """A donor that sends nothing for max_staleness + 1 rounds has left the job: nobody else
    will send its progress, so the joiner sends it as its own. Alone (a whole round) and in
    consolidation (the plain average of the models) it is sent at once, and a peer that takes
    a state during consolidation holds none apart."""
    s = spec(codec="fp32", max_staleness=1)
    joiner = _joined(s)[1][2]
    assert joiner.offset.tensors
    for _ in range(s.max_staleness):
        joiner.round_boundary([], n_peers=2, whole=False)
        assert joiner.offset.tensors
    joiner.round_boundary([], n_peers=2, whole=False)
    assert not joiner.offset.tensors and joiner.offset.sources == set()
    for fold in ("alone", "consolidation"):
        _, states = _joined(s)
        inherited = {n: o.clone() for n, o in states[2].offset.tensors.items()}
        if fold == "alone":
            out = states[2].prepare(whole=True)
        else:
            states[2].average_from_now()
            out = states[2].prepare()
        assert not states[2].offset.tensors
        for n, e in out.tensors:  # nothing trained since the join: the delta is the offset
            torch.testing.assert_close(decode(e).reshape(inherited[n].shape), inherited[n])
    replicas, states = _joined(s)
    states[0].average_from_now()
    late = SyncState({k: v.clone() for k, v in replicas[0].items()}, s, peer_id="p4")
    late.load_state_tensors(states[0].state_tensors())
    late.adopt()
    assert late.averaging and not late.offset.tensors


def test_the_inherited_progress_survives_a_restart_and_bad_bytes_name_nobody() -> None:
    s = spec(codec="topk", topk_fraction=0.1)
    replicas, states = _joined(s)
    saved = states[2].state_tensors()
    assert bytes(saved["sync.served_by"].tolist()) == b"p2"
    again = SyncState({k: v.clone() for k, v in replicas[2].items()}, s, peer_id="p2")
    again.load_state_tensors(saved)
    assert again.offset.sources == {"p0"} and again.offset.heard == states[2].offset.heard
    for n, o in states[2].offset.tensors.items():
        assert torch.equal(again.offset.tensors[n], o)
    for bad in (
        torch.zeros(3),
        torch.tensor([0xFF, 0xFE], dtype=torch.uint8),
        torch.zeros(65, dtype=torch.uint8) + 97,
        torch.tensor([], dtype=torch.uint8),
        torch.zeros((2, 2), dtype=torch.uint8) + 97,
    ):
        again.load_state_tensors({**saved, "sync.served_by": bad})
        assert again.offset.served_by is None
        if bad.numel() != 65:
            again.load_state_tensors({**saved, "sync.inherited_from": bad})
            assert again.offset.sources == set()
    with pytest.raises(ValueError, match="offset w"):
        again.load_state_tensors({**saved, "inherited.w": torch.zeros(5)})
