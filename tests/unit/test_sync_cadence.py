"""Cadence: the round period each peer proposes, the swarm's period, and H from them."""

from __future__ import annotations

import pytest

from atomd.sync.cadence import (
    CLAIM_CAP,
    LINK_EVERY,
    MARGIN,
    MAX_EVERY,
    MIN_EVERY,
    MIN_FRACTION,
    PROPOSAL_TTL_S,
    RUNG,
    TRAFFIC_SAMPLES,
    WORK_SHARE,
    Cadence,
    fit_fraction,
)


def measured(step: float, traffic: float = 0.0, work: float = 0.0) -> Cadence:
    c = Cadence(None)
    for _ in range(5):
        c.step(step)
    if traffic:
        c.traffic(traffic)
    if work:
        c.round_work(work)
    return c


def test_a_fixed_every_is_kept() -> None:
    c = Cadence(7)
    c.step(1.0)
    c.traffic(100.0)
    assert not c.auto and c.every() == 7
    assert c.view().period_s is None
    with pytest.raises(ValueError):
        Cadence(0)


def test_rounds_every_min_every_steps_until_something_says_otherwise() -> None:
    assert Cadence(None).every() == 1  # nothing measured: the first round after one step
    assert MIN_EVERY == 2
    assert measured(0.2).every() == MIN_EVERY  # a free link and free rounds: the shortest
    assert Cadence(1).every() == 1  # a fixed H of 1 is still one


def test_the_floor_is_on_the_period_so_peers_keep_one_pace() -> None:
    """The swarm's period holds MIN_EVERY steps of the slowest peer; a peer twice as fast puts
    twice the steps into a round of the same length (rounds at one rate in wall time)."""
    fast, slow = measured(0.2), measured(0.4)
    fast.heard("slow", slow.proposal(), now=100.0)
    slow.heard("fast", fast.proposal(), now=100.0)
    assert fast.period(now=100.0) == slow.period(now=100.0) == pytest.approx(2 * 0.4)
    assert (fast.every(now=100.0), slow.every(now=100.0)) == (4, 2)


def test_traffic_fits_margin_times_between_rounds() -> None:
    c = measured(0.25, traffic=3.0)  # 3 s of uploads per round at 0.25 s per step
    assert c.proposal() == pytest.approx(MARGIN * 3.0)
    assert c.every() == round(MARGIN * 3.0 / 0.25)
    c.traffic(0.1)  # rounds faster than the link's median: not yet
    assert c.every() == round(MARGIN * (3.0 + 0.1) / 2 / 0.25)  # the median of two
    c.traffic(0.1)
    assert c.every() == MIN_EVERY  # the link no longer sets the pace
    for _ in range(TRAFFIC_SAMPLES - 1):
        c.traffic(3.0)
    c.traffic(30.0)  # one slow round among the last ones does not set the pace
    assert c.proposal() == pytest.approx(MARGIN * 3.0)
    for _ in range(TRAFFIC_SAMPLES // 2):
        c.traffic(30.0)  # a link that fills is seen within a few rounds
    assert c.proposal() == pytest.approx(MARGIN * 30.0)


def test_round_work_takes_at_most_its_share_of_the_compute() -> None:
    c = measured(0.2, work=0.2)
    assert c.proposal() == pytest.approx(0.2 + 0.2 / WORK_SHARE)  # work, then its compute
    assert c.every() == round(0.2 / WORK_SHARE / 0.2) == 2


def test_a_round_lasts_its_steps_and_its_work_so_h_leaves_room_for_the_work() -> None:
    """The period is wall time between two rounds' closes; a round of H steps lasts
    H * step_s + work_s. With H = T / step_s, 4 real daemons at 256 kbit/s propose 2.9 s and
    close rounds every 4.2 s."""
    c = measured(0.5, traffic=2.4, work=0.5)  # 3 s: traffic-bound
    assert c.proposal() == pytest.approx(MARGIN * 2.4)
    assert c.every() == 5  # 5 steps and the round's work: 3 s; T / step_s would give 6
    h = c.every()
    assert h * 0.5 + 0.5 == pytest.approx(c.period())
    busy = measured(0.5, traffic=0.1, work=2.0)  # the work is longer than any step
    assert busy.every() == round(2.0 / WORK_SHARE / 0.5) == 8
    light = measured(0.5, work=0.1)  # the floor: MIN_EVERY steps and the round's work
    assert light.proposal() == pytest.approx(MIN_EVERY * 0.5 + 0.1)
    assert light.every() == MIN_EVERY


def test_the_step_time_is_a_median_and_evaluations_do_not_count() -> None:
    c = measured(0.5, traffic=5.0)
    c.step(30.0)  # an evaluation or a checkpoint between two steps
    assert c.step_s() == 0.5 and c.every() == round(MARGIN * 5.0 / 0.5)


def test_the_swarm_follows_its_slowest_proposal_until_it_goes_quiet() -> None:
    c = measured(0.25, traffic=0.1)
    c.heard("slow-link", 4.0, now=100.0)
    assert c.period(now=100.0) == 4.0 and c.every(now=100.0) == 16
    c.heard("fast", 0.1, now=100.0)
    assert c.period(now=101.0) == 4.0  # the largest proposal wins
    gone = 100.0 + PROPOSAL_TTL_S + 3 * 4.0 + 0.1
    assert c.period(now=gone) == MIN_EVERY * 0.25  # it left: back to our own proposal
    view = c.view()
    assert view.auto and view.every == c.every()


def test_a_member_cannot_stall_the_rounds_by_declaring_a_huge_period() -> None:
    """The largest proposal sets the pace; one heard proposal counts for at most
    CLAIM_CAP times the lower median of the proposals (ours included)."""
    c = measured(0.25, traffic=0.1)  # proposes 2 steps: 0.5 s
    c.heard("liar", 86_400.0, now=100.0)  # the largest period a frame may carry
    assert c.period(now=100.0) == CLAIM_CAP * 0.5 and c.every(now=100.0) == 32
    c.heard("honest", 0.6, now=100.0)  # the median is an honest proposal's
    assert c.period(now=100.0) == CLAIM_CAP * 0.6
    c.heard("honest-2", 0.7, now=100.0)
    assert c.period(now=100.0) == CLAIM_CAP * 0.6
    alone = measured(0.25, traffic=0.1)
    alone.heard("slow", 3.0, now=100.0)  # an honest slower link under the cap: followed
    assert alone.period(now=100.0) == 3.0


def test_a_slower_peer_puts_fewer_steps_in_a_round_of_the_same_length() -> None:
    fast, slow = measured(0.25, traffic=2.0), measured(0.5, traffic=2.0)
    assert fast.period() == slow.period()
    assert (fast.every(), slow.every()) == (10, 5)  # MARGIN x 2 s: 10 and 5 steps


def test_every_is_bounded() -> None:
    c = measured(0.001, traffic=3600.0)
    assert c.every() == MAX_EVERY


def test_the_frame_budget_fits_a_round_every_link_every_steps_into_the_measured_link() -> None:
    """The bytes a frame may have so that its traffic fits MARGIN times into the
    compute of LINK_EVERY steps, at the slowest rate of the last rounds' frames."""
    assert Cadence(7).frame_budget() is None and Cadence(None).frame_budget() is None
    c = measured(0.25, traffic=3.0)  # a traffic time without the frame's size: no rate
    assert c.frame_budget() is None
    c.traffic(3.0, 30_000)  # 10 kB/s
    assert c.frame_budget() == pytest.approx(LINK_EVERY * 0.25 * 10_000 / MARGIN)
    c.traffic(3.0, 30_000)
    c.traffic(0.3, 30_000)  # one faster round: the median of the last ones counts
    assert c.frame_budget() == pytest.approx(LINK_EVERY * 0.25 * 10_000 / MARGIN)
    c.round_work(0.5)  # a round lasts its steps and its work: the work's time is link time too
    assert c.frame_budget() == pytest.approx((LINK_EVERY * 0.25 + 0.5) * 10_000 / MARGIN)
    c.round_work(4.0)  # rounds cannot come more often than their work allows: more bytes fit
    c.round_work(4.0)  # (the median of the rounds' work)
    assert c.frame_budget() == pytest.approx(4.0 * (1 + 1 / WORK_SHARE) * 10_000 / MARGIN)


def test_fit_fraction_steps_down_three_rungs_a_halving_to_its_floor() -> None:
    def size(f: float) -> float:
        return 6_000 + 2_500_000 * f  # headers, and ~2.5 MB of payload for every entry

    assert pytest.approx(0.5) == RUNG**3
    assert fit_fraction(0.01, 40_000, size) == 0.01  # fits as it is
    assert fit_fraction(0.01, 26_000, size) == pytest.approx(0.01 * RUNG)  # 25.8 kB
    assert fit_fraction(0.01, 20_000, size) == pytest.approx(0.005)  # 18.5 kB; 0.63%: 21.7
    # 15 kB: 0.397% (15.9 kB) does not fit, 0.315% (13.9 kB) does; halvings gave 0.25%
    assert fit_fraction(0.01, 15_000, size) == pytest.approx(0.01 * RUNG**5)
    assert fit_fraction(0.01, 12_300, size) == MIN_FRACTION
    assert fit_fraction(0.01, 100, size) == MIN_FRACTION  # nothing fits: the floor
    assert fit_fraction(MIN_FRACTION / 2, 100, size) == MIN_FRACTION / 2  # a spec below it
