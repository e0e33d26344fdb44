"""The router port: ``POST /v1/score`` and ``POST /v1/routed`` on a lean HTTP/1.1 listener.

aiohttp spends ~150 us of a request on its own machinery (request and response objects, the
middleware chain, a task per request), as much as scoring an 8k-token prompt does
(BENCHMARKS.md, "Score"). A router asks on every request, so ``hmakv index --router-listen``
serves the two endpoints it calls on a port of their own: an ``asyncio.Protocol`` over httptools
(llhttp, the parser uvicorn uses) that hands each complete body to the same ``ScoreApi`` replies
the aiohttp app sends, so the two ports cannot answer differently. Everything else (health,
readiness, metrics, the OpenAPI document, ``/v1/workers``) stays on the main port.

The bounds are the main port's (``ApiLimits`` and the bearer token), enforced here by hand
since aiohttp is not there; which answer each gets, and when the connection closes:
consumers/README.md, "The router port". Each request is answered synchronously as its last
byte is parsed, on the follower's event loop, as the aiohttp handlers are, so pipelined ones are
answered in order.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from http import HTTPStatus

import httptools

from hmakv.consumers.api import Reply, ScoreApi, error_reply, is_msgpack
from hmakv.kvlog.logs import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)

MAX_HEAD_BYTES = 16 * 1024  # request line and headers; a router's are a few hundred bytes
LINGER_S = 2.0  # a closing connection's input is drained this long
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# A route's reply to a complete body: (body, msgpack, started) -> Reply.
Answer = Callable[[bytes, bool, float], Reply]


class _Refused(Exception):
    """Stops the parser: the connection was answered and is closing."""


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()


_STATUS_LINES = {int(status): _status_line(status) for status in HTTPStatus if status >= 200}


class RouterPort:
    """The listener and what its connections share: the routes, the token, the body slots."""

    def __init__(self, api: ScoreApi, *, token: str | None = None) -> None:
        self.api = api
        self.limits = api.limits
        self.stats = api.stats
        self._expected = f"Bearer {token}".encode() if token else None
        self.routes: dict[bytes, Answer] = {
            b"/v1/score": api.score_reply,
            b"/v1/routed": lambda body, msgpack, _started: api.routed_reply(body, msgpack),
        }
        self.receiving = 0  # requests whose body is being buffered
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self.connections):  # wait_closed waits for them (3.12+)
                connection.close()
            await self._server.wait_closed()

    def authorized(self, given: bytes) -> bool:
        return self._expected is None or hmac.compare_digest(given, self._expected)

    def refused(self, status: int) -> None:
        refused = self.stats.router_port_refused
        refused[status] = refused.get(status, 0) + 1


class _Connection(asyncio.Protocol):
    """One client: httptools calls the ``on_*`` methods while ``data_received`` feeds it."""

    def __init__(self, port: RouterPort) -> None:
        self._port = port
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._new_request()

    def _new_request(self) -> None:
        self._headers_done = False
        self._fed_in_head = 0  # bytes fed while this request's head is incomplete
        self._head_bytes = 0
        self._url = b""
        self._content_length: int | None = None
        self._content_type = b""
        self._authorization = b""
        self._expect_continue = False
        self._started = 0.0
        self._answer: Answer | None = None
        self._verdict: Reply | None = None  # a refusal to send once the body is read
        self._holds_slot = False
        self._body: list[bytes] = []
        self._body_bytes = 0

    # ------------------------------------------------------------------------- the transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._port.connections.add(self)
        self._port.stats.router_port_connections += 1
        self._arm(self._port.limits.idle_timeout, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._port.connections.discard(self)
        self._port.stats.router_port_connections -= 1
        self._closing = True
        self._disarm()
        self._release_slot()

    def pause_writing(self) -> None:  # a client that does not read its answers: stop reading
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        assert self.transport is not None
        if not self._closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if not self._headers_done:
            self._fed_in_head += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            if not isinstance(error.__context__, _Refused):
                raise
            return
        except httptools.HttpParserUpgrade:  # the request was answered; no protocol switch
            self._finish()
            return
        except httptools.HttpParserError as error:
            self._close_with(400, f"malformed request: {error}")
            return
        if not self._headers_done and self._fed_in_head > MAX_HEAD_BYTES:  # a head still arriving
            self._close_with(431, f"request head larger than {MAX_HEAD_BYTES} bytes")

    # ------------------------------------------------------------------------- the parser's calls

    def on_message_begin(self) -> None:
        self._started = time.perf_counter()
        self._arm(self._port.limits.read_timeout, self._timed_out)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        name = name.lower()
        if name == b"content-type":
            self._content_type = value
        elif name == b"authorization":
            self._authorization = value
        elif name == b"content-length":  # llhttp refuses one that is not digits, or two
            self._content_length = int(value) if value.strip().isdigit() else None
        elif name == b"expect":
            self._expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self._headers_done = True
        verdict = self._route()
        if verdict is not None:
            self._verdict = verdict
            if self._expect_continue:  # the client waits before sending a body we do not want
                self._send(verdict, keep_alive=False)
                raise _Refused
            return
        limits = self._port.limits
        if self._content_length is not None and self._content_length > limits.max_body_bytes:
            self._refuse(413, f"body larger than {limits.max_body_bytes} bytes")
        if self._port.receiving >= limits.max_concurrent:
            self._refuse(429, f"{limits.max_concurrent} requests in progress; retry shortly")
        self._port.receiving += 1
        self._holds_slot = True
        if self._expect_continue:
            self._write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._port.limits.max_body_bytes:
            self._refuse(413, f"body larger than {self._port.limits.max_body_bytes} bytes")
        if self._verdict is None:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._release_slot()
        reply = self._verdict or self._reply()
        keep_alive = self._parser.should_keep_alive()
        self._send(reply, keep_alive=keep_alive)
        if not keep_alive:
            raise _Refused
        self._new_request()
        self._arm(self._port.limits.idle_timeout, self.close)

    # ------------------------------------------------------------------------- answering

    def _route(self) -> Reply | None:
        """The refusal of a request whose head is all there is to judge, or None."""
        port = self._port
        try:
            path = httptools.parse_url(self._url).path
        except httptools.HttpParserInvalidURLError:
            return self._refusal(400, "malformed request target")
        self._answer = port.routes.get(path)
        method = self._parser.get_method()
        if self._answer is None:
            return self._refusal(
                404,
                f"Not Found: {method.decode()} {path.decode(errors='replace')} (the router port "
                f"serves POST /v1/score and /v1/routed; the rest is on the main port)",
            )
        if method != b"POST":
            return self._refusal(405, f"Method Not Allowed: {method.decode()} {path.decode()}")
        if not port.authorized(self._authorization):
            return self._refusal(401, "a valid Authorization: Bearer <token> header is required")
        return None

    def _reply(self) -> Reply:
        assert self._answer is not None
        msgpack = is_msgpack(self._content_type.decode("latin-1"))
        try:
            return self._answer(b"".join(self._body), msgpack, self._started)
        except Exception as error:  # a bug: the client gets a 500, the connection lives on
            _failures.warning("answer", "a router-port request failed: %s", error, error=error)
            return self._refusal(500, "internal error")

    def _refusal(self, status: int, message: str) -> Reply:
        self._port.refused(status)
        return error_reply(status, message)

    def _refuse(self, status: int, message: str) -> None:
        """From the parser's calls: answers ``status``, closes, and stops the parser."""
        self._close_with(status, message)
        raise _Refused

    def _close_with(self, status: int, message: str) -> None:
        """Answers ``status`` and closes: the rest of the request is not read."""
        self._send(self._refusal(status, message), keep_alive=False)

    def _send(self, reply: Reply, *, keep_alive: bool) -> None:
        head = [
            _STATUS_LINES[reply.status],
            b"Content-Type: ",
            reply.content_type.encode(),
            b"\r\nContent-Length: ",
            str(len(reply.body)).encode(),
            b"\r\n",
        ]
        if reply.status == 401:
            head.append(b'WWW-Authenticate: Bearer realm="hmakv"\r\n')
        elif reply.status == 405:
            head.append(b"Allow: POST\r\n")
        elif reply.status == 429:
            head.append(b"Retry-After: 1\r\n")
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        elif self._parser.get_http_version() == "1.0":
            head.append(b"Connection: keep-alive\r\n")
        head += (b"\r\n", reply.body)
        self._write(b"".join(head))
        if not keep_alive:
            self._finish()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self._closing:
            self.transport.write(data)

    # ------------------------------------------------------------------------- bounds

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")

    def _timed_out(self) -> None:
        self._close_with(408, f"request not read within {self._port.limits.read_timeout:g} s")

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release_slot(self) -> None:
        if self._holds_slot:
            self._port.receiving -= 1
            self._holds_slot = False

    def _finish(self) -> None:
        """Closes after an answer: half-closes, then reads and drops what the client still
        sends for up to ``LINGER_S``, as a client that is still sending a refused body would have
        its answer lost to the reset that closing on unread input sends."""
        self._closing = True
        self._release_slot()
        assert self.transport is not None
        self.transport.write_eof()
        self.transport.resume_reading()
        self._arm(LINGER_S, self.close)

    def close(self) -> None:
        self._closing = True
        self._disarm()
        self._release_slot()
        if self.transport is not None:
            self.transport.close()
