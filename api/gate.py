"""The control API's gate: what every request passes before any route reads or parses it.

A pure ASGI middleware (it sees the request before FastAPI reads the body), in this order:

1. **Host**: the ``Host`` header must name one of the control API's own names (loopback names,
   its bind address, ``ATOMD_CONTROL_HOSTS``): a web page that rebinds its DNS name to
   127.0.0.1 sends its own name and is refused (400), so it cannot drive a token-free API.
2. **Cross-site**: a request the operator's browser sends for a page of another site (its
   ``Origin`` is not one of those names, or ``Sec-Fetch-Site: cross-site``) is refused (403),
   not counted against the source (the operator's own machine: a page could otherwise get
   the CLI rate-limited). A page can send a "simple" POST without preflight, with the real
   Host: without this check it could stop the jobs of a daemon that has no token.
3. **Rate limit**: a source refused too often is answered 429 (``atomd.rejections``).
4. **Token**: with ``ATOMD_CONTROL_TOKEN`` set, every path but ``/healthz`` and the dashboard's
   data-free shell (``/dashboard`` and its assets, ``atomd_api.dashboard``) needs
   ``Authorization: Bearer <token>`` (``/docs``, ``/openapi.json`` and ``/metrics`` too), checked
   before the body is read (401).
5. **Body**: a declared ``Content-Length`` over ``MAX_BODY_BYTES`` is refused before reading
   (413); a body that streams past it is cut off with 413 (the body is read here, bounded,
   and handed to the route whole).

Refusals are counted (``Rejections``, one aggregated event a minute), not recorded a row each.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from atomd.config import Settings
from atomd.rejections import Rejections
from atomd_api.dashboard import DASHBOARD_PATHS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20
"""The largest request body of the control API (a job spec is a few hundred bytes)."""
OPEN_PATHS = frozenset({"/healthz", *DASHBOARD_PATHS})


def _host_name(raw: str) -> str:
    """The host of a ``Host`` header, lower case, without port or IPv6 brackets."""
    raw = raw.strip().lower()
    if raw.startswith("["):
        return raw[1 : raw.find("]")] if "]" in raw else raw
    return raw.rsplit(":", 1)[0] if raw.count(":") == 1 else raw


def _cross_site(headers: dict[str, str], hosts: frozenset[str]) -> str | None:
    """Why a browser sent this request for a web page of another site, or None. The CLI and
    curl send neither header; the dashboard and ``/docs`` are of this site."""
    if headers.get("sec-fetch-site", "").strip().lower() == "cross-site":
        return "a request made by a web page of another site (Sec-Fetch-Site: cross-site)"
    origin = headers.get("origin")
    if origin is None:
        return None
    try:
        host = urlsplit(origin.strip()).hostname
    except ValueError:
        host = None
    if host is not None and host in hosts:
        return None
    return f"a request made by the web page at {origin[:100]!r}, not a page of this control API"


class ControlGate:
    def __init__(self, app: ASGIApp, settings: Settings, rejections: Rejections | None) -> None:
        self.app = app
        self.settings = settings
        self.hosts = settings.allowed_control_hosts
        self.rejections = rejections

    async def _refuse(
        self, scope: Scope, send: Send, status: int, kind: str, detail: str,
        headers: list[tuple[bytes, bytes]] | None = None, count: bool = True,
    ) -> None:  # fmt: skip
        source = scope["client"][0] if scope.get("client") else "?"
        if self.rejections is not None and status != 429 and count:
            self.rejections.refused("control", source, status, f"{scope.get('path', '')[:100]}: "
                                    f"{detail}")  # fmt: skip
        body = json.dumps({"error": kind, "detail": detail}).encode()
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), *(headers or [])],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = _host_name(headers.get("host", ""))
        if host not in self.hosts:
            shown = headers.get("host", "")[:100]
            allowed = ", ".join(sorted(self.hosts))
            await self._refuse(scope, send, 400, "invalid",
                               f"Host {shown!r} is not a name of this control API; allowed: "
                               f"{allowed} (ATOMD_CONTROL_HOSTS)")  # fmt: skip
            return
        why = _cross_site(headers, self.hosts)
        if why is not None:
            await self._refuse(scope, send, 403, "forbidden", why, count=False)
            return
        source = scope["client"][0] if scope.get("client") else "?"
        wait = self.rejections.retry_after(source) if self.rejections is not None else None
        if wait is not None:
            await self._refuse(scope, send, 429, "rate_limited",
                               f"too many refused requests from {source}; retry in {wait:.1f} s",
                               [(b"retry-after", str(max(1, round(wait))).encode())])  # fmt: skip
            return
        token = self.settings.control_token
        if token is not None and scope.get("path") not in OPEN_PATHS:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.encode(), token.get_secret_value().encode()
            ):
                await self._refuse(scope, send, 401, "unauthorized",
                                   "missing or wrong bearer token (Authorization: Bearer "
                                   "<token>)", [(b"www-authenticate", b"Bearer")])  # fmt: skip
                return
        declared = headers.get("content-length")
        # ASCII digits only: "²".isdigit() holds, and int("²") raises.
        if declared is not None and (
            not (declared.isascii() and declared.isdigit()) or int(declared) > MAX_BODY_BYTES
        ):
            await self._refuse(scope, send, 413, "too_large",
                               f"a body of {declared[:20]} bytes; the control API takes at most "
                               f"{MAX_BODY_BYTES}")  # fmt: skip
            return
        # The body, read here within the bound (at most 1 MiB), then handed on as one message.
        chunks: list[bytes] = []
        received = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > MAX_BODY_BYTES:
                await self._refuse(scope, send, 413, "too_large",
                                   f"the body streamed past {MAX_BODY_BYTES} bytes")  # fmt: skip
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)
