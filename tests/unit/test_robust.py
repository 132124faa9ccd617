"""The robust merge (atomd.sync.robust), far-future claims, and the loss guard (sync.guard)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from atomd.sync.guard import LossGuard
from atomd.sync.intake import Contribution
from atomd.sync.pace import MAX_CLAIM_AHEAD
from atomd.sync.robust import Progress, RobustRule, Screen, lower_median
from atomd.sync.state import SyncState
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


def test_a_longer_round_said_by_its_frame_raises_the_clip_bound_and_the_strikes() -> None:
    """At a slow link rounds of one number last different steps at different peers (4 real
    daemons at 256 kbit/s can close round 2 after 4 to 15 steps, in the warm-up), and two
    peers would clip honest deltas of 4.5-6 x their own, so their anchors leave the others'. A
    frame that says its round lasted 3x this peer's steps is clipped at up to ``steps_ratio``
    (2) x the bound; one that claims a huge round gains no more: its delta merges clipped to
    that bound, and beyond ``refuse_ratio`` (twice the raised bound) it is refused and struck
    whatever it claims."""
    rule = RobustRule()
    own = delta(0.1, 0)
    six = {n: 6 * t for n, t in delta(0.1, 1).items()}
    screen = Screen(rule)
    screen.record_own(0, own, steps=2)
    j = screen.judge(0, six)  # the frame says nothing: clipped at 4x, as before
    assert j.reason and "clipped" in j.reason and not j.strike
    screen = Screen(rule)
    screen.record_own(0, own, steps=2)
    j = screen.judge(0, six, every=6)
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike
    liar = {n: 10 * t for n, t in delta(0.1, 2).items()}
    j = screen.judge(0, liar, every=10_000)
    assert j.accepted and j.tensors is not None and j.reason and "clipped" in j.reason
    bound = rule.clip_ratio * rule.steps_ratio * norm(own)
    assert norm(j.tensors) <= bound * 1.0001
    assert not j.strike  # 10x: within 1 / strike_scale of the raised bound (8x)
    # Twice the raised bound (16x) is the refusal's bound too: below it clipped, not struck;
    # beyond it refused and struck, whatever the frame claims.
    for times, struck in ((15, False), (17, True)):
        fresh = Screen(rule)  # judged against the own delta alone, as the first was
        fresh.record_own(0, own, steps=2)
        j = fresh.judge(0, {n: times * t for n, t in delta(0.1, 2).items()}, every=10_000)
        assert j.strike is struck
        if times > rule.refuse_ratio:
            assert not j.accepted and j.reason and "outlier" in j.reason
        else:
            assert j.tensors is not None and norm(j.tensors) <= bound * 1.0001
    # A round 1.5x this peer's: the strike's threshold is twice the raised bound (12x).
    for times, struck in ((11, False), (13, True)):
        fresh = Screen(rule)
        fresh.record_own(0, own, steps=2)
        j = fresh.judge(0, {n: times * t for n, t in delta(0.1, 1).items()}, every=3)
        assert j.accepted and j.reason and "clipped" in j.reason and j.strike is struck
    screen = Screen(rule)
    screen.record_own(0, own, steps=2)
    j = screen.judge(0, six, every=1)  # a shorter round: the bound as it was
    assert j.reason and "clipped" in j.reason


def test_a_longer_round_in_the_warm_up_is_weighed_by_its_learning_rates() -> None:
    """The job's first peer can close round 0 after 4 steps, the others after 1; in the
    learning rate's warm-up its honest delta is then ~10x theirs (1+2+3+4 against 1), clipped
    to 8x (4 x steps_ratio) by steps alone, and its settled anchor would end 1.1e-4 from
    theirs for good. Weighed by the schedule, 4 steps claimed against 1 (counted as 2,
    steps_ratio) earn 3x (1+2 against 1), so the clip bound is 12x: the delta passes whole.
    The strike is judged against the raised bound too (the honest first peer took one strike
    at each receiver when it was not); where the rate falls the bound is the steps' (the
    weights only ever raise it)."""
    warm = 50
    lr = lambda step: 3e-3 * min(1.0, (step + 1) / warm)  # noqa: E731 - the schedule's shape
    own = delta(0.1, 0)
    longer = {n: 11 * t for n, t in delta(0.1, 1).items()}  # over 10x: first=1 would clip it
    plain = Screen()
    plain.record_own(0, own, steps=1, first=0)
    j = plain.judge(0, longer, every=4)  # without the schedule: by steps, clipped at 8x
    assert j.reason and "clipped" in j.reason and j.tensors is not None
    assert norm(j.tensors) <= 8 * norm(own) * 1.0001
    screen = Screen(lr=lr)
    screen.record_own(0, own, steps=1, first=0)
    j = screen.judge(0, longer, every=4)
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike, j.reason
    liar = {n: 13 * t for n, t in delta(0.1, 2).items()}
    j = screen.judge(0, liar, every=10_000)  # the claim is held to 2x the steps: 3x the rate
    assert j.tensors is not None and norm(j.tensors) <= 12 * norm(own) * 1.0001
    assert j.reason and "clipped" in j.reason and not j.strike  # twice the raised bound: 24x
    fresh = Screen(lr=lr)
    fresh.record_own(0, own, steps=1, first=0)
    j = fresh.judge(0, {n: 17 * t for n, t in delta(0.1, 2).items()}, every=4)
    assert not j.accepted and j.strike  # beyond refuse_ratio (16x), whatever its round
    for first in (200, 590):  # past the warm-up, and where the rate falls: as by steps
        late = Screen(lr=lambda step: 3e-3 * (600 - step) / 600)
        late.record_own(0, own, steps=1, first=first)
        j = late.judge(0, longer, every=4)
        assert j.reason and "clipped" in j.reason and j.tensors is not None
        assert (
            norm(j.tensors) <= 8 * norm(own) * 1.0001 and norm(j.tensors) >= 8 * norm(own) * 0.9999
        )


def test_smaller_deltas_never_lower_the_reference_below_half_the_own_delta() -> None:
    """With two in the pool the lower median is the smaller: a near-zero delta accepted first
    made the next honest delta of the round an outlier (refused, a strike against an honest
    peer), and a peer just restarted (small deltas in its LayerNorm tensors) made the others
    clip each other's there. Half the own delta's statistics are the reference's floor."""
    screen = Screen()
    own = delta(0.1, 0)
    screen.record_own(0, own)
    tiny = screen.judge(0, delta(1e-4, 1))
    assert tiny.accepted and tiny.reason is None
    honest = delta(0.1, 2)
    j = screen.judge(0, honest)
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike, j.reason
    small_b = {n: (t * 1e-3 if n == "b" else t) for n, t in delta(0.1, 3).items()}
    screen = Screen()
    screen.record_own(0, own)
    assert screen.judge(0, small_b).reason is None  # small in one tensor only
    j = screen.judge(0, delta(0.1, 4))
    assert j.reason is None, j.reason  # its b is judged by half the own b, not the small one


def test_a_longer_round_earns_noise_no_more_room() -> None:
    """Noise (a delta that does not point along this peer's progress beyond chance) is held to
    the reference whatever its frame says of its round's steps."""
    own = drift(0, steps=1.0, share=0.0)
    for every in (None, 10_000):
        screen = Screen()
        screen.record_own(0, own, steps=1)
        j = screen.judge(0, noise(1.9, own, seed=3), toward=Progress.of(own), every=every)
        assert j.reason and "unaligned" in j.reason, j.reason
        assert j.tensors is not None and norm(j.tensors) <= norm(own) * 1.0001


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
    """One frame claiming round 1e9 does not make the peers close a round at every step."""
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


def test_a_round_boundary_counts_as_one_move_and_keeps_the_last_probe() -> None:
    """At a round every 2 steps the deltas of the round before are merged at the boundary:
    were the restart to void the last probe, each round would run two passes (the loss
    before its merge and after). The restart counts as one move of the replica."""
    replicas, states, honest, sent = _round_zero()
    me = states[0]
    calls: list[int] = []

    def probe() -> float:
        calls.append(1)
        return 2.0

    guard = LossGuard(me, probe, reuse_steps=4)
    guard.absorb([honest])
    assert guard.probes == 2  # nothing measured yet: before and after
    for round_ in range(3):
        for _ in range(2):
            train(replicas[0], seed=20 + round_)
            guard.stepped()
        out = guard.round_boundary([sent] if round_ == 0 else [], n_peers=3)
        assert out.round == round_ + 1
    # Round 1's boundary merged p2's delta of round 0 (3 moves after the last probe: the
    # older probe stood for the loss before, 1 pass); the two after it merged nothing.
    assert guard.probes == len(calls) == 3
    assert [a.sender for a in me.last_merge.applied] == []
    for _ in range(2):
        guard.stepped()
    guard.forget()  # a state taken from another peer: nothing stands for it any more
    late = Contribution("p1", 1, 1, honest.tensors)
    guard.absorb([late])
    assert guard.probes == 5


def test_a_jump_against_an_older_probe_is_judged_again_before_a_delta_is_refused() -> None:
    """The loss rose since the last probe without any delta (the replica moved: training or a
    boundary's outer step), then an honest delta arrives. Judged against the older probe it
    looks like a jump; the guard measures the replica without it and keeps it: no strike."""
    _, states, honest, _ = _round_zero()
    level = [1.0]
    guard = LossGuard(states[0], lambda: level[0], max_rise=0.5, max_rise_ratio=0.15)
    guard.absorb([honest])  # measured: 1.0 before and after
    assert guard.probes == 2
    guard.stepped()
    level[0] = 2.0  # the replica's loss rose by 1 nat without a merge
    hostile_looking = Contribution("p2", honest.round, honest.base_version, honest.tensors)
    report = guard.absorb([hostile_looking])
    assert guard.rollbacks == 1  # the careful path ran ...
    assert [a.sender for a in report.applied] == ["p2"]  # ... and kept the delta
    assert report.refused == []
    assert guard.probes == 5  # after (jump?), the replica without it, with it alone
    # A real jump against a fresh probe is still refused, a strike.
    bad = Contribution("p3", honest.round, honest.base_version, honest.tensors)

    def jumping() -> float:  # the loss jumps once p3's delta is merged
        return 10.0 if states[0].deltas_in(0) > 3 else 2.0

    guard.probe = jumping
    guard.forget()
    report = guard.absorb([bad])
    assert [(r.sender, r.strike) for r in report.refused] == [("p3", True)]
    assert states[0].deltas_in(0) == 3


# -- the direction check (a delta of honest size pointed the wrong way) -----------------------

BIG = {"w": (200, 150), "b": (150,), "e": (80, 64)}  # 35,270 entries: chance 5/sqrt(n) = 0.027


def drift(
    seed: int, steps: float = 1.0, share: float = 1.0, shapes: dict[str, tuple[int, ...]] = BIG
) -> dict[str, Tensor]:
    """An honest-like delta: ``steps`` steps along a direction every peer shares, plus noise
    of its own (equal norms per step: honest cosines of ~0.5, as training gives)."""
    g = torch.Generator().manual_seed(7)
    common = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    g = torch.Generator().manual_seed(100 + seed)
    own = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    root = math.sqrt(steps)  # the noise of several steps adds up as a random walk
    return {n: 1e-3 * (steps * share * common[n] + root * own[n]) for n in shapes}


def topk(d: dict[str, Tensor], fraction: float = 0.01) -> dict[str, Tensor]:
    """What the top-k codec keeps of ``d``: its largest entries per tensor, the rest 0."""
    out = {}
    for n, t in d.items():
        flat = t.reshape(-1)
        k = max(1, int(fraction * flat.numel()))
        keep = torch.zeros_like(flat)
        idx = flat.abs().topk(k).indices
        keep[idx] = flat[idx]
        out[n] = keep.reshape(t.shape)
    return out


def noise(scale: float, like: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = {n: torch.randn(t.shape, generator=g) for n, t in like.items()}
    return {n: t * (scale * norm(like) / norm(raw)) for n, t in raw.items()}


@pytest.mark.parametrize("sparse", [False, True])
def test_a_sign_flipped_honest_delta_is_refused_without_a_strike(sparse: bool) -> None:
    """The hostile member sends its honest delta with the sign flipped: its norm is honest (the
    norm rule lets it by), its cosine with this peer's own delta is minus an honest one. Refused,
    not struck: honest peers out of step send opposed deltas too (``atomd.sync.robust``)."""
    keep = topk if sparse else (lambda d: d)
    screen = Screen()
    screen.record_own(0, keep(drift(0)))
    flipped = {n: -t for n, t in keep(drift(1)).items()}
    j = screen.judge(0, flipped, toward=Progress.of(drift(0)))
    assert not j.accepted and not j.strike and j.reason is not None and "opposed" in j.reason
    assert j.cosine is not None and j.cosine < -0.05
    # Without the direction check it passed untouched: what the check adds.
    plain = Screen(RobustRule(direction=False))
    plain.record_own(0, keep(drift(0)))
    j = plain.judge(0, flipped, toward=Progress.of(drift(0)))
    assert j.accepted and j.reason is None and not j.strike


@pytest.mark.parametrize("sparse", [False, True])
def test_a_noise_delta_is_held_to_the_own_norm(sparse: bool) -> None:
    """Noise points nowhere (cosine ~0): dense at 3x an honest delta's norm, or noise of 10x
    sent in top-k (what survives top-k 1 % of Gaussian noise is ~0.29 of its norm: ~2.9x).
    Both are under the 4x a faster honest peer gets, so the norm rule let them by untouched;
    now they get no more than the reference norm. Not a strike: an honest peer back from a
    stall sends deltas like these (``atomd.sync.robust``); a norm that would strike an aligned
    delta still does."""
    rule = RobustRule()
    own = topk(drift(0)) if sparse else drift(0)
    bad = topk(noise(10.0, own, seed=5)) if sparse else noise(3.0, own, seed=5)
    assert 2.5 * norm(own) < norm(bad) < 3.5 * norm(own)
    screen = Screen(rule)
    screen.record_own(0, own)
    j = screen.judge(0, bad, toward=Progress.of(drift(0)))
    assert j.accepted and j.tensors is not None and j.reason and "unaligned" in j.reason
    assert j.cosine is not None and abs(j.cosine) < 0.02
    assert norm(j.tensors) <= rule.unaligned_ratio * norm(own) * 1.0001
    assert not j.strike
    big = {n: t * 3.0 for n, t in bad.items()}  # ~9x: beyond twice the aligned bound (4x)
    j = screen.judge(0, big, toward=Progress.of(drift(0)))
    assert j.accepted and j.reason and "unaligned" in j.reason and j.strike
    plain = Screen(RobustRule(direction=False))  # the rule without the direction check
    plain.record_own(0, own)
    j = plain.judge(0, bad, toward=Progress.of(drift(0)))
    assert j.accepted and j.reason is None and not j.strike


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("steps", [0.5, 1.0, 2.0, 4.0])
def test_honest_deltas_at_every_pace_pass_the_direction_check_untouched(
    sparse: bool, steps: float
) -> None:
    """A peer taking 1/2 to 4x this peer's steps per round: a delta up to ~3x the norm, aligned;
    it passes exactly as sent (the honest anchors must agree)."""
    keep = topk if sparse else (lambda d: d)
    screen = Screen()
    screen.record_own(0, keep(drift(0)))
    d = keep(drift(1, steps=steps))
    j = screen.judge(0, d, toward=Progress.of(drift(0)))
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike, j.reason
    assert j.tensors is not None and all(torch.equal(j.tensors[n], d[n]) for n in BIG)
    assert j.cosine is not None and j.cosine > 0.05


def test_a_weakly_aligned_honest_delta_still_gets_the_pace_allowance() -> None:
    """An honest peer on a different shard shares less of the direction (cosine ~0.2): 4x its
    norm still passes untouched."""
    screen = Screen()
    screen.record_own(0, drift(0, share=0.5))
    d = drift(1, steps=4.0, share=0.5)
    j = screen.judge(0, d, toward=Progress.of(drift(0, share=0.5)))
    assert j.cosine is not None and 0.05 < j.cosine < 0.5
    assert j.accepted and j.reason is None and j.scale == 1.0


def test_in_few_dimensions_a_cosine_is_no_evidence() -> None:
    """Random deltas in 45 dimensions have cosines of +-0.15: below 5/sqrt(45) = 0.75 the
    direction check does nothing (the norm rule alone judges), so toy models keep working."""
    g = torch.Generator().manual_seed(3)
    own = {"w": torch.randn(9, 5, generator=g)}
    screen = Screen()
    screen.record_own(0, own)
    other = {"w": -own["w"] + 2.0 * torch.randn(9, 5, generator=g)}  # cosine ~ -0.4
    j = screen.judge(0, other, toward=Progress.of(own))
    assert j.cosine is not None and -0.75 < j.cosine < -0.1
    assert j.accepted and j.reason is None


def test_consolidation_deltas_are_not_judged_by_direction() -> None:
    """Consolidation rounds send each peer's difference from the mean: the two peers' deltas
    are opposite by design. The state switched to averaging merges them."""
    shapes = {"w": (128, 128)}  # 16,384 weights: the check runs (chance 0.039)
    init = torch.zeros(shapes["w"])
    replicas = [{"w": init.clone()} for _ in range(2)]
    states = [SyncState(r, spec(), peer_id=f"p{i}") for i, r in enumerate(replicas)]
    step = 1e-2 * torch.randn(shapes["w"], generator=torch.Generator().manual_seed(0))
    replicas[0]["w"].add_(step)
    replicas[1]["w"].sub_(step)
    for s in states:
        s.average_from_now()
    outs = [s.prepare() for s in states]
    report = states[0].merge([received("p1", outs[1])], n_peers=2)
    assert [a.sender for a in report.applied] == ["p1"] and not report.refused
    assert report.applied[0].cosine is None  # not judged by direction at all
    # judged by it, the difference from the mean would have been refused as opposed
    opposed = Screen()
    opposed.record_own(0, {"w": step})
    assert not opposed.judge(0, {"w": -step}, toward=Progress.of({"w": step})).accepted


def test_a_sign_flipping_member_is_refused_by_real_sync_states() -> None:
    """Three honest SyncStates training along a shared direction (top-k 1 %) and a fourth that
    sends its delta sign-flipped: every honest peer refuses it (as opposed: not a strike),
    merges the others untouched, and the honest anchors agree."""
    init = {n: torch.zeros(s) for n, s in BIG.items()}
    replicas = [{k: v.clone() for k, v in init.items()} for _ in range(4)]
    sync = spec(codec="topk", topk_fraction=0.01)
    states = [SyncState(r, sync, peer_id=f"p{i}") for i, r in enumerate(replicas)]
    for rnd in range(4):
        for i, r in enumerate(replicas):
            for n, t in drift(10 * rnd + i).items():
                r[n].add_(t)
        outs = [s.prepare() for s in states]
        sent = [received(f"p{i}", o) for i, o in enumerate(outs)]
        sent[3] = Contribution("p3", sent[3].round, sent[3].base_version,
                               {n: -t for n, t in sent[3].tensors.items()})  # fmt: skip
        for i in range(3):
            report = states[i].merge([c for j, c in enumerate(sent) if j != i], n_peers=4)
            assert sorted(a.sender for a in report.applied) == sorted(
                f"p{j}" for j in range(3) if j != i
            )
            assert all(a.note is None for a in report.applied)
            assert [(r.sender, r.strike) for r in report.refused] == [("p3", False)]
            assert "opposed" in report.refused[0].reason
            # It came, and will not come again: no hold waits for it.
            assert "p3" in states[i].senders_in(sent[3].base_version)
        states[3].merge([], n_peers=4)
    for s in states[1:3]:
        assert s.committed.divergence(states[0].anchor) < 1e-7


def test_the_loss_guard_guards_the_rounds_a_finished_peer_follows() -> None:
    """A followed round has no own delta to judge directions by, so a sign-flipped delta of
    honest size passes the norm rule; the probe catches it: the round is merged with p1's
    delta alone, p2's refused as a strike."""
    replicas, states, _, _ = _round_zero()  # every peer closed round 0
    me, p1 = states[0], states[1]
    train(replicas[1], seed=11)
    honest = received("p1", p1.round_boundary([], n_peers=2))
    hostile = Contribution("p2", honest.round, honest.base_version,
                           {k: -1.45 * t for k, t in honest.tensors.items()})  # fmt: skip
    x0 = {k: v.clone() for k, v in replicas[0].items()}

    def probe() -> float:  # lower as the replica moves along p1's delta
        return -100 * sum(float((honest.tensors[k] * (replicas[0][k] - x0[k])).sum())
                          for k in SHAPES)  # fmt: skip

    guard = LossGuard(me, probe, max_rise=0.05, max_rise_ratio=0.05)
    assert guard.follow([honest, hostile])
    report = me.last_merge
    assert guard.rollbacks == 1 and me.version == 2
    assert [a.sender for a in report.applied] == ["p1"]
    assert [(r.sender, r.strike) for r in report.refused] == [("p2", True)]
    assert me.deltas_in(1) == 1


def test_a_round_closed_early_judges_by_the_steps_the_round_holds() -> None:
    """A joiner catching up with the swarm closes rounds after one step each; the others'
    deltas of those rounds hold H steps. Judged against its 1-step delta, an honest 5-step
    delta that does not point along it beyond chance (early in training, tiny batches) was
    clipped hard, a strike: a joiner quarantined its honest donor that way (test_hostile under
    load). Scaled by the steps the round holds, it passes as sent."""
    own = drift(0, steps=1.0, share=0.0)
    theirs = drift(1, steps=5.0, share=0.0)
    screen = Screen()
    screen.record_own(0, own)
    j = screen.judge(0, theirs, toward=Progress.of(own))
    assert j.reason and "unaligned" in j.reason  # what happened before (then a strike too)
    screen = Screen()
    screen.record_own(0, own, steps_short=5.0)
    j = screen.judge(0, theirs, toward=Progress.of(own))
    assert j.accepted and j.reason is None and j.scale == 1.0 and not j.strike
    # Still bounded: noise of 3x the round's reference (15x the own 1-step delta) is held to
    # the reference (not a strike: the direction never strikes).
    j = screen.judge(0, noise(15.0, own, seed=3), toward=Progress.of(own))
    assert j.accepted and j.reason and "unaligned" in j.reason and not j.strike


def test_honest_frames_that_share_few_entries_pass_untouched_and_the_anchors_agree() -> None:
    """At the small shares a slow link gets (top-k 0.25 %), two honest peers' frames share few
    entries: judged against the own *frame*, their cosine fell within chance, so a peer taking
    more steps a round was held to the reference by some peers and not by others, and the
    anchors drifted apart (atomd bench sync: 9e-4). Judged against the own progress (dense),
    every honest delta passes as sent and the anchors agree."""
    shapes = {"w": (1000, 1000)}  # the tiny preset's size: at 0.25 %, 2,500 entries a frame
    init = {n: torch.zeros(s) for n, s in shapes.items()}
    replicas = [{k: v.clone() for k, v in init.items()} for _ in range(3)]
    sync = spec(codec="topk", topk_fraction=0.0025)
    states = [SyncState(r, sync, peer_id=f"p{i}") for i, r in enumerate(replicas)]
    chance = RobustRule().chance_z / math.sqrt(sum(math.prod(s) for s in shapes.values()))
    frame_cosines = []
    for rnd in range(3):
        for i, r in enumerate(replicas):  # p1 takes twice the steps of the others a round
            steps = 2.0 if i == 1 else 1.0
            for n, t in drift(10 * rnd + i, steps=steps, share=0.3, shapes=shapes).items():
                r[n].add_(t)
        outs = [s.prepare() for s in states]
        sent = [received(f"p{i}", o) for i, o in enumerate(outs)]
        frame_cosines += [
            sum(float((a.tensors[n] * b.tensors[n]).sum()) for n in shapes)
            / (norm(a.tensors) * norm(b.tensors))
            for i, a in enumerate(sent)
            for b in sent[i + 1 :]
        ]
        for i, s in enumerate(states):
            report = s.merge([c for j, c in enumerate(sent) if j != i], n_peers=3)
            assert not report.refused
            assert all(a.note is None for a in report.applied), [a.note for a in report.applied]
            assert all(a.cosine is not None and a.cosine > chance for a in report.applied)
    assert min(abs(c) for c in frame_cosines) < chance  # what the frames alone would show
    for s in states[1:]:
        assert s.committed.divergence(states[0].anchor) < 1e-7


@pytest.mark.parametrize("flip", [False, True])
def test_dense_deltas_opposed_pairwise_are_judged_alike_by_every_receiver(flip: bool) -> None:
    """fp32 a round a step: two peers' one-step deltas can point against each other (honest
    AdamW steps of the tiny task: cosines down to -0.17 against c = 0.0054).
    Judged against each receiver's own one-step progress, p1 and p2 refused each other while
    p0 and p3 merged both, and the anchors parted for good (``atomd bench sync``'s
    fp32-h1-sync-plain: 0.109). Judged against the swarm's last round (its deltas as unit
    vectors), every honest delta passes as sent and the anchors agree, and a delta sent
    sign-flipped is still refused by every honest peer, a strike."""
    shapes = {"w": (200, 150), "e": (80, 64)}  # 35,120 entries: chance 0.027
    g = torch.Generator().manual_seed(0)
    u = {n: 1e-3 * torch.randn(s, generator=g) for n, s in shapes.items()}  # shared direction
    w = {n: 1.5e-3 * torch.randn(s, generator=g) for n, s in shapes.items()}  # p1's, -p2's
    replicas = [{n: torch.zeros(s) for n, s in shapes.items()} for _ in range(4)]
    states = [SyncState(r, spec(), peer_id=f"p{i}") for i, r in enumerate(replicas)]
    hostile = 3 if flip else None
    for rnd in range(4):
        for i, r in enumerate(replicas):
            side = (1.0 if i == 1 else -1.0 if i == 2 else 0.0) if rnd else 0.0
            for n in shapes:
                r[n].add_(u[n] + side * w[n])
        outs = [s.prepare() for s in states]
        sent = [received(f"p{i}", o) for i, o in enumerate(outs)]
        if hostile is not None and rnd:
            c = sent[hostile]
            sent[hostile] = Contribution(c.sender, c.round, c.base_version,
                                         {n: -t for n, t in c.tensors.items()})  # fmt: skip
        if rnd:  # what each receiver's own progress says of p2's delta: opposed to p1's
            own = Screen()
            own.record_own(rnd, sent[1].tensors)
            assert not own.judge(rnd, sent[2].tensors, toward=Progress.of(sent[1].tensors)).accepted
        honest = [i for i in range(4) if i != hostile or not rnd]
        for i, s in enumerate(states):
            report = s.merge([c for j, c in enumerate(sent) if j != i], n_peers=4)
            if i == hostile:
                continue
            want = {f"p{j}" for j in honest if j != i}
            assert {a.sender for a in report.applied} == want, report.refused
            assert all(a.note is None for a in report.applied)
            if hostile is not None and rnd:
                assert [(r.sender, r.strike) for r in report.refused] == [(f"p{hostile}", False)]
                assert "opposed" in report.refused[0].reason
    for i in (1, 2):
        assert states[i].committed.divergence(states[0].anchor) < 1e-7


def test_a_member_cannot_steer_the_dense_direction_reference() -> None:
    """A member that knows the swarm's last round sends 3.9x the reference along it by just
    over chance plus the opposite of its own honest step (what the others' next steps share):
    it is merged (aligned, under 4x), but in the reference it counts as one unit vector, like
    each honest delta, so the honest peers keep merging each other untouched and their anchors
    agree. (With plain sums, 0fed8da, from the third round on every honest peer refused every
    other honest delta as opposed, with strikes.)"""
    n, hostile = 200_000, 3
    g = torch.Generator().manual_seed(0)
    u = 1e-3 * torch.randn(400, 500, generator=g)  # the shared direction
    replicas = [{"w": torch.zeros(400, 500)} for _ in range(4)]
    states = [SyncState(r, spec(), peer_id=f"p{i}") for i, r in enumerate(replicas)]
    chance = RobustRule().chance_z / math.sqrt(n)
    for rnd in range(10):
        for r in replicas:
            r["w"].add_(u + 2e-3 * torch.randn(400, 500, generator=g))
        sent = [received(f"p{i}", s.prepare()) for i, s in enumerate(states)]
        if rnd:
            honest = sent[hostile].tensors["w"]
            ref = states[0].directions.before(sent[hostile].base_version)
            assert ref is not None
            s_hat = ref["w"] / ref["w"].norm()
            w = -honest / honest.norm()
            w = w - (w * s_hat).sum() * s_hat
            d = 2 * chance * s_hat + w / w.norm()
            c = sent[hostile]
            sent[hostile] = Contribution(c.sender, c.round, c.base_version,
                                         {"w": 3.9 * honest.norm() * d / d.norm()})  # fmt: skip
        for i, s in enumerate(states):
            report = s.merge([c for j, c in enumerate(sent) if j != i], n_peers=4)
            if i == hostile:
                continue
            assert not report.refused, report.refused
            honest_applied = [a for a in report.applied if a.sender != f"p{hostile}"]
            assert len(honest_applied) == 2 and all(a.note is None for a in honest_applied)
            assert all(a.cosine is not None and a.cosine > 0.1 for a in honest_applied)
    for i in (1, 2):
        assert states[i].committed.divergence(states[0].anchor) < 1e-7


def test_a_tiny_delta_does_not_poison_the_dense_direction_reference() -> None:
    """A member's delta with a norm below 1 / float32's largest (one entry of 1e-40, the rest
    0: finite, passes every check, accepted as small) enters the round's sum of unit vectors
    (``RoundDirections.add``) as ``add_(x, alpha=1 / norm)``: alpha 1e40 does not fit a
    float32, and torch raises RuntimeError on the trainer thread: the job fails, at every
    honest peer that merges the frame. The merge must go on, the reference stay finite, and
    the sign-flipped delta of the next round still be refused as opposed."""
    shapes = {"w": (200, 150), "e": (80, 64)}
    g = torch.Generator().manual_seed(0)
    u = {n: 1e-3 * torch.randn(s, generator=g) for n, s in shapes.items()}
    replicas = [{n: torch.zeros(s) for n, s in shapes.items()} for _ in range(4)]
    states = [SyncState(r, spec(), peer_id=f"p{i}") for i, r in enumerate(replicas)]
    hostile = 3
    for rnd in range(3):
        for r in replicas:
            for n in shapes:
                r[n].add_(u[n] + 2e-4 * torch.randn(r[n].shape, generator=g))
        sent = [received(f"p{i}", s.prepare()) for i, s in enumerate(states)]
        c = sent[hostile]
        if rnd == 1:  # a delta of ~underflow norm
            tiny = {n: torch.zeros(s) for n, s in shapes.items()}
            tiny["w"][0, 0] = 1e-40
            sent[hostile] = Contribution(c.sender, c.round, c.base_version, tiny)
        if rnd == 2:  # sign-flipped honest delta
            sent[hostile] = Contribution(c.sender, c.round, c.base_version,
                                         {n: -t for n, t in c.tensors.items()})  # fmt: skip
        for i, s in enumerate(states):
            if i == hostile:
                s.merge([], n_peers=4)
                continue
            report = s.merge([x for j, x in enumerate(sent) if j != i], n_peers=4)
            ref = s.directions.before(s.version + 1)
            if ref is not None:
                assert all(bool(torch.isfinite(t).all()) for t in ref.values()), "NaN reference"
            if rnd == 2:
                assert [(r.sender, r.strike) for r in report.refused] == [("p3", False)], (
                    report.applied
                )
                assert "opposed" in report.refused[0].reason


def test_progress_cosine_is_never_made_up_from_nan() -> None:
    """A non-finite reference must not read as a perfectly aligned cosine of 1.0."""
    ref = Progress.of({"w": torch.tensor([float("nan"), 1.0])})
    cos = ref.cosine({"w": torch.tensor([-1.0, -1.0])})
    assert cos is None or not cos > 0.0
