"""A real daemon talks to systemd's notify socket: READY=1, WATCHDOG=1, STOPPING=1."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any


def test_daemon_notifies_ready_watchdog_and_stopping(daemons: Any, tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.5)
    try:
        d = daemons(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
        d.start()
        got: list[str] = []

        def receive_until(state: str, timeout: float = 30) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    got.extend(sock.recv(4096).decode().splitlines())
                except TimeoutError:
                    continue
                if state in got:
                    return
            raise AssertionError(f"no {state} in {got}")

        receive_until("READY=1")
        got.clear()
        receive_until("WATCHDOG=1")  # pinged at half the 0.4 s watchdog timeout
        receive_until("WATCHDOG=1")
        d.signal(signal.SIGTERM)
        receive_until("STOPPING=1")
        assert d.wait(timeout=30) == 0
        sock.settimeout(0.2)
        for _ in range(100):  # drain what was sent after STOPPING=1
            try:
                got.extend(sock.recv(4096).decode().splitlines())
            except TimeoutError:
                break
        assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in got)
    finally:
        sock.close()
