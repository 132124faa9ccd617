"""TCP congestion control of the peer plane's connections (Linux).

The peer plane asks the kernel for ``cubic`` (``Settings.tcp_congestion``; ``system`` keeps the
kernel's default) on its connections: the peer client on every socket it opens (``tune``, from
its network backend in ``atomd.p2p.tls``), the daemon on its listening socket, whose accepted
connections inherit it (the state a donor serves). The control API is not concerned.

Why: cubic is Linux's own default, but some systems run BBR instead, and on a slow uplink BBR
carries the swarm's delta frames markedly worse. Four real daemons at 256 kbit/s a peer
(``bench swarm``: ``tc tbf`` with a 4 kB burst and half a second of queue): with BBR 91-97
rounds a peer and gain_recovered 0.39-0.48, with cubic on the same code 111-125 rounds and
0.57-0.60 (measured in research/). ``ss -ti`` shows why on these links: the bucket's burst
leaves at the veth's speed, so BBR's delivery samples put the line at megabytes a second
(median 5 MB/s for 32 kB/s), it paces at that, the queue overflows, and its connections recover
by retransmission timeouts (3.4 % of the bytes resent; cubic 0.4 %). A real line whose shaper
lets such bursts through would do the same; a plain FIFO at the line's rate would not. Cubic
fills the uplink's queue, as any loss-based sender does, so the host's other traffic waits
behind the frames; that is the common Linux behaviour, and the setting concerns only the peer
plane's connections.

Where the kernel does not offer the choice or does not let this process make it (an
unprivileged process may choose only what ``net.ipv4.tcp_allowed_congestion_control`` lists:
the systemd unit runs without capabilities) the connections keep the system's default, and
the daemon says so in a warning and in its start-up line.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from atomd.logs import get_logger

log = get_logger(__name__)

SYSTEM = "system"  # the setting's value for "leave the kernel's default"
_PROC = Path("/proc/sys/net/ipv4")
NAME_MAX = 15  # TCP_CA_NAME_MAX, 16 with the terminating NUL

SocketOption = tuple[int, int, bytes]


@dataclass(frozen=True)
class Congestion:
    """What the peer plane's connections use: ``options`` for their sockets (none: the
    system's default), and ``note``, one phrase for the daemon's start-up line."""

    options: tuple[SocketOption, ...]
    note: str


SYSTEMS = Congestion((), "TCP congestion control: the system's")


def system_default() -> str | None:
    """The kernel's default congestion control, None where it cannot be read (not Linux)."""
    try:
        return (_PROC / "tcp_congestion_control").read_text().strip() or None
    except OSError:
        return None


def choose(name: str) -> Congestion:
    """The socket options that make this process's peer connections use ``name``, checked on
    a socket of its own, or none (the system's default, with a warning) where the kernel
    refuses it."""
    default = system_default()
    systems = SYSTEMS if default is None else Congestion((), f"TCP {default} (the system's)")
    if name == SYSTEM:
        return systems
    option = getattr(socket, "TCP_CONGESTION", None)
    wanted = name.encode()
    try:
        if option is None:
            raise OSError(errno.ENOPROTOOPT, "no TCP_CONGESTION on this platform")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_TCP, option, wanted)
            got = s.getsockopt(socket.IPPROTO_TCP, option, NAME_MAX + 1).rstrip(b"\0")
    except OSError as e:
        why = {
            errno.EPERM: "not permitted to this process: net.ipv4.tcp_allowed_congestion_control "
            "lists what an unprivileged process may choose",
            errno.ENOENT: "not offered by this kernel: see "
            "net.ipv4.tcp_available_congestion_control (a module to load?)",
        }.get(e.errno or 0, e.strerror or str(e))
        log.warning("peer plane: TCP congestion control %s: %s; the connections keep the "
                    "system's (%s)", name, why, default or "unknown")  # fmt: skip
        return systems
    if got != wanted:  # pragma: no cover - a kernel that ignores the choice
        return Congestion((), f"TCP {got.decode(errors='replace')} ({name} was not taken)")
    return Congestion(((socket.IPPROTO_TCP, option, wanted),), f"TCP {name}")


_warned: set[bytes] = set()  # names ``tune`` has warned about once


def tune(sock: socket.socket | None, options: Iterable[SocketOption]) -> None:
    """Set ``options`` on a connected socket, best effort: one the kernel refuses now (an
    administrator changed what is allowed since ``choose``) leaves the system's default on
    that connection, with a warning the first time, rather than failing the connection."""
    if sock is None:
        return
    for option in options:
        try:
            sock.setsockopt(*option)
        except OSError as e:
            if option[2] not in _warned:
                _warned.add(option[2])
                log.warning("peer plane: could not set TCP congestion control %s on a "
                            "connection (%s); such connections keep the system's",
                            option[2].decode(errors="replace"), e.strerror or e)  # fmt: skip
