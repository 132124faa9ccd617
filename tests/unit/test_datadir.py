"""The data directory's lock and the sweep of what a killed holder left (atomd/datadir.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from atomd.datadir import (
    DataDirInUseError,
    Holder,
    lock_data_dir,
    sweep,
    take_data_dir,
)
from atomd.errors import ConfigError
from atomd.p2p import tls
from atomd.p2p.identity import Identity


def test_one_process_a_data_directory(tmp_path: Path) -> None:
    """Two daemons on one data directory would be one peer id at two addresses over one
    database: the second is refused, naming the first and what it is; the lock goes with
    its holder."""
    held = lock_data_dir(tmp_path)
    assert (tmp_path / "atomd.pid").read_text() == f"{os.getpid()} run\n"
    with pytest.raises(ConfigError, match=rf"in use by another atomd \(pid {os.getpid()}\)"):
        lock_data_dir(tmp_path, "migrate")
    os.close(held)
    held = lock_data_dir(tmp_path, "migrate")
    with pytest.raises(DataDirInUseError, match=rf"in use by atomd migrate \(pid {os.getpid()}\)"):
        lock_data_dir(tmp_path)
    os.close(held)
    os.close(lock_data_dir(tmp_path))


@pytest.mark.parametrize(
    ("text", "pid", "role"),
    [
        ("123 run\n", "123", "run"),
        ("123 migrate\n", "123", "migrate"),
        ("123\n", "123", "run"),  # a daemon of before wrote its pid alone
        ("", "?", "run"),
        ("x" * 64 + " migrate", "x" * 16, "migrate"),  # bounded in what it repeats
        ("9 frobnicate", "9", "run"),
    ],
)
def test_the_holder_as_its_file_says(text: str, pid: str, role: str) -> None:
    assert Holder.parse(text) == Holder(pid, role)  # type: ignore[arg-type]


def test_what_a_kill_left_is_swept(tmp_path: Path) -> None:
    """A kill while the identity key was written leaves its side file; a kill while a TLS
    context was made leaves a folder with a copy of the key. The holder sweeps both, and
    nothing else."""
    (tmp_path / ".identity.key.999.tmp").write_bytes(b"-----BEGIN PRIVATE KEY-----\nMC4C")
    left = tmp_path / ".tls-abc123"
    left.mkdir(mode=0o700)
    (left / "key.pem").write_bytes(b"a key")
    (tmp_path / "atomd.db").write_bytes(b"kept")
    (tmp_path / "jobs").mkdir()
    assert sorted(sweep(tmp_path)) == [".identity.key.999.tmp", ".tls-abc123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomd.db", "jobs"]
    assert sweep(tmp_path) == []


def test_the_sweep_matches_what_the_writers_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's patterns are the names identity.py and tls.py write: a side file or a
    scratch folder left mid-write (made to stay here by a failing rename or cleanup) is swept."""
    import tempfile

    made: list[Path] = []
    real = tempfile.TemporaryDirectory

    class Kept(real):  # type: ignore[misc, valid-type]
        def cleanup(self) -> None:  # a kill before the folder is removed
            self._finalizer.detach()
            made.append(Path(self.name))

        def __exit__(self, *exc: object) -> None:
            self.cleanup()

    monkeypatch.setattr(tempfile, "TemporaryDirectory", Kept)
    tls.server_context(Identity.generate(), tmp_path)
    monkeypatch.undo()
    assert made and made[0].exists()

    def no_unlink(self: Path, missing_ok: bool = False) -> None:  # a kill before the unlink
        pass

    monkeypatch.setattr(Path, "unlink", no_unlink)
    Identity.load_or_create(tmp_path)
    monkeypatch.undo()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "identity.key")
    assert len(left) == 2, left
    assert sorted(sweep(tmp_path)) == left
    assert [p.name for p in tmp_path.iterdir()] == ["identity.key"]


async def test_a_daemon_waits_for_a_migration(tmp_path: Path) -> None:
    """A daemon started while ``atomd migrate`` holds the folder (systemd, a launcher) waits
    for it and then takes it; a daemon found there is refused at once, and a shutdown ends
    the wait."""
    migrating = lock_data_dir(tmp_path, "migrate")
    (tmp_path / ".tls-left").mkdir()
    take = asyncio.ensure_future(take_data_dir(tmp_path))
    await asyncio.sleep(0.5)
    assert not take.done()
    assert (tmp_path / ".tls-left").exists()  # not swept under the migration
    os.close(migrating)
    fd = await asyncio.wait_for(take, 10)
    assert (tmp_path / "atomd.pid").read_text() == f"{os.getpid()} run\n"
    assert not (tmp_path / ".tls-left").exists()
    with pytest.raises(DataDirInUseError, match="another atomd"):
        await take_data_dir(tmp_path)  # no wait for a daemon
    os.close(fd)
    migrating = lock_data_dir(tmp_path, "migrate")
    try:
        with pytest.raises(DataDirInUseError, match="atomd migrate"):
            await take_data_dir(tmp_path, give_up=lambda: True)
    finally:
        os.close(migrating)
