"""The web dashboard: one page and its two assets, shipped in the package (``api/dashboard.*``).

The shell is public (the gate lets ``DASHBOARD_PATHS`` through without a token) and holds no
data: the page reads everything from the token-guarded ``/v1`` routes with
``Authorization: Bearer`` taken from the URL fragment (``/dashboard#token=...``, never sent to
the server) or typed in, and kept in the tab's ``sessionStorage``. No CDN, no build step:
plain HTML, CSS and JavaScript drawing inline SVG. The Content-Security-Policy lets the page
load and call nothing but this daemon. Nothing here imports torch.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
PAGE = "/dashboard"
ASSET_PREFIX = "/dashboard/assets/"
DASHBOARD_PATHS = frozenset(
    {PAGE, PAGE + "/", *(ASSET_PREFIX + n for n in ASSETS if n != "dashboard.html")}
)
"""Answered without a token: the shell and its assets (no data in any of them)."""

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    """An asset's bytes, from the installed package (``importlib.resources``)."""
    return resources.files("atomd_api").joinpath(name).read_bytes()


router = APIRouter(include_in_schema=False)


@router.get(PAGE)
async def page() -> Response:
    return Response(asset("dashboard.html"), media_type=ASSETS["dashboard.html"], headers=HEADERS)


@router.get(PAGE + "/")
async def page_slash() -> Response:
    return RedirectResponse(PAGE, status_code=308)


@router.get(ASSET_PREFIX + "dashboard.css")
async def css() -> Response:
    return Response(asset("dashboard.css"), media_type=ASSETS["dashboard.css"], headers=HEADERS)


@router.get(ASSET_PREFIX + "dashboard.js")
async def js() -> Response:
    return Response(asset("dashboard.js"), media_type=ASSETS["dashboard.js"], headers=HEADERS)
