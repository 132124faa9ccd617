"""The launcher's ports (atomd.launch.free_port): free when picked, and never one this process
handed out lately, since a daemon binds its ports only once it runs."""

from __future__ import annotations

from collections import deque

import pytest

from atomd import launch


@pytest.mark.parametrize("span", [None, "25000-25019"])
def test_free_port_never_hands_out_a_port_twice_before_it_is_bound(
    span: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``start_swarm`` picks every daemon's ports before it starts any: nothing is bound between
    the picks, so each must be new (CI, 2026-12-05: two daemons of one swarm got one port)."""
    if span is None:
        monkeypatch.delenv(launch.PORTS_ENV, raising=False)
    else:
        monkeypatch.setenv(launch.PORTS_ENV, span)
    monkeypatch.setattr(launch, "_GIVEN", deque(maxlen=256))
    picks = [launch.free_port() for _ in range(20)]  # a range of 20: every port of it once
    assert len(set(picks)) == 20
    if span is not None:
        assert set(picks) == set(range(25000, 25020))
        with pytest.raises(RuntimeError, match="no free port"):
            launch.free_port()  # each handed out, none bound yet: none is free for a new daemon
