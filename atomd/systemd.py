"""A dependency-free sd_notify(3) client: tell systemd we are ready, alive or stopping.

Every function is a no-op returning ``False`` when the process was not started by systemd
(``$NOTIFY_SOCKET`` unset), so callers never need to check. Sending never raises: a lost
notification must not take the daemon down, so failures are logged at debug level.
"""

from __future__ import annotations

import os
import socket

from atomd.logs import get_logger

log = get_logger(__name__)

# systemd reads the notify socket promptly; the timeout only bounds how long a wedged receiver
# can hold up the caller (usually the event loop) before the datagram is given up.
_SEND_TIMEOUT_S = 1.0


def _address(raw: str) -> str | None:
    """The AF_UNIX address for a ``$NOTIFY_SOCKET`` value, or None if it is not one we support."""
    if raw.startswith("@"):
        # Linux abstract namespace: a leading NUL byte instead of '@', no file on disk.
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    # systemd >= 253 may also hand out "vsock:CID:PORT" (VMs); atomd runs on the host.
    return None


def notify(*states: str) -> bool:
    """Send ``states`` (``"KEY=VALUE"`` each) to systemd as one datagram.

    Returns True if the datagram was sent, False if not under systemd or the send failed.
    """
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw or not states:
        return False
    address = _address(raw)
    if address is None:
        log.debug("NOTIFY_SOCKET=%r is not a path or abstract socket; not notifying", raw)
        return False
    message = "\n".join(states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(_SEND_TIMEOUT_S)
            sock.sendto(message, address)
    except OSError as exc:
        log.debug("sd_notify %r to %r failed: %s", states, raw, exc)
        return False
    return True


def ready() -> bool:
    """Startup is complete: with ``Type=notify`` systemd starts dependent units now."""
    return notify("READY=1")


def stopping() -> bool:
    """Shutdown has begun (checkpointing, leaving the swarm)."""
    return notify("STOPPING=1")


def watchdog() -> bool:
    """Keep-alive ping; send it every `watchdog_interval` seconds from the event loop."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """A one-line status shown by ``systemctl status``."""
    # The protocol is newline-separated, so a newline in the text would start a bogus state.
    return notify("STATUS=" + " ".join(text.splitlines()))


def extend_timeout(seconds: float) -> bool:
    """Ask for ``seconds`` more before the start/stop timeout fires (a long checkpoint)."""
    return notify(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1_000_000))}")


def watchdog_interval() -> float | None:
    """Seconds between `watchdog` pings (half of ``WatchdogSec=``), or None if not enabled.

    None also when ``$WATCHDOG_PID`` names another process: the watchdog is meant for it.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None
        timeout_us = int(usec)
    except ValueError:
        log.debug("ignoring malformed WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
        return None
    if timeout_us <= 0:
        return None
    # Pinging at half the timeout (what sd_watchdog_enabled(3) recommends) tolerates one late
    # ping without a restart.
    return timeout_us / 2 / 1_000_000
