"""LAN discovery's pure parts: TXT encoding, instance names, same-swarm filtering, dedupe.

No network here: mDNS itself is tested in network namespaces (integration/test_zeroconf_netns).
"""

from __future__ import annotations

import pytest

from atomd.p2p.discovery import (
    PROTOCOL_VERSION,
    SERVICE_TYPE,
    Advert,
    FoundPeers,
    decode_txt,
    encode_txt,
    instance_name,
)

PEER_A = "a1" * 16
PEER_B = "b2" * 16


def _wire(props: dict[str, str]) -> dict[bytes, bytes | None]:
    """TXT properties as python-zeroconf hands them back after resolution."""
    return {k.encode(): v.encode() for k, v in props.items()}


def test_txt_round_trip() -> None:
    advert = Advert(swarm="s1", peer_id=PEER_A, url="http://10.0.0.5:7071")
    props = encode_txt(advert)
    assert props == {
        "swarm": "s1",
        "peer": PEER_A,
        "url": "http://10.0.0.5:7071",
        "proto": str(PROTOCOL_VERSION),
    }
    assert decode_txt(_wire(props)) == advert


def test_txt_round_trip_unicode_swarm() -> None:
    advert = Advert(swarm="équipe-ß", peer_id=PEER_A, url="https://node.example:443")
    assert decode_txt(_wire(encode_txt(advert))) == advert


@pytest.mark.parametrize(
    ("advert", "match"),
    [
        (Advert(swarm="", peer_id=PEER_A, url="http://h:1"), "swarm"),
        (Advert(swarm="s1", peer_id="", url="http://h:1"), "peer id"),
        (Advert(swarm="s1", peer_id=PEER_A, url="ftp://h:1"), "http"),
        (Advert(swarm="s1", peer_id=PEER_A, url="http://" + "h" * 260), "at most 255"),
    ],
)
def test_encode_refuses_what_cannot_be_announced(advert: Advert, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_txt(advert)


def test_decode_refuses_missing_empty_or_bad_fields() -> None:
    good = _wire(encode_txt(Advert(swarm="s1", peer_id=PEER_A, url="http://h:1")))
    for key in (b"swarm", b"peer", b"url", b"proto"):
        missing = {k: v for k, v in good.items() if k != key}
        with pytest.raises(ValueError, match=f"lacks '{key.decode()}'"):
            decode_txt(missing)
        with pytest.raises(ValueError, match="lacks"):
            decode_txt({**good, key: None})  # a key without "=value"
    with pytest.raises(ValueError, match="not an integer"):
        decode_txt({**good, b"proto": b"one"})
    with pytest.raises(ValueError, match="not UTF-8"):
        decode_txt({**good, b"swarm": b"\xff\xfe"})
    with pytest.raises(ValueError, match="not an http"):
        decode_txt({**good, b"url": b"gopher://h:70"})


def test_decode_ignores_unknown_keys() -> None:
    props = _wire(encode_txt(Advert(swarm="s1", peer_id=PEER_A, url="http://h:1")))
    props[b"future"] = b"field"
    assert decode_txt(props).peer_id == PEER_A


def test_instance_name_contains_peer_id_and_fits_a_dns_label() -> None:
    assert instance_name(PEER_A) == f"atomd-{PEER_A}"
    long_id = "f" * 200
    name = instance_name(long_id)
    assert len(name.encode()) <= 63
    assert name.startswith("atomd-fff")
    assert instance_name("a.b c/d") == "atomd-a-b-c-d"  # no dots: one label
    assert SERVICE_TYPE == "_atomd._tcp.local."


def _advert(peer: str, *, swarm: str = "s1", url: str = "http://10.0.0.2:7071") -> Advert:
    return Advert(swarm=swarm, peer_id=peer, url=url)


def test_found_peers_keeps_only_the_same_swarm_and_never_itself() -> None:
    peers = FoundPeers(swarm="s1", peer_id=PEER_A)
    reason = peers.admit("x", _advert(PEER_B, swarm="s2"))
    assert reason is not None
    assert "'s2'" in reason
    assert peers.admit("self", _advert(PEER_A)) == "this peer itself"
    future = Advert(swarm="s1", peer_id=PEER_B, url="http://h:1", version=PROTOCOL_VERSION + 1)
    reason = peers.admit("y", future)
    assert reason is not None
    assert "protocol version" in reason
    assert peers.admit("b", _advert(PEER_B)) is None


def test_found_peers_reports_each_peer_once() -> None:
    peers = FoundPeers(swarm="s1", peer_id=PEER_A)
    assert peers.admit("b", _advert(PEER_B)) is None
    assert peers.admit("b", _advert(PEER_B)) == "already reported"
    # The same peer seen under another service name (e.g. a second interface) is no news.
    assert peers.admit("b-2", _advert(PEER_B)) == "already reported"


def test_found_peers_reports_a_new_url_and_a_return_after_removal() -> None:
    peers = FoundPeers(swarm="s1", peer_id=PEER_A)
    assert peers.admit("b", _advert(PEER_B)) is None
    assert peers.admit("b", _advert(PEER_B, url="http://10.0.0.2:7072")) is None
    peers.forget("b")
    assert peers.admit("b", _advert(PEER_B, url="http://10.0.0.2:7072")) is None
    peers.forget("unknown")  # forgetting a name never seen is harmless


async def test_a_refused_socket_family_is_reported_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under systemd without AF_NETLINK, getifaddrs fails with EAFNOSUPPORT: the error says
    so (and the daemon goes on without LAN discovery) instead of an OSError escaping."""
    import errno
    import os

    from atomd.errors import AtomdError
    from atomd.p2p import discovery

    def refused() -> None:
        raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))

    monkeypatch.setattr(discovery.ifaddr, "get_adapters", refused)
    with pytest.raises(AtomdError, match="RestrictAddressFamilies= must allow AF_NETLINK"):
        await discovery.LanDiscovery.create(
            swarm="s", peer_id="ab" * 16, url="http://some-host:7071", on_found=lambda *a: None
        )
