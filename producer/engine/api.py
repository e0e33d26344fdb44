"""The reference engine's HTTP API: ground truth for what a prefix hit really is, over JSON.

A consumer index is only as good as its agreement with the engine, so the API answers exactly
the questions a check needs:

- ``POST /v1/requests`` ``{"token_ids": [...], "max_tokens": 16}`` serves a request and answers
  once it is admitted: ``{"request_id", "num_cached_tokens", "num_prompt_tokens", "seq"}``, the
  hit the engine really granted and the last seq published after the admission step (which
  carries the blocks the request stored).
- ``POST /v1/lookup`` ``{"token_ids": [...]}`` answers ``{"num_cached_tokens",
  "num_prompt_tokens", "seq"}``: the hit a request would get right now, admitting nothing, and
  the last published seq at that moment; an index that has applied every batch up to ``seq``
  must predict the same hit.
- ``GET /v1/status``: last published seq, steps, blocks used and cached per group, the profile
  and its group catalog, the hash function and seed (what a router needs to recompute hashes).

Malformed input gets ``400 {"error": "..."}`` naming the field (the HTTP parser's own errors
too are JSON); an engine that stops or does not answer in time gets ``503``. Token ids are checked
against the model's vocabulary, or 2^32 without a model, before anything reaches the scheduler:
an id the wire cannot carry would make the engine's next batch unencodable. The server is a
``ThreadingHTTPServer``: its threads only validate and wait on futures that the engine thread
resolves, never touching engine state. A client gets ``read_timeout`` seconds for each read (an
idle or half-sent request is answered 408 and closed, so it cannot hold a thread), and at most
``max_concurrent`` requests are served at once; the rest get ``429`` with ``Retry-After``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_LIMIT = 1 << 16
MAX_BODY_BYTES = 16 << 20
"""A million token ids as JSON fit; a bigger body is refused unread."""
ANSWER_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 10.0
MAX_CONCURRENT = 16
TOKEN_ID_LIMIT = 1 << 32
"""Without a model, token ids are bounded as vLLM's are on the wire (vocabularies fit 32 bits)."""


class EngineStopped(RuntimeError):
    """The engine stopped before it could answer."""


class RequestRejected(ValueError):
    """The engine refused a request (it can never fit the KV cache)."""


@dataclass(frozen=True)
class AdmissionResult:
    request_id: str
    num_cached_tokens: int
    num_prompt_tokens: int
    seq: int


@dataclass(frozen=True)
class LookupResult:
    num_cached_tokens: int
    num_prompt_tokens: int
    seq: int


class EngineQueries(Protocol):
    """What the API asks of the engine; each answer is a future the engine thread resolves."""

    @property
    def token_id_limit(self) -> int: ...

    def request(self, token_ids: Sequence[int], max_tokens: int) -> Future[AdmissionResult]: ...

    def lookup(self, token_ids: Sequence[int]) -> Future[LookupResult]: ...

    def status(self) -> Future[dict[str, object]]: ...


class BadRequest(ValueError):
    """Input the API refuses with 400; the message says what is wrong."""


class _SlowClient(Exception):
    """The client stopped sending in the middle of its request (408)."""


def parse_token_ids(body: dict[str, Any], limit: int) -> list[int]:
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise BadRequest("token_ids must be a non-empty list of integers")
    for index, token in enumerate(token_ids):
        # bool is an int subclass; true is not a token id.
        if type(token) is not int or not 0 <= token < limit:
            shown = repr(token)
            if len(shown) > 40:
                shown = f"{shown[:40]}..."
            bound = f"an integer in 0..{limit - 1}"
            raise BadRequest(f"token_ids[{index}] is {shown}, expected {bound}")
    return token_ids


def parse_max_tokens(body: dict[str, Any]) -> int:
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadRequest(
            f"max_tokens is {max_tokens!r}, expected an integer in 1..{MAX_TOKENS_LIMIT}"
        )
    return max_tokens


def parse_body(raw: bytes, allowed: frozenset[str]) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the body is not JSON this API reads: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise BadRequest(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    return body


_REQUEST_FIELDS = frozenset({"token_ids", "max_tokens"})
_LOOKUP_FIELDS = frozenset({"token_ids"})
_ROUTES = {"/v1/requests": "POST", "/v1/lookup": "POST", "/v1/status": "GET"}
_ERROR_LOG_INTERVAL_S = 10.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler waiting on a stopped engine must not hold up exit

    def __init__(self, address: tuple[str, int], engine: EngineQueries, limits: ApiLimits) -> None:
        super().__init__(address, _Handler)
        self.engine = engine
        self.read_timeout = limits.read_timeout
        self.answer_timeout = limits.answer_timeout
        self.slots = threading.BoundedSemaphore(limits.max_concurrent)
        self._errors = threading.Lock()
        self._logged_at = -_ERROR_LOG_INTERVAL_S
        self._held = 0

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """One line, not a traceback, and at most one per ``_ERROR_LOG_INTERVAL_S`` saying how
        many it held back: a client can break connections at will."""
        error = sys.exc_info()[1]
        now = time.monotonic()
        with self._errors:
            if now - self._logged_at < _ERROR_LOG_INTERVAL_S:
                self._held += 1
                return
            self._logged_at, held, self._held = now, self._held, 0
        more = f" ({held} more in the last {_ERROR_LOG_INTERVAL_S:g} s)" if held else ""
        logger.info("engine API: connection from %s failed: %r%s", client_address[0], error, more)


@dataclass(frozen=True)
class ApiLimits:
    """How long a client may take and wait, and how many are served at once."""

    answer_timeout: float = ANSWER_TIMEOUT_S
    read_timeout: float = READ_TIMEOUT_S
    max_concurrent: int = MAX_CONCURRENT


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout)  # each read, headers included

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The HTTP parser's errors (bad request line, headers too long, ...) as JSON too."""
        self.close_connection = True
        self._reply(HTTPStatus(code), {"error": message or HTTPStatus(code).phrase})

    def _dispatch(self, method: str) -> None:
        expected = _ROUTES.get(self.path)
        if expected is None:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path}"})
            return
        if method != expected:
            error: dict[str, object] = {"error": f"use {expected} {self.path}"}
            self._reply(HTTPStatus.METHOD_NOT_ALLOWED, error, {"Allow": expected})
            return
        if not self.server.slots.acquire(blocking=False):
            busy: dict[str, object] = {"error": "too many requests in progress; retry shortly"}
            self._reply(HTTPStatus.TOO_MANY_REQUESTS, busy, {"Retry-After": "1"})
            return
        try:
            self._serve()
        finally:
            self.server.slots.release()

    def _serve(self) -> None:
        try:
            self._reply(HTTPStatus.OK, self._answer())
        except _SlowClient as error:
            self.close_connection = True
            self._reply(HTTPStatus.REQUEST_TIMEOUT, {"error": str(error)})
        except (BadRequest, RequestRejected) as error:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(error)})
        except EngineStopped as error:
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(error)})
        except FutureTimeout:
            message = f"the engine did not answer within {self.server.answer_timeout:g} s"
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": message})

    def _answer(self) -> dict[str, object]:
        engine = self.server.engine
        if self.path == "/v1/status":
            return self._wait(engine.status())
        if self.path == "/v1/lookup":
            body = parse_body(self._read_body(), _LOOKUP_FIELDS)
            lookup = engine.lookup(parse_token_ids(body, engine.token_id_limit))
            return asdict(self._wait(lookup))
        body = parse_body(self._read_body(), _REQUEST_FIELDS)
        token_ids = parse_token_ids(body, engine.token_id_limit)
        return asdict(self._wait(engine.request(token_ids, parse_max_tokens(body))))

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a Content-Length header is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise BadRequest(f"the body must be at most {MAX_BODY_BYTES} bytes")
        try:
            body = self.rfile.read(length)
        except TimeoutError:  # the socket's: ``read_timeout`` seconds without a byte
            message = f"the request was not sent within {self.server.read_timeout:g} s"
            raise _SlowClient(message) from None
        if len(body) != length:
            self.close_connection = True
            raise BadRequest(f"the body ended after {len(body)} of {length} bytes")
        return body

    def _wait(self, future: Future[T]) -> T:
        return future.result(timeout=self.server.answer_timeout)

    def _reply(
        self, status: HTTPStatus, document: dict[str, object], headers: dict[str, str] | None = None
    ) -> None:
        payload = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)


class ApiServer:
    """The HTTP API on ``address`` (port 0: any free port), served from its own threads."""

    def __init__(
        self,
        address: tuple[str, int],
        engine: EngineQueries,
        limits: ApiLimits = ApiLimits(),
    ) -> None:
        self._server = _Server(address, engine, limits)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="hmakv-engine-api",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
