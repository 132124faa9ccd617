"""sd_notify client: real AF_UNIX datagram sockets, exact bytes received."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from atomd import systemd


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)
    return sock


@pytest.fixture
def path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A notify socket on the filesystem, announced through $NOTIFY_SOCKET."""
    path = tmp_path / "notify.sock"
    sock = _receiver(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


@pytest.fixture
def abstract_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A notify socket in Linux's abstract namespace ("@name" in $NOTIFY_SOCKET)."""
    name = f"atomd-test-{os.getpid()}-{uuid.uuid4().hex}"
    sock = _receiver("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield sock
    sock.close()


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (systemd.ready, b"READY=1"),
        (systemd.stopping, b"STOPPING=1"),
        (systemd.watchdog, b"WATCHDOG=1"),
        (lambda: systemd.status("round 3: merged 2 deltas"), b"STATUS=round 3: merged 2 deltas"),
        (lambda: systemd.extend_timeout(90), b"EXTEND_TIMEOUT_USEC=90000000"),
    ],
)
def test_helpers_send_exact_datagram(
    path_socket: socket.socket, send: Callable[[], bool], expected: bytes
) -> None:
    assert send() is True
    assert path_socket.recv(4096) == expected


def test_abstract_socket(abstract_socket: socket.socket) -> None:
    assert systemd.ready() is True
    assert systemd.watchdog() is True
    assert abstract_socket.recv(4096) == b"READY=1"
    assert abstract_socket.recv(4096) == b"WATCHDOG=1"


def test_several_states_go_in_one_datagram(path_socket: socket.socket) -> None:
    assert systemd.notify("READY=1", "STATUS=listening on 127.0.0.1:7070") is True
    assert path_socket.recv(4096) == b"READY=1\nSTATUS=listening on 127.0.0.1:7070"


def test_status_newlines_cannot_inject_states(path_socket: socket.socket) -> None:
    assert systemd.status("loss 2.1\nREADY=1") is True
    assert path_socket.recv(4096) == b"STATUS=loss 2.1 READY=1"


def test_unset_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.ready() is False
    assert systemd.notify("READY=1") is False


def test_no_states_sends_nothing(path_socket: socket.socket) -> None:
    assert systemd.notify() is False
    path_socket.setblocking(False)
    with pytest.raises(BlockingIOError):
        path_socket.recv(4096)


@pytest.mark.parametrize("value", ["relative/notify.sock", "vsock:2:1234"])
def test_unsupported_address_is_ignored(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.ready() is False


def test_send_error_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    with caplog.at_level("DEBUG", logger="atomd.systemd"):
        assert systemd.watchdog() is False
    assert "sd_notify" in caplog.text


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 15.0),  # WatchdogSec=30
        ("30000000", "self", 15.0),
        ("500000", None, 0.25),
        ("30000000", "other", None),  # the watchdog belongs to another process
        (None, None, None),
        ("", None, None),
        ("0", None, None),
        ("soon", None, None),
        ("30000000", "not-a-pid", None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    if usec is None:
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is None:
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
    else:
        own = os.getpid()
        value = {"self": str(own), "other": str(own + 1)}.get(pid, pid)
        monkeypatch.setenv("WATCHDOG_PID", value)
    assert systemd.watchdog_interval() == expected
