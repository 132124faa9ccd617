"""A small synchronous client of a running daemon's control API (used by the CLI)."""

from __future__ import annotations

from typing import Any

import httpx

from atomd.errors import AtomdError


class ClientError(AtomdError):
    """The daemon could not be reached, or answered with an error."""


class ControlClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ClientError(
                f"cannot reach atomd at {self.url}: is the daemon running (`atomd run`)? "
                "Pick another with --url or ATOMD_URL."
            ) from None
        except httpx.TimeoutException:
            raise ClientError(f"atomd at {self.url} did not answer in time") from None
        if r.status_code >= 400:
            raise ClientError(f"{method} {path} -> {r.status_code}: {_detail(r)}")
        if r.status_code == 204 or not r.content:
            return None
        return r.json()


def _detail(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):  # FastAPI validation errors: name the fields
        return "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', [])[1:])}: {e.get('msg')}" for e in detail
        )
    return str(detail)
