"""``GET /dashboard``: the live cache dashboard, one self-contained HTML page.

The page polls ``v1/cache/stats`` (a relative URL, so it also works when an app such as the
router serves it, or a proxy mounts it under a prefix) and draws hit rate over time, tokens
saved, the page pool, per-agent / per-tenant tables, shared prefixes and engine facts.

Its CSS and JS live beside it in ``static/`` for editing and are inlined into the one response
here: no second request, no build step, no CDN. The response's Content-Security-Policy allows
exactly that inlined code (by hash) and connections to the page's own origin only, so the
browser fetches nothing from anywhere else.

Any FastAPI app can serve it: ``app.include_router(gateway.http.dashboard.router)``. The page
itself is open; the stats it fetches are behind the API's auth (the page sends a key given as
``?key=`` or typed in as ``Authorization: Bearer``).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

STATIC_DIR = Path(__file__).with_name("static")

# The tags dashboard.html uses to load its siblings (so the file also works opened from disk);
# each is replaced by the file's text inlined.
_STYLE_TAG = '<link rel="stylesheet" href="dashboard.css">'
_SCRIPT_TAG = '<script src="dashboard.js"></script>'


@dataclass(frozen=True, slots=True)
class DashboardPage:
    """The page as served: the HTML with its CSS and JS inlined, and the policy that lets the
    browser run exactly that code."""

    html: str
    content_security_policy: str

    @property
    def headers(self) -> dict[str, str]:
        return {
            "Content-Security-Policy": self.content_security_policy,
            "X-Content-Type-Options": "nosniff",
            # A key passed as ?key= must not leak to other sites through the Referer header.
            "Referrer-Policy": "no-referrer",
            # Revalidate on every load so a redeployed gateway never shows a stale page.
            "Cache-Control": "no-cache",
        }


def csp_hash(source: str) -> str:
    """The CSP source expression (``'sha256-...'``) allowing one inline script or style."""
    digest = hashlib.sha256(source.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def _inline(html: str, tag: str, element: str, source: str, name: str) -> str:
    if html.count(tag) != 1:
        raise ValueError(f"dashboard.html must contain {tag!r} exactly once to inline {name}")
    if f"</{element}" in source.lower():
        raise ValueError(f"{name} contains '</{element}', which would end the inlined element")
    return html.replace(tag, f"<{element}>{source}</{element}>")


def build_page(static_dir: Path = STATIC_DIR) -> DashboardPage:
    """Read ``dashboard.html``, ``.css`` and ``.js`` from ``static_dir`` and inline them.

    Raises:
        FileNotFoundError: a file is missing (e.g. package data not installed).
        ValueError: the HTML lacks a tag to replace, or a file would break out of its element.
    """
    html = (static_dir / "dashboard.html").read_text(encoding="utf-8")
    css = (static_dir / "dashboard.css").read_text(encoding="utf-8")
    js = (static_dir / "dashboard.js").read_text(encoding="utf-8")
    html = _inline(html, _STYLE_TAG, "style", css, "dashboard.css")
    html = _inline(html, _SCRIPT_TAG, "script", js, "dashboard.js")
    policy = "; ".join(
        (
            "default-src 'none'",
            f"script-src {csp_hash(js)}",
            f"style-src {csp_hash(css)}",
            "connect-src 'self'",  # the stats API, same origin
            "img-src data:",  # the empty favicon
            "base-uri 'none'",
            "form-action 'none'",  # the key form is handled in JS, never submitted
            "frame-ancestors 'none'",
        )
    )
    return DashboardPage(html=html, content_security_policy=policy)


# Built at import: a missing or broken static file fails the app's start, not a later request.
PAGE = build_page()

router = APIRouter()


@router.api_route("/dashboard", methods=["GET", "HEAD"], include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live cache dashboard (HTML)."""
    return HTMLResponse(PAGE.html, headers=PAGE.headers)
