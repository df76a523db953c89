"""The chat page at ``/`` for browsers (``--no-webui`` turns it off).

One self-contained HTML document: the page's CSS, its scripts and the microphone's
AudioWorklet are inlined when the app is built, so a cold start costs one request and works
offline (no CDN, no build step). The parts stay separate files under ``webui/`` to be read and
edited. A JSON client that GETs ``/`` keeps getting ``{"status":"ok"}``: only a request that
asks for HTML over JSON (a browser's navigation) gets the page, as llama-server decides.

The page is public, like ``/`` always was: it asks for the API key itself, when the server
has keys, and sends it on every call. Its Content-Security-Policy runs only the inlined
script (by hash) and the worklet it makes from a Blob, so markup that slips out of a model's
answer could not run script even if the page's own escaping failed.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
from importlib import resources

import attrs
from quart import Response, request

# Concatenated in this order into one module script (later files use earlier ones' names).
SCRIPTS = ("markdown.js", "api.js", "store.js", "chat.js", "talk.js", "main.js")


@attrs.frozen
class Page:
    body: bytes
    gzipped: bytes
    etag: str
    csp: str


def _part(name: str) -> str:
    return (resources.files(__package__) / "webui" / name).read_text(encoding="utf-8")


def build(*, api_prefix: str, keys: bool) -> Page:
    """The page for a server mounted at ``api_prefix`` that does (not) need an API key."""
    script = "\n".join(_part(name) for name in SCRIPTS)
    worklet = _part("mic-worklet.js")
    for source in (script, worklet):
        # Inline <script> text ends at the first "</script": none may contain one.
        assert "</script" not in source.lower()
    config = html.escape(json.dumps({"apiPrefix": api_prefix, "keys": keys}))
    text = (
        _part("index.html")
        .replace("/*STYLE*/", _part("style.css"))
        .replace("/*SCRIPT*/", script)
        .replace("/*WORKLET*/", worklet)
        .replace("{{CONFIG}}", config)
    )
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = (
        "default-src 'none'; "
        f"script-src 'sha256-{digest}' blob:; "
        "style-src 'unsafe-inline'; "
        "img-src 'self' data: blob:; "
        "connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    body = text.encode()
    etag = hashlib.sha256(body).hexdigest()[:20]
    return Page(body, gzip.compress(body, 9, mtime=0), etag, csp)


def wanted() -> bool:
    """A browser's navigation: HTML preferred to JSON (``*/*`` alone chooses JSON)."""
    accept = request.accept_mimetypes
    return accept.best_match(["application/json", "text/html"]) == "text/html"


def respond(page: Page) -> Response:
    headers = {
        "Content-Security-Policy": page.csp,
        # Revalidated on every load (the ETag makes that a 304): a restarted server with a
        # newer page is never hidden behind a cached one.
        "Cache-Control": "no-cache",
        "ETag": f'"{page.etag}"',
        "Vary": "Accept, Accept-Encoding",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    if page.etag in request.if_none_match:
        return Response(b"", status=304, headers=headers)
    content_type = "text/html; charset=utf-8"
    if request.accept_encodings.quality("gzip") > 0:
        headers["Content-Encoding"] = "gzip"
        return Response(page.gzipped, content_type=content_type, headers=headers)
    return Response(page.body, content_type=content_type, headers=headers)
