"""The job's final average (atomd.sync.average): the share of entries that fits the link, the
candidate model, and what is left out of it. Three in-process peers end on the average in
tests/unit/test_sync_runner.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from atomd.sync.average import (
    FILL,
    LADDER,
    MAX_RATIO,
    UPLOAD_MAX_S,
    UPLOAD_S,
    WALL_SHARE,
    Averages,
    Share,
    Sized,
    combine,
    encode_share,
    norm,
    upload_budget_s,
)
from atomd.sync.codecs import Codec, TopKCodec, decode, kept, make_codec

FP32 = make_codec("fp32")


def share(sender: str, base_version: int, tensors: dict[str, Tensor]) -> Share:
    """A share as the exchange keeps it: encoded (fp32 here, so exactly)."""
    return Share(sender, base_version, {n: FP32.encode(t) for n, t in tensors.items()})


def test_the_share_of_entries_is_the_largest_that_fits_never_below_the_jobs() -> None:
    x = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}

    def codec_at(f: float) -> Codec:
        return make_codec("topk", topk_fraction=f)

    def payload(sized: Sized) -> int:
        return sum(len(e.payload) for e in sized.tensors.values())

    dense = make_codec("int8")
    assert LADDER[0] == 1.0
    # Nothing measured: the job's own share; a free link: every entry.
    assert encode_share(x, codec_at, dense, floor=0.01, budget_bytes=None).codec.fraction == 0.01
    whole = encode_share(x, codec_at, dense, floor=0.01, budget_bytes=1e9)
    assert whole.codec.fraction == 1.0
    torch.testing.assert_close(whole.decoded()["w"], x["w"], atol=0.3, rtol=0)  # 4-bit values
    # A budget between two rungs: the larger share that fits, its framing counted.
    full = payload(whole)  # (every entry: the gaps are all 0, cheaper than half of them)
    fits = encode_share(x, codec_at, dense, floor=0.01, budget_bytes=full + 700, overhead=700)
    assert fits.codec.fraction == 1.0
    short = encode_share(x, codec_at, dense, floor=0.01, budget_bytes=full + 699, overhead=700)
    assert 0.01 < short.codec.fraction < 1.0 and payload(short) + 700 <= full + 699
    assert encode_share(x, codec_at, dense, floor=0.01, budget_bytes=10).codec.fraction == 0.01
    # A dense codec sends every entry whatever the budget.
    assert encode_share(x, None, dense, floor=1.0, budget_bytes=10).codec is dense
    assert upload_budget_s(60.0) == UPLOAD_S and upload_budget_s(3600.0) == WALL_SHARE * 3600
    assert upload_budget_s(8 * 3600.0) == UPLOAD_MAX_S  # a long job's end stays bounded


def test_a_budget_between_halvings_gets_the_largest_rung_that_fits() -> None:
    """Halvings wasted up to half the link's budget (run bs at 256 kbit/s: a quarter of the
    entries where 0.397 fitted). Below half the entries the frame grows with its share, so the
    binary search finds what trying every rung would."""
    x = {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(1))}

    def codec_at(f: float) -> Codec:
        return make_codec("topk", topk_fraction=f)

    def size(f: float) -> int:
        c = codec_at(f)
        return sum(len(c.encode(t).payload) for t in x.values())

    dense = make_codec("int8")
    assert LADDER[0] == 1.0 and LADDER[1] == 0.5 and 0.39 < LADDER[2] < 0.4
    sizes = {f: size(f) for f in LADDER[1:] if f > 0.01}
    assert all(sizes[a] >= sizes[b] for a, b in zip(sizes, list(sizes)[1:], strict=False))
    for f in (LADDER[2], LADDER[5], LADDER[9]):
        for budget in (sizes[f], sizes[f] + 1):
            got = encode_share(x, codec_at, dense, floor=0.01, budget_bytes=budget)
            assert got.codec.fraction == f, (f, budget)
    # One byte short of a rung: the next one down.
    got = encode_share(x, codec_at, dense, floor=0.01, budget_bytes=sizes[LADDER[2]] - 1)
    assert got.codec.fraction == LADDER[3]


def test_the_candidate_is_the_anchor_plus_the_mean_of_the_shares() -> None:
    start = {"w": torch.zeros(3), "b": torch.ones(2)}
    own = {"w": torch.tensor([3.0, 0.0, 0.0]), "b": torch.zeros(2)}
    shares = [
        share("p1", 5, {"w": torch.tensor([0.0, 3.0, 0.0]), "b": torch.zeros(2)}),
        share("p2", 5, {"w": torch.tensor([0.0, 0.0, 3.0]), "b": torch.full((2,), 3.0)}),
    ]
    got = combine(start, own, shares)
    torch.testing.assert_close(got.model["w"], torch.ones(3))
    torch.testing.assert_close(got.model["b"], torch.full((2,), 2.0))
    assert got.used == ["p1", "p2"] and got.left_out == []
    assert start["w"].sum() == 0  # the start point is not touched


def test_a_share_far_larger_than_the_others_is_left_out() -> None:
    """One member cannot swamp the mean: a share over MAX_RATIO x the lower median of the
    shares' norms (this peer's own included) stays out; the candidate is the others' mean."""
    start = {"w": torch.zeros(4)}
    own = {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])}
    honest = share("p1", 0, {"w": torch.tensor([0.0, 1.0, 0.0, 0.0])})
    huge = share("evil", 0, {"w": torch.full((4,), 1e6)})
    got = combine(start, own, [honest, huge])
    assert got.used == ["p1"] and [s for s, _ in got.left_out] == ["evil"]
    assert "lower median" in got.left_out[0][1]
    torch.testing.assert_close(got.model["w"], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    within = share("p2", 0, {"w": torch.tensor([0.0, 0.0, MAX_RATIO * 0.99, 0.0])})
    assert combine(start, own, [honest, within]).used == ["p1", "p2"]
    assert norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}) == pytest.approx(5.0)


def test_entries_a_cut_share_left_out_count_as_this_peers_own_bounded() -> None:
    """At a slow link the shares are cut and the settled anchor is far behind every model (run
    bs: 2.03 against 1.76-1.79): an entry a share left out counted as 0, the anchor's value,
    and dragged the mean back (1.8242, one share at 1/8 of the entries: 1.8896). Counted as
    this peer's own value of it, within half its chunk's bound, the candidate is nearer the
    exact mean of the models."""
    gen = torch.Generator().manual_seed(5)
    common = torch.randn(4, 4096, generator=gen)  # what every peer learned beyond the anchor
    models = [common + 0.5 * torch.randn(4, 4096, generator=gen) for _ in range(4)]
    start = {"w": torch.zeros(4, 4096)}
    exact = torch.stack(models).mean(0)

    def error(fill: bool, fractions: list[float]) -> float:
        enc = [
            {"w": make_codec("topk", topk_fraction=f).encode(m)}
            for f, m in zip(fractions, models, strict=True)
        ]
        shares = [Share(f"p{j}", 0, enc[j]) for j in range(1, 4)]
        own = {"w": decode(enc[0]["w"])}
        got = combine(start, own, shares, fill_from={"w": models[0]} if fill else None)
        assert got.used == ["p1", "p2", "p3"]
        return float((got.model["w"] - exact).norm() / exact.norm())

    for fractions in ([0.25] * 4, [0.25, 0.25, 0.25, 0.125], [0.125] * 4):
        assert error(True, fractions) < 0.8 * error(False, fractions), fractions
    assert error(True, [1.0] * 4) == pytest.approx(error(False, [1.0] * 4))  # nothing left out


def test_a_share_cannot_steer_what_it_left_out() -> None:
    """Whatever bound a share declares for what it left out (its levels and scales are its
    sender's to choose), the entries it left out stand for this peer's own values within it:
    a bound far above them changes nothing but that they count whole."""
    start = {"w": torch.zeros(2, 4096)}
    own_whole = {"w": torch.randn(2, 4096, generator=torch.Generator().manual_seed(6))}
    own = {"w": decode(make_codec("topk", topk_fraction=0.25).encode(own_whole["w"]))}
    spike = torch.zeros(2, 4096)
    spike[:, 0] = 50.0  # one entry a chunk kept: a bound of ~50 on every other entry
    enc = {"w": make_codec("topk", topk_fraction=1 / 4096).encode(spike)}
    got = combine(start, own, [Share("p1", 0, enc)], fill_from=own_whole)
    assert got.used == ["p1"]
    expected = (own["w"] + own_whole["w"]) / 2  # this peer's sent share and its own values
    torch.testing.assert_close(got.model["w"][:, 1:], expected[:, 1:])
    torch.testing.assert_close(got.model["w"][:, 0], (own["w"][:, 0] + decode(enc["w"])[:, 0]) / 2)
    # A small bound bites: each left-out entry is this peer's own clamped to FILL x the bound.
    spike[:, 0] = 1.0  # kept at level 7: a bound of 7.5 / 7 of it on the rest of the chunk
    small = {"w": make_codec("topk", topk_fraction=1 / 4096).encode(spike)}
    got = combine(start, own, [Share("p1", 0, small)], fill_from=own_whole)
    b = FILL * kept(small["w"]).bound[:, 1:]
    assert float(b.min()) > 0.5 and float(b.max()) < 0.6 < float(own_whole["w"].abs().max())
    clamped = torch.clamp(own_whole["w"][:, 1:], min=-b, max=b)
    torch.testing.assert_close(got.model["w"][:, 1:], (own["w"][:, 1:] + clamped) / 2)
    # A negative scale (a sender's choice that decodes finite) bounds the same as its magnitude.
    plain = TopKCodec(fraction=1 / 4096, zstd=False).encode(spike)
    raw = bytearray(plain.payload)  # gaps, 4-bit levels, then the two chunks' bf16 scales
    raw[-3] ^= 0x80  # each scale's sign bit: the high byte of a little-endian bf16
    raw[-1] ^= 0x80
    flipped = {"w": dataclasses.replace(plain, payload=bytes(raw))}
    assert float(decode(flipped["w"])[0, 0]) < 0  # the kept entry flipped with its scale
    got = combine(start, own, [Share("p1", 0, flipped)], fill_from=own_whole)
    b = FILL * kept(flipped["w"]).bound[:, 1:]
    assert float(b.min()) > 0
    clamped = torch.clamp(own_whole["w"][:, 1:], min=-b, max=b)
    torch.testing.assert_close(got.model["w"][:, 1:], (own["w"][:, 1:] + clamped) / 2)


def test_the_received_shares_are_bounded_and_the_newest_of_a_sender_counts() -> None:
    kept = Averages(max_senders=2)
    t = {"w": torch.zeros(1)}
    assert kept.put(share("a", 3, t)) and kept.put(share("b", 4, t))
    assert not kept.put(share("c", 3, t))  # full: a new sender is refused
    assert kept.put(share("a", 4, t))  # a known sender's newer share replaces its older
    assert kept.senders() == {"a", "b"}
    assert [s.sender for s in kept.on(4)] == ["a", "b"] and kept.on(3) == []
