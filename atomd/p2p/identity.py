"""This daemon's Ed25519 identity, kept in the data directory, and signature checks.

A peer's id is derived from its public key, so an id cannot be claimed without the key.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from atomd.datadir import KEY_SIDE_FILE
from atomd.errors import ConfigError
from atomd.logs import get_logger

log = get_logger(__name__)

KEY_FILE = "identity.key"
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


def peer_id_from_public_key(public_key_hex: str) -> str:
    """The peer id: the first 16 bytes of sha256(raw 32-byte public key), as 32 lowercase hex."""
    return hashlib.sha256(bytes.fromhex(public_key_hex)).digest()[:16].hex()


def verify_signature(public_key_hex: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the Ed25519 signature of ``data`` by that key. Never raises."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
        key.verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        raw = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key_hex: str = raw.hex()
        self.peer_id: str = peer_id_from_public_key(self.public_key_hex)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity kept only in memory (tests, tools)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: Path) -> Identity:
        """The identity in ``data_dir/identity.key``, made (mode 0600) on first start.

        Raises ``ConfigError`` if the file is readable by group or others, or not an unencrypted
        PKCS8 PEM Ed25519 key; the message says how to fix it."""
        path = data_dir / KEY_FILE
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            identity = cls._create(path)
        except FileExistsError:
            return cls._load(path)
        log.info("created identity %s in %s", identity.peer_id, path)
        return identity

    @classmethod
    def _create(cls, path: Path) -> Identity:
        private_key = Ed25519PrivateKey.generate()
        pem = private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # Written whole to a side file, then linked into place: a kill mid-write leaves no
        # half-written key that would stop every later start (the side file is swept at the
        # next, ``atomd.datadir.sweep``). The mode is given at creation, so the key is never
        # readable by others, even for a moment; link() never overwrites a key (a peer's id
        # is its key) and loses no race with another start (FileExistsError: that one's key
        # is loaded).
        tmp = path.with_name(KEY_SIDE_FILE.format(pid=os.getpid()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                # A file system without hard links (vfat, some network and FUSE mounts): a
                # rename, which would replace a key another start made meanwhile, so only
                # where none is yet (the daemon holds the data directory's lock).
                if path.exists():
                    raise FileExistsError(path) from None
                os.rename(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the name too survives a power cut
        finally:
            os.close(dir_fd)
        return cls(private_key)

    @classmethod
    def _load(cls, path: Path) -> Identity:
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"identity key {path} is not a regular file; move it away")
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise ConfigError(
                    f"identity key {path} is accessible by group or others (mode {mode:04o}, "
                    f"expected 0600): run `chmod 600 {path}`, and if others may have read it, "
                    "delete it to make a new identity (this changes the peer id)"
                )
            pem = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read identity key {path}: {e}") from None
        fix = (
            "restore the original key file, or delete it to make a new identity (this changes "
            "the peer id; with an existing database, start from an empty data directory)"
        )
        try:
            private_key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            # TypeError: the PEM is encrypted; ValueError: not PEM, or a broken key.
            raise ConfigError(
                f"identity key {path} is not an unencrypted PKCS8 PEM private key ({e}): {fix}"
            ) from None
        if not isinstance(private_key, Ed25519PrivateKey):
            raise ConfigError(
                f"identity key {path} holds a {type(private_key).__name__}, expected an Ed25519 "
                f"private key: {fix}"
            )
        return cls(private_key)

    @property
    def private_key(self) -> Ed25519PrivateKey:
        """The private key (for the peer plane's TLS certificate, ``atomd.p2p.tls``)."""
        return self._private_key

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return self._private_key.sign(data)
