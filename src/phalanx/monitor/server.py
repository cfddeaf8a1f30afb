"""The status server: ``/`` (the page), ``/status.json``, ``/metrics``, and actions, for the job's secret only.

``phalanx run --status [HOST:]PORT`` binds it before anything starts (a port in use
refuses the job in one line naming it) and serves from a daemon thread of the launcher.
Every request must carry the job's status token, an HMAC of the job's secret
(:func:`token`): ``Authorization: Bearer TOKEN`` (Prometheus's ``authorization``, curl,
scripts) or the cookie that ``/?token=TOKEN``, the link the launcher prints, sets in the
browser. Anything else gets 401 with an empty body. A page left open on a port that a
new job took over is refused by the new job (its token differs) and says so.

Actions are the page's buttons: ``server.actions["stacks"] = fn`` makes a button that
POSTs ``/action/stacks``, and the text ``fn()`` returns is shown on the page (the place
where a stuck rank's stacks are shown, :mod:`phalanx.launch`). Nothing else can be posted.

Example:
    >>> import json, urllib.request
    >>> server = StatusServer("127.0.0.1", 0)
    >>> server.serve(lambda: {"ok": True}, token("s3cret")); port = server.port
    >>> ask = lambda **h: urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/status.json",
    ...                                                                  headers=h), timeout=10)
    >>> json.load(ask(Authorization="Bearer " + token("s3cret")))["ok"]
    True
    >>> try: ask()
    ... except urllib.error.HTTPError as e: print(e.code, e.read())
    401 b''
    >>> server.close()
"""
from __future__ import annotations

import hashlib
import hmac
import http.cookies
import http.server
import json
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable

from .metrics import CONTENT_TYPE, render

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")
LINGER_S = 3.0  # after the job ends, how long an open page has to fetch the news before the server goes


def token(secret: str) -> str:
    """The status token of the job whose secret is ``secret`` (the secret itself never leaves the launcher).

    Example:
        >>> len(token("s3cret")), token("s3cret") == token("other")
        (64, False)
    """
    return hmac.new(secret.encode(), b"phalanx-status", hashlib.sha256).hexdigest()


def parse_address(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port); loopback when no host is given. Raises ValueError on anything else.

    Example:
        >>> parse_address("8080"), parse_address("0.0.0.0:8080"), parse_address("[::1]:8080")
        (('127.0.0.1', 8080), ('0.0.0.0', 8080), ('::1', 8080))
    """
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    value = int(port)
    if not 0 <= value <= 65535:
        raise ValueError(f"port {value} out of range")
    return host, value


class StatusServer:
    """An HTTP server bound now on ``host:port``; it serves once :meth:`serve` gives it the status and token."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        handler = type("Handler", (_Handler,), {"server_": self})
        # raises OSError when the port is taken: before any worker starts
        self.httpd = type("Server", (_Server,), {"address_family": family})((host, port), handler)
        self.host, self.port = host, self.httpd.server_address[1]
        self.status: Callable[[], dict[str, Any]] | None = None
        self.token: str | None = None
        self.actions: dict[str, Callable[[], str]] = {}  # name -> what its button shows (e.g. "stacks")
        self._polled = 0.0  # monotonic time of the last /status.json served
        self._told = threading.Event()  # a /status.json saying the job ended has been served
        self._ended = False
        self.connections: set[socket.socket] = set()  # open keep-alive connections: closed with the server
        self._conn_lock = threading.Lock()
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="phalanx-status-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The link to open (with the token; keep it as you keep the job's secret)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/?token={self.token}"

    def serve(self, status: Callable[[], dict[str, Any]], token_: str) -> None:
        """Start answering: ``status()`` is the job's state (:meth:`Collector.status`), ``token_`` the one key."""
        self.status, self.token = status, token_

    def ended(self) -> None:
        """The job ended (the status says why): :meth:`close` lets an open page fetch that first."""
        self._ended = True

    def close(self, linger_s: float = LINGER_S) -> None:
        """Stop serving; a page that polled in the last few seconds gets up to ``linger_s`` to read the end."""
        if self._ended and time.monotonic() - self._polled < 5.0:
            self._told.wait(linger_s)
        self.httpd.shutdown()
        self.httpd.server_close()
        # a browser keeps its connection open between polls: were it left, the next job on this port would not
        # be the one that answers it
        self.status, self.token = None, None
        with self._conn_lock:
            for conn in list(self.connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def authorized(self, headers: Any) -> bool:
        if self.token is None:
            return False
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip(), self.token):
            return True
        jar = http.cookies.SimpleCookie(headers.get("Cookie", ""))
        mine = jar.get(self.cookie)
        return mine is not None and hmac.compare_digest(mine.value, self.token)

    @property
    def cookie(self) -> str:
        return f"phalanx_status_{self.port}"  # a cookie is per host, not per port: two jobs on one host differ


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # a port left in TIME_WAIT by the last job is free; a live listener still refuses


class _Handler(http.server.BaseHTTPRequestHandler):
    server_: StatusServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.server_._conn_lock:
            self.server_.connections.add(self.connection)

    def finish(self) -> None:
        with self.server_._conn_lock:
            self.server_.connections.discard(self.connection)
        super().finish()

    def log_message(self, *_: Any) -> None:  # the launcher's stderr is the job's log, not an access log
        pass

    def _send(self, code: int, body: bytes = b"", kind: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        s = self.server_
        url = urllib.parse.urlsplit(self.path)
        given = urllib.parse.parse_qs(url.query).get("token", [""])[0]
        if url.path == "/" and given and s.token and hmac.compare_digest(given, s.token):
            # the printed link: keep the token in a cookie for this port, and take it out of the address bar
            self._send(303, headers={"Location": "/", "Set-Cookie": f"{s.cookie}={s.token}; Path=/; HttpOnly; "
                                                                    "SameSite=Strict"})
            return
        if not s.authorized(self.headers):
            self._send(401)
            return
        if url.path == "/":
            with open(PAGE, "rb") as f:
                self._send(200, f.read(), "text/html; charset=utf-8")
        elif url.path == "/status.json":
            status = s.status() if s.status else {}
            status["actions"] = sorted(s.actions)
            self._send(200, json.dumps(status).encode(), "application/json")
            s._polled = time.monotonic()
            if status.get("ended"):
                s._told.set()
        elif url.path == "/metrics":
            self._send(200, render(s.status()).encode() if s.status else b"", CONTENT_TYPE)
        else:
            self._send(404)

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        s = self.server_
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= 65536:
            self.rfile.read(length)  # nothing is read from a body; drained so the connection stays in step
        elif length:
            self.close_connection = True
        if not s.authorized(self.headers):
            self._send(401)
            return
        name = self.path[len("/action/"):] if self.path.startswith("/action/") else None
        action = s.actions.get(name) if name else None
        if action is None:
            self._send(404)
            return
        try:
            self._send(200, str(action()).encode())
        except Exception as err:  # noqa: BLE001 - the button shows what went wrong
            self._send(500, f"{type(err).__name__}: {err}".encode())


__all__ = ["LINGER_S", "StatusServer", "parse_address", "token"]
