"""The dashboard's web server: the page, its two static files and ``/api/view``, served by starlette.

The page polls ``/api/view`` once a second (plain JSON; simpler to follow through proxies than a stream).
Every response forbids scripts and styles from anywhere but this server and any inline script, so even a
value that slipped past the page's text-only rendering could not run.
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from client.dashboard.feed import Feed

STATIC = Path(__file__).with_name("static")
FILES = {"/": ("index.html", "text/html"), "/dashboard.js": ("dashboard.js", "text/javascript"),
         "/dashboard.css": ("dashboard.css", "text/css")}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def create_app(feed: Feed) -> Starlette:
    def static(request: Request) -> Response:
        name, media_type = FILES[request.url.path]
        return FileResponse(STATIC / name, media_type=media_type, headers=SECURITY_HEADERS)

    def view(request: Request) -> Response:
        return JSONResponse(feed.view, headers=SECURITY_HEADERS)

    routes = [Route(path, static) for path in FILES] + [Route("/api/view", view)]
    return Starlette(routes=routes)
