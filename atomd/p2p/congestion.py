"""TCP congestion control for the connections this daemon opens to its peers (Linux).

A delta frame's upload is ACK-clocked: its ACKs come back through the receiver's uplink, which
on a slow home line is full of the receiver's own frames at the same moment (up to half a
second of queue, as ``bench swarm`` emulates such a line with ``tc tbf``). BBR, which some
systems run by default, sizes its window from the path's smallest round trip, a few packets on
such a line, so the delayed ACKs leave it waiting and the upload runs below the line's rate; a
loss-based algorithm (cubic, Linux's own default) keeps the window the queue allows and fills
the line. Four real daemons at 256 kbit/s a peer, on a kernel defaulting to BBR (``bench
swarm``, the same code otherwise): 91 rounds a peer and gain_recovered 0.476 with BBR, 111-118
rounds and 0.597 / 0.591 with cubic (``docs/notes/issue-14.md``, 2026-12-05, fourth).

So the peer plane asks for ``cubic`` (``Settings.tcp_congestion``) on its connections: the
peer client on every socket it opens, the daemon on its listening socket (the connections it
accepts inherit it: the state a donor serves). Where the kernel does not offer it or does not
let this process choose it (an unprivileged process may choose only what
``net.ipv4.tcp_allowed_congestion_control`` lists) they keep the system's default, and the
daemon says so in its start-up line. The control API is not concerned.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT = "cubic"
SYSTEM = "system"  # the setting's value for "leave the kernel's default"
_PROC = Path("/proc/sys/net/ipv4")
NAME_MAX = 15  # TCP_CA_NAME_MAX, 16 with the terminating NUL

SocketOption = tuple[int, int, bytes]


@dataclass(frozen=True)
class Congestion:
    """What the peer client's connections use: ``options`` for the sockets (none: the
    system's default), and ``note``, one phrase for the daemon's start-up line."""

    options: tuple[SocketOption, ...]
    note: str


def system_default() -> str | None:
    """The kernel's default congestion control, None where it cannot be read (not Linux)."""
    try:
        return (_PROC / "tcp_congestion_control").read_text().strip() or None
    except OSError:
        return None


def choose(name: str) -> Congestion:
    """The socket options that make this process's peer connections use ``name``, checked on
    a socket of its own: a choice the kernel refuses would otherwise fail every connection."""
    default = system_default() or "the system's default"
    if name == SYSTEM:
        return Congestion((), f"TCP {default} (the system's)")
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return Congestion((), f"TCP: the system's ({name} cannot be chosen on this platform)")
    wanted = name.encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, option, wanted)
        except OSError as e:
            why = "not permitted" if e.errno == errno.EPERM else "not offered by this kernel"
            return Congestion(
                (),
                f"TCP {default} (the system's: {name} is {why}; see "
                "net.ipv4.tcp_available_congestion_control and _allowed_congestion_control)",
            )
        got = s.getsockopt(socket.IPPROTO_TCP, option, NAME_MAX + 1).rstrip(b"\0")
    if got != wanted:  # pragma: no cover - a kernel that ignores the choice
        return Congestion((), f"TCP {got.decode(errors='replace')} ({name} was not taken)")
    return Congestion(((socket.IPPROTO_TCP, option, wanted),), f"TCP {name}")
