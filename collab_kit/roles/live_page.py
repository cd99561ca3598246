"""The run's live page and its JSON API, served by the monitor (``collab-kit monitor --dashboard-port PORT``).

    page = LivePage("monitor/run.page.json", host="127.0.0.1", port=8080)   # its own process
    page.url                                                                  # http://127.0.0.1:8080/
    page.stop()

The monitor writes its page's documents once a poll (collab_kit.roles.live_status); this process serves them, and
the page that draws them, to whoever opens it. It is a process of its own so that many watchers take their CPU from
the machine, never from the monitor's polls and checkpoints, and it ends when the monitor does, however it ends.

The API (read-only, JSON, ``GET`` or ``HEAD``; other tools may read it too):

    GET /api                    what is here
    GET /api/status             the run now: epoch, loss, peers and their state, leaderboard, checkpoints, settings,
                                join line; ``updated`` (time of the poll) and ``poll`` (its number)
    GET /api/series?since=T     the polls as columns (time, epoch, loss, volunteers, anchors, samples_per_second,
                                samples); with ``since``, only those after time T (seconds since the epoch)

Every answer carries an ETag (``If-None-Match`` gets a 304 while nothing changed). Before the monitor's first poll
the API answers 503 with ``Retry-After``. Everything the page loads (its script, style and the charting library,
Chart.js, MIT) is served from here: the page works with no Internet. A path or query that is not one of these is a 4xx;
a request that does not arrive whole within 10 s is closed (collab_kit.auth.guards). ``tests/roles/test_live_page.py``
shows each of these.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from bisect import bisect_right

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from collab_kit.auth.guards import guarded_protocol_class
from collab_kit.errors import CollabKitError

logger = logging.getLogger(__name__)

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page_assets")
# page_assets/chart.umd.min.js is dist/chart.umd.min.js of npm's chart.js-4.6.2.tgz as published (MIT, its licence
# beside it); ``tests/roles/test_live_page.py`` checks that it is that file, byte for byte
CHART_JS_SHA256 = "3f288f4f26882c26b58931fb586a9b4f30370b5de38d69dc005b0bd05b08e113"
# every file the page loads, by the path it is asked for: nothing else under ASSETS (or anywhere) can be named
ASSET_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
    "/vendor/chart.umd.min.js": ("chart.umd.min.js", "text/javascript; charset=utf-8"),
    "/vendor/chart.js-LICENSE.md": ("chart.js-LICENSE.md", "text/plain; charset=utf-8"),
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
API_INDEX = {
    "endpoints": {
        "/api/status": "the run now (see collab_kit.roles.live_page)",
        "/api/series?since=T": "the polls as columns, after time T (optional)",
    }
}
REFRESH_SECONDS = 0.5  # how often a request looks whether the monitor wrote a newer document
READY_PREFIX = "live page listening on "
MAX_QUERY_BYTES = 256
MAX_HEADER_BYTES = 16384
PAGE_NICENESS = 10  # the page's process runs at a lower priority than the monitor's (os.nice)
REQUEST_DEADLINE = 10.0  # seconds a request may take to arrive whole before its connection is closed


class LivePageError(CollabKitError, RuntimeError):
    """The page could not start (its port taken, a host that is not this machine's)."""


class Documents:
    """The monitor's newest documents, read again when the file changes, encoded once for every reader."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._checked, self._stamp = 0.0, None
        self.status: bytes | None = None
        self.series: dict[str, list] = {}
        self.series_bytes: bytes | None = None
        self.etag = ""

    def refresh(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._checked < REFRESH_SECONDS:
                return
            self._checked = now
            try:
                info = os.stat(self.path)
                if (info.st_mtime_ns, info.st_size) == self._stamp:
                    return
                with open(self.path) as file:
                    document = json.load(file)
            except (OSError, ValueError):  # not written yet (the first poll is under way)
                return
            self._stamp = (info.st_mtime_ns, info.st_size)
            self.status = json.dumps(document["status"], separators=(",", ":")).encode()
            self.series = document["series"]
            self.series_bytes = json.dumps(self.series, separators=(",", ":")).encode()
            self.etag = hashlib.sha256(self.status).hexdigest()[:20]

    def series_since(self, since: float) -> bytes:
        times = self.series.get("time", [])
        start = bisect_right(times, since)
        return json.dumps(
            {name: column[start:] for name, column in self.series.items()}, separators=(",", ":")
        ).encode()


def _json(status: int, body: dict, **headers) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers={**SECURITY_HEADERS, "Cache-Control": "no-store", **headers})


def create_app(document_path: str) -> FastAPI:
    """The page's web app: the files of ASSET_FILES and the API, over the documents at ``document_path``."""
    documents = Documents(document_path)
    assets: dict[str, tuple[bytes, str]] = {}
    for route, (name, kind) in ASSET_FILES.items():
        with open(os.path.join(ASSETS, name), "rb") as file:
            assets[route] = (file.read(), kind)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def only_reading(request: Request, call_next):
        if request.method not in ("GET", "HEAD"):
            return _json(405, {"detail": "this page is read-only: GET or HEAD"}, Allow="GET, HEAD")
        if len(request.scope.get("query_string", b"")) > MAX_QUERY_BYTES:
            return _json(414, {"detail": f"a query of over {MAX_QUERY_BYTES} bytes: the API takes ?since=T alone"})
        if sum(len(name) + len(value) for name, value in request.scope["headers"]) > MAX_HEADER_BYTES:
            return _json(431, {"detail": f"headers of over {MAX_HEADER_BYTES} bytes: send a browser's usual ones"})
        return await call_next(request)

    def document(request: Request, body: bytes | None) -> Response:
        if body is None:
            return _json(
                503,
                {"detail": "the monitor has not polled the swarm yet: try again in a few seconds"},
                **{"Retry-After": "2"},
            )
        headers = {**SECURITY_HEADERS, "Cache-Control": "no-cache", "ETag": f'"{documents.etag}"'}
        if request.headers.get("if-none-match") == f'"{documents.etag}"':
            return Response(status_code=304, headers=headers)
        return Response(body, media_type="application/json", headers=headers)

    @app.api_route("/api", methods=["GET", "HEAD"])
    async def api_index():
        return _json(200, API_INDEX)

    @app.api_route("/api/status", methods=["GET", "HEAD"])
    async def status(request: Request):
        documents.refresh()
        return document(request, documents.status)

    @app.api_route("/api/series", methods=["GET", "HEAD"])
    async def series(request: Request, since: str | None = None):
        documents.refresh()
        if since is None or documents.series_bytes is None:
            return document(request, documents.series_bytes)
        try:
            since_time = float(since)
            if not math.isfinite(since_time):
                raise ValueError
        except ValueError:
            return _json(400, {"detail": f"since={since[:40]!r}: expected a time in seconds since the epoch"})
        return document(request, documents.series_since(since_time))

    def asset(route: str):
        body, kind = assets[route]

        async def serve_asset():
            return Response(body, media_type=kind, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

        return serve_asset

    for route in assets:
        app.add_api_route(route, asset(route), methods=["GET", "HEAD"])

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _json(404, {"detail": "nothing here: the page is at /, its API under /api"})

    return app


def _bind(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise LivePageError(
            f"the live page could not listen on {host}:{port} ({e.strerror or e}): pick another "
            f"--dashboard-port (0: any free one) or --dashboard-host"
        ) from None
    sock.set_inheritable(True)
    return sock


def _watch_parent(parent: int) -> None:
    """End this process when the monitor is gone, however it went (a SIGKILL too)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the run's live page (started by collab-kit monitor)")
    parser.add_argument("--document", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--request-deadline", type=float, default=REQUEST_DEADLINE)
    args = parser.parse_args(argv)
    try:
        sock = _bind(args.host, args.port)
    except LivePageError as e:
        print(e, file=sys.stderr, flush=True)
        return 2
    os.nice(PAGE_NICENESS)  # the page gives way: a crowd of watchers never slows the monitor's polls and checkpoints
    if args.parent is not None:
        threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    config = uvicorn.Config(
        create_app(args.document),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=5,
        limit_concurrency=2048,
        server_header=False,
        http=guarded_protocol_class(args.request_deadline, connections_per_client=512),
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"{READY_PREFIX}http://{shown}:{port}/", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


class LivePage:
    """The live page as a child process of the monitor, serving ``document_path``.

    :param host: the address it listens on (127.0.0.1: this machine only; 0.0.0.0 to publish it)
    :param port: its port (0: any free one; ``url`` says which)
    :param request_deadline: seconds a request may take to arrive whole (a slower one's connection is closed)
    :raises LivePageError: it could not listen there
    """

    def __init__(
        self,
        document_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 60.0,
        request_deadline: float = REQUEST_DEADLINE,
    ):
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "collab_kit.roles.live_page",
                "--document",
                document_path,
                "--host",
                host,
                "--port",
                str(port),
                "--parent",
                str(os.getpid()),
                "--request-deadline",
                repr(float(request_deadline)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        found: dict[str, str] = {}
        reader = threading.Thread(target=lambda: found.setdefault("line", self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = found.get("line", "")
        if not line.startswith(READY_PREFIX):
            self.stop()
            problem = (self.process.stderr.read() or "").strip().splitlines()
            raise LivePageError(problem[-1] if problem else f"the live page did not start within {timeout:g} s")
        self.url = line[len(READY_PREFIX) :].strip()
        # its warnings go to the monitor's log; an empty stdout pipe left unread would never fill
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        for line in self.process.stderr:
            logger.warning(f"live page: {line.rstrip()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":
    sys.exit(main())
