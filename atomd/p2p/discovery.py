"""Optional LAN discovery: find peers of the same swarm on the local network through mDNS.

Each daemon registers itself as a DNS-SD service of type ``_atomd._tcp.local.`` whose TXT
record carries its swarm, peer id, peer-plane URL and protocol version, and browses the same
type. Adverts of the same swarm from other peers are handed to ``on_found(peer_id, url)``
once each; the daemon treats them as extra join candidates, exactly like seed URLs, so
admission (swarm secret, signatures) is still decided by the peer plane, not here.

Built on python-zeroconf's asyncio API: sockets are served by the daemon's own event loop and
nothing here blocks it. Off by default (``--zeroconf`` / ``ATOMD_ZEROCONF``).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

import ifaddr
from zeroconf import (
    BadTypeInNameException,
    InterfaceChoice,
    NonUniqueNameException,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from atomd.errors import AtomdError
from atomd.logs import get_logger

log = get_logger(__name__)

SERVICE_TYPE = "_atomd._tcp.local."
# Version of what the TXT record means (and of the peer plane it points at). Adverts of
# another version are ignored: their URL may speak a protocol this daemon does not.
PROTOCOL_VERSION = 1

# TXT keys. Short, as every advert travels in every mDNS answer.
TXT_SWARM = "swarm"
TXT_PEER = "peer"
TXT_URL = "url"
TXT_VERSION = "proto"

# Seconds. Registration probes the name (3 x 250 ms) and announces it (3 x 225 ms); resolving
# one service on a LAN answers in milliseconds; unregistering sends goodbyes (3 x 125 ms).
REGISTER_TIMEOUT_S = 10.0
RESOLVE_TIMEOUT_S = 3.0
CLOSE_TIMEOUT_S = 5.0
# Resolutions in flight at once; beyond this new names wait for their next announcement.
MAX_PENDING_RESOLVES = 64

_INSTANCE_PREFIX = "atomd-"
_LABEL_MAX = 63  # bytes in one DNS label (RFC 1035), the instance name included
_TXT_ENTRY_MAX = 255  # bytes in one ``key=value`` TXT string (RFC 6763 section 6.1)
_UNSAFE_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_-]")

# What ``interfaces`` accepts: python-zeroconf's InterfacesType (IP addresses, IPv6 interface
# indexes, or an InterfaceChoice), spelled out because zeroconf does not export the alias.
Interfaces = Sequence[str | int | tuple[tuple[str, int, int], int]] | InterfaceChoice
OnFound = Callable[[str, str], None]


@dataclass(frozen=True, kw_only=True)
class Advert:
    """What one daemon announces about itself on the LAN."""

    swarm: str
    peer_id: str
    url: str
    version: int = PROTOCOL_VERSION


def encode_txt(advert: Advert) -> dict[str, str]:
    """The TXT properties of ``advert``; ValueError if a field cannot be announced."""
    if not advert.swarm:
        raise ValueError("the swarm name must not be empty")
    if not advert.peer_id:
        raise ValueError("the peer id must not be empty")
    if not advert.url.startswith(("http://", "https://")):
        raise ValueError(f"{advert.url!r} must be an http:// or https:// URL")
    props = {
        TXT_SWARM: advert.swarm,
        TXT_PEER: advert.peer_id,
        TXT_URL: advert.url,
        TXT_VERSION: str(advert.version),
    }
    for key, value in props.items():
        size = len(key.encode()) + 1 + len(value.encode())
        if size > _TXT_ENTRY_MAX:
            raise ValueError(
                f"TXT entry {key!r} is {size} bytes; at most {_TXT_ENTRY_MAX} fit in one entry"
            )
    return props


def decode_txt(properties: Mapping[bytes, bytes | None]) -> Advert:
    """The advert in a resolved service's TXT properties; ValueError says what is wrong."""
    fields: dict[str, str] = {}
    for key in (TXT_SWARM, TXT_PEER, TXT_URL, TXT_VERSION):
        raw = properties.get(key.encode())
        if not raw:
            raise ValueError(f"TXT record lacks {key!r}")
        try:
            fields[key] = raw.decode()
        except UnicodeDecodeError:
            raise ValueError(f"TXT value of {key!r} is not UTF-8") from None
    try:
        version = int(fields[TXT_VERSION])
    except ValueError:
        raise ValueError(
            f"TXT {TXT_VERSION!r} is {fields[TXT_VERSION]!r}, not an integer"
        ) from None
    url = fields[TXT_URL]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"TXT url {url!r} is not an http:// or https:// URL")
    return Advert(swarm=fields[TXT_SWARM], peer_id=fields[TXT_PEER], url=url, version=version)


def instance_name(peer_id: str) -> str:
    """This peer's DNS-SD instance label: ``atomd-<peer id>``, made DNS-safe, ≤ 63 bytes.

    The full peer id travels in the TXT record; the label only has to be unique on the LAN,
    which a (possibly truncated) id derived from a public key is.
    """
    safe = _UNSAFE_LABEL_CHARS.sub("-", peer_id)
    return (_INSTANCE_PREFIX + safe)[:_LABEL_MAX]


class FoundPeers:
    """Which resolved adverts to report: same swarm, same protocol, not ourselves, once each.

    A service that is withdrawn (goodbye or expiry) is forgotten, so a peer that leaves and
    comes back is reported again, as is a peer that announces a new URL.
    """

    def __init__(self, *, swarm: str, peer_id: str) -> None:
        self.swarm = swarm
        self.peer_id = peer_id
        self._by_name: dict[str, tuple[str, str]] = {}  # service name -> (peer id, url)

    def admit(self, name: str, advert: Advert) -> str | None:
        """None if ``advert`` (seen as service ``name``) should be reported, else why not."""
        if advert.swarm != self.swarm:
            return f"swarm {advert.swarm!r}, not {self.swarm!r}"
        if advert.peer_id == self.peer_id:
            return "this peer itself"
        if advert.version != PROTOCOL_VERSION:
            return f"protocol version {advert.version}, expected {PROTOCOL_VERSION}"
        key = (advert.peer_id, advert.url)
        if key in self._by_name.values():
            return "already reported"
        self._by_name[name] = key
        return None

    def forget(self, name: str) -> None:
        """The service ``name`` went away; report its peer again if it returns."""
        self._by_name.pop(name, None)


def _refused(e: OSError) -> str:
    """An OSError of interface listing or mDNS sockets, explained: a sandbox (systemd's
    RestrictAddressFamilies=, seccomp) that refuses a socket family shows up as EAFNOSUPPORT or
    EPERM."""
    msg = f"LAN discovery could not start: {e.strerror or e}"
    if e.errno in (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES):
        msg += (
            " (listing network interfaces needs AF_NETLINK sockets and mDNS needs UDP: under "
            "systemd, RestrictAddressFamilies= must allow AF_NETLINK, as deploy/atomd.service does)"
        )
    return msg


class LanDiscovery:
    """This daemon's mDNS advert plus a browser for the adverts of its swarm.

    Build with ``await LanDiscovery.create(...)``; close with ``aclose()`` or ``async with``.
    ``on_found`` runs on the event loop and must not block.
    """

    def __init__(
        self,
        *,
        aiozc: AsyncZeroconf,
        info: AsyncServiceInfo,
        peers: FoundPeers,
        on_found: OnFound,
    ) -> None:
        self._aiozc = aiozc
        self._info = info
        self._peers = peers
        self._on_found = on_found
        self._browser: AsyncServiceBrowser | None = None
        self._registered = False
        self._closed = False
        # Resolutions in flight, owned here: cancelled and awaited by aclose().
        self._resolving: dict[str, asyncio.Task[None]] = {}

    @classmethod
    async def create(
        cls,
        *,
        swarm: str,
        peer_id: str,
        url: str,
        on_found: OnFound,
        interfaces: Interfaces = InterfaceChoice.All,
    ) -> LanDiscovery:
        """Announce this peer (``url`` on ``swarm``) and start browsing for the others.

        Raises ValueError if the advert cannot be encoded, AtomdError if mDNS cannot start
        (no usable interface, the name is taken, registration timed out).
        """
        advert = Advert(swarm=swarm, peer_id=peer_id, url=url)
        properties = encode_txt(advert)
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await _addresses_to_announce(parts.hostname or "", interfaces)
        except OSError as e:
            raise AtomdError(_refused(e)) from e
        label = instance_name(peer_id)
        try:
            info = AsyncServiceInfo(
                SERVICE_TYPE,
                f"{label}.{SERVICE_TYPE}",
                port=port,
                properties=properties,
                server=f"{label}.local.",
                parsed_addresses=addresses,
            )
            # Attaches to the running loop: sockets are read by this loop, no thread.
            aiozc = AsyncZeroconf(interfaces=interfaces)
        except OSError as e:
            raise AtomdError(_refused(e)) from e
        except BadTypeInNameException as e:
            raise AtomdError(f"LAN discovery could not start: {e}") from e
        discovery = cls(
            aiozc=aiozc,
            info=info,
            peers=FoundPeers(swarm=swarm, peer_id=peer_id),
            on_found=on_found,
        )
        try:
            await discovery._start()
        except BaseException:
            await discovery.aclose()
            raise
        log.info(
            "LAN discovery: announcing %s (swarm %r) at %s as %s",
            peer_id,
            swarm,
            url,
            ", ".join(addresses),
        )
        return discovery

    async def _start(self) -> None:
        try:
            async with asyncio.timeout(REGISTER_TIMEOUT_S):
                announced = await self._aiozc.async_register_service(self._info)
                self._registered = True
                await announced
        except TimeoutError:
            raise AtomdError(
                f"LAN discovery: registering {self._info.name} took over {REGISTER_TIMEOUT_S}s"
            ) from None
        except NonUniqueNameException:
            raise AtomdError(
                f"LAN discovery: {self._info.name} is already announced on this network "
                "(another daemon with the same identity?)"
            ) from None
        self._browser = AsyncServiceBrowser(
            self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_service_state_change]
        )

    def _on_service_state_change(
        self,
        *,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        # Called by the browser on the event loop; resolving needs awaits, so it gets a task.
        if state_change is ServiceStateChange.Removed:
            self._peers.forget(name)
            return
        if self._closed or name in self._resolving:
            return
        if len(self._resolving) >= MAX_PENDING_RESOLVES:
            log.debug(
                "LAN discovery: %d resolutions pending, skipping %s", len(self._resolving), name
            )
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name), name=f"mdns:{name}")
        self._resolving[name] = task
        task.add_done_callback(lambda _: self._resolving.pop(name, None))

    async def _resolve(self, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        try:
            # async_request bounds itself by its timeout in ms; the outer bound is the backstop.
            async with asyncio.timeout(RESOLVE_TIMEOUT_S + 1):
                resolved = await info.async_request(
                    self._aiozc.zeroconf, int(RESOLVE_TIMEOUT_S * 1000)
                )
        except TimeoutError:
            resolved = False
        if not resolved:
            log.debug("LAN discovery: %s did not resolve within %ss", name, RESOLVE_TIMEOUT_S)
            return
        try:
            advert = decode_txt(info.properties)
        except ValueError as e:
            log.debug("LAN discovery: ignoring %s: %s", name, e)
            return
        reason = self._peers.admit(name, advert)
        if reason is not None:
            log.debug("LAN discovery: ignoring %s at %s: %s", advert.peer_id, advert.url, reason)
            return
        log.info("LAN discovery: found peer %s at %s", advert.peer_id, advert.url)
        try:
            self._on_found(advert.peer_id, advert.url)
        except Exception as e:
            # A failing consumer must not stop discovery of the next peer.
            log.exception(
                "LAN discovery: on_found(%s, %s) failed: %s", advert.peer_id, advert.url, e
            )

    async def aclose(self) -> None:
        """Say goodbye on the network (unregister), stop browsing and close the sockets."""
        if self._closed:
            return
        self._closed = True
        pending = list(self._resolving.values())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()  # no network I/O: drops the browser's timers
        if self._registered:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    goodbyes = await self._aiozc.async_unregister_service(self._info)
                    await goodbyes
            except TimeoutError:
                log.warning("LAN discovery: goodbyes not sent within %ss", CLOSE_TIMEOUT_S)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._aiozc.async_close()
        except TimeoutError:
            log.warning("LAN discovery: mDNS sockets not closed within %ss", CLOSE_TIMEOUT_S)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def _addresses_to_announce(host: str, interfaces: Interfaces) -> list[str]:
    """The IP addresses for this advert's A/AAAA records (DNS-SD resolution needs one).

    Peers use the URL from the TXT record; the addresses only have to be this host's: the
    URL's own IP if it has one, else the chosen interfaces' addresses, else every
    non-loopback IPv4 address (what python-zeroconf serves by default).
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and not ip.is_unspecified:
        if ip.is_loopback:
            log.warning(
                "LAN discovery: the advertised URL's host %s is loopback; peers on the "
                "network cannot reach it (set --advertise)",
                host,
            )
        return [str(ip)]
    if not isinstance(interfaces, InterfaceChoice):
        chosen = [a for a in interfaces if isinstance(a, str)]
        if chosen:
            return chosen
    # getifaddrs(3) is a quick syscall, but it is I/O: keep it off the loop all the same.
    async with asyncio.timeout(RESOLVE_TIMEOUT_S):
        adapters = await asyncio.to_thread(ifaddr.get_adapters)
    found = sorted(
        {
            a.ip
            for adapter in adapters
            for a in adapter.ips
            if isinstance(a.ip, str) and not ipaddress.ip_address(a.ip).is_loopback
        }
    )
    if not found:
        raise AtomdError("LAN discovery: this host has no non-loopback IPv4 address to announce")
    return found
