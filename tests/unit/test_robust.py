"""The robust merge (atomd.sync.robust), far-future claims, and the loss guard (sync.guard)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from atomd.sync.guard import LossGuard
from atomd.sync.robust import RobustRule, Screen, lower_median
from atomd.sync.state import MAX_CLAIM_AHEAD, Contribution, SyncState
from tests.unit.test_sync_state import SHAPES, received, spec, swarm, train


def delta(scale: float, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def norm(t: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float(x.double().square().sum()) for x in t.values()))


def test_lower_median_ignores_one_high_outlier_of_two() -> None:
    assert lower_median([1.0, 1e30]) == 1.0
    assert lower_median([3.0, 1.0, 2.0]) == 2.0


def test_honest_sized_deltas_pass_untouched() -> None:
    screen = Screen()
    screen.record_own(0, delta(0.1, 0))
    d = delta(0.1, 1)
    j = screen.judge(0, d)
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike
    assert j.tensors is not None
    assert all(torch.equal(j.tensors[n], d[n]) for n in SHAPES)


@pytest.mark.parametrize("attack", ["const5", "scale100", "scale1e30"])
def test_outliers_are_refused_as_strikes(attack: str) -> None:
    screen = Screen()
    own = delta(0.1, 0)
    screen.record_own(0, own)
    honest = delta(0.1, 1)
    bad = {
        "const5": {n: torch.full(s, 5.0) for n, s in SHAPES.items()},
        "scale100": {n: 100 * t for n, t in honest.items()},
        "scale1e30": {n: 1e30 * t for n, t in honest.items()},
    }[attack]
    j = screen.judge(0, bad)
    assert not j.accepted and j.strike and j.reason is not None and "outlier" in j.reason


def test_a_moderately_large_delta_is_clipped_to_the_bound() -> None:
    rule = RobustRule()
    screen = Screen(rule)
    own = delta(0.1, 0)
    screen.record_own(0, own)
    big = {n: 10 * t for n, t in delta(0.1, 1).items()}  # 10x: above clip, below refuse
    j = screen.judge(0, big)
    assert j.accepted and j.tensors is not None and j.reason and "clipped" in j.reason
    assert norm(j.tensors) <= rule.clip_ratio * norm(own) * 1.0001
    assert j.strike, "scaled by less than strike_scale (0.5): counts against the sender"
    j = screen.judge(0, {n: 3 * t for n, t in delta(0.1, 2).items()})  # a peer 3x as fast
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike


def test_one_huge_coordinate_is_clipped_per_coordinate() -> None:
    screen = Screen()
    own = delta(0.1, 0)
    screen.record_own(0, own)
    d = delta(0.1, 1)
    d["e"][0] = 3.0  # small overall norm, one entry far beyond any honest one
    j = screen.judge(0, d)
    assert j.accepted and j.tensors is not None
    bound = RobustRule().coord_ratio * float(own["e"].abs().max())
    assert float(j.tensors["e"].abs().max()) <= bound * 1.0001


def test_without_its_own_delta_a_peer_judges_nothing() -> None:
    j = Screen().judge(5, delta(0.1, 1))
    assert not j.accepted and not j.strike and j.reason and "no reference" in j.reason


def test_a_poisoned_delta_never_reaches_the_replica() -> None:
    """Real SyncStates: the hostile p2 sends all 5.0 for round 0; p0 merges p1 and refuses p2."""
    replicas, states = swarm(3, spec())
    for i in range(3):
        train(replicas[i], seed=i)
    honest = received("p1", states[1].round_boundary([], n_peers=3))
    poison = Contribution("p2", 0, 0, {n: torch.full(s, 5.0) for n, s in SHAPES.items()})
    before = {k: v.clone() for k, v in replicas[0].items()}
    states[0].round_boundary([honest, poison], n_peers=3)
    merge = states[0].last_merge
    assert [a.sender for a in merge.applied] == ["p1"]
    assert [(r.sender, r.strike) for r in merge.refused] == [("p2", True)]
    assert all(float((replicas[0][k] - before[k]).abs().max()) < 1.0 for k in SHAPES)


def test_a_far_future_claim_does_not_change_the_pace() -> None:
    """Issue #15: one frame claiming round 1e9 made the peers close a round at every step."""
    replicas, states = swarm(3, spec(max_staleness=2))
    me = states[0]
    far = Contribution("evil", 10**9, 10**9, {n: torch.zeros(s) for n, s in SHAPES.items()})
    me.absorb([far])
    assert me.rounds_behind() == 0
    near = Contribution("evil", 9, me.version + MAX_CLAIM_AHEAD // 2, far.tensors)
    me.absorb([near])  # refused as ahead; one sender's claim is 1 of 1 senders here ...
    train(replicas[1], seed=1)
    honest = received("p1", states[1].round_boundary([], n_peers=3))
    me.absorb([honest])  # ... but the lower median of {honest, evil} is the honest one
    assert me.rounds_behind() == 1


def _round_zero() -> tuple[list[dict[str, Tensor]], list[SyncState], Contribution, Contribution]:
    """Three peers closed round 0; p0 has p1's delta and p2's as sent."""
    replicas, states = swarm(3, spec())
    for i in range(3):
        train(replicas[i], seed=i)
    outs = [s.round_boundary([], n_peers=3) for s in states]
    return replicas, states, received("p1", outs[1]), received("p2", outs[2])


def test_the_loss_guard_rolls_back_a_merge_that_makes_the_loss_jump() -> None:
    """p2 sends p1's delta sign-flipped at 1.45x (under the clip: the norm rule lets it by).
    The probe is a linear 'loss' that p1's delta lowers; merged together the loss
    rises, so the guard rolls back, merges each alone, keeps p1's and refuses p2's."""
    twin_replicas, twin_states, honest, _ = _round_zero()
    twin_states[0].absorb([honest])
    target = {k: v.clone() for k, v in twin_replicas[0].items()}

    replicas, states, honest, sent = _round_zero()
    hostile = Contribution("p2", sent.round, sent.base_version,
                           {k: -1.45 * t for k, t in honest.tensors.items()})  # fmt: skip
    x0 = {k: v.clone() for k, v in replicas[0].items()}

    def probe() -> float:  # -<h, x - x0>: lower as the replica moves along p1's delta
        return -100 * sum(float((honest.tensors[k] * (replicas[0][k] - x0[k])).sum())
                          for k in SHAPES)  # fmt: skip

    guard = LossGuard(states[0], probe, max_rise=0.05, max_rise_ratio=0.05)
    report = guard.absorb([honest, hostile])
    assert guard.rollbacks == 1
    assert [a.sender for a in report.applied] == ["p1"]
    assert [a.note for a in report.applied] == [None]
    assert [(r.sender, r.strike) for r in report.refused] == [("p2", True)]
    assert "loss jump" in report.refused[0].reason
    for k in SHAPES:  # exactly where merging the honest delta alone brings it
        torch.testing.assert_close(replicas[0][k], target[k])
    assert states[0].deltas_in(0) == 2, "own and p1's: p2's was taken out again"


def test_the_loss_guard_needs_the_robust_rule() -> None:
    s = SyncState({"w": torch.zeros(2)}, spec(), robust=None)
    with pytest.raises(ValueError, match="robust"):
        LossGuard(s, lambda: 0.0)


def test_the_loss_guard_reuses_a_recent_probe_as_the_loss_before_a_merge() -> None:
    """One probe pass per merge: the loss after the last merge stands for the loss before the
    next one while at most ``reuse_steps`` training steps lie between them."""
    _, states, honest, sent = _round_zero()
    calls: list[int] = []

    def probe() -> float:
        calls.append(1)
        return 2.0

    guard = LossGuard(states[0], probe, reuse_steps=2)
    guard.absorb([honest])
    assert guard.probes == len(calls) == 2  # nothing measured yet: before and after
    guard.stepped()
    guard.stepped()
    guard.absorb([sent])
    assert guard.probes == 3  # 2 steps since: the last probe stands for the loss before
    other = Contribution("p3", sent.round, sent.base_version, sent.tensors)
    for _ in range(3):
        guard.stepped()
    guard.absorb([other])
    assert guard.probes == 5  # 3 steps since: measured again
    far = Contribution("p4", 7, states[0].version, sent.tensors)
    guard.absorb([far])  # of a round not closed here: held, nothing moves, nothing probed
    assert guard.probes == 5
