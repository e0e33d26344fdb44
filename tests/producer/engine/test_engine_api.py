"""The engine API's HTTP shell against clients that misbehave: half-sent and idle requests,
floods, the parser's own errors, wrong methods.

The engine behind it is a stand-in whose answers never come (a real engine answers too fast to
keep a request in flight); everything else is the real server on a real socket.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import pytest

from hmakv.producer.engine.api import AdmissionResult, ApiLimits, ApiServer, LookupResult

WAIT_S = 10.0


class NeverAnswering:
    """An engine whose futures stay pending: each request holds its slot until it times out."""

    token_id_limit = 1 << 32

    def request(self, token_ids: Sequence[int], max_tokens: int) -> Future[AdmissionResult]:
        return Future()

    def lookup(self, token_ids: Sequence[int]) -> Future[LookupResult]:
        return Future()

    def status(self) -> Future[dict[str, object]]:
        return Future()


@pytest.fixture
def server() -> Iterator[ApiServer]:
    limits = ApiLimits(answer_timeout=3.0, read_timeout=0.5, max_concurrent=1)
    api = ApiServer(("127.0.0.1", 0), NeverAnswering(), limits)
    api.start()
    yield api
    api.close()


def connect(api: ApiServer) -> socket.socket:
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def response(sock: socket.socket) -> tuple[int, dict[str, str], dict[str, object]]:
    """Status, headers and JSON body of the one response on ``sock`` (the server closes it)."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(body)


def test_a_body_shorter_than_its_length_is_answered_408_and_frees_the_thread(
    server: ApiServer,
) -> None:
    with connect(server) as sock:
        sock.sendall(b'POST /v1/lookup HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"token')
        started = time.monotonic()
        status, headers, body = response(sock)
    assert status == 408 and "not sent within 0.5 s" in str(body["error"])
    assert headers["Content-Type"] == "application/json"
    assert time.monotonic() - started < WAIT_S


def test_an_idle_connection_is_closed_after_the_read_timeout(server: ApiServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /v1/st")  # half a request line, then nothing
        assert sock.recv(65536) == b""  # closed by the server, not by our timeout


def test_requests_beyond_the_concurrency_limit_get_429_with_retry_after(
    server: ApiServer,
) -> None:
    body = b'{"token_ids": [1, 2, 3]}'
    request = b"POST /v1/lookup HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with connect(server) as holding:
        holding.sendall(request)  # waits on an engine that never answers: holds the one slot
        time.sleep(0.2)
        with connect(server) as refused:
            refused.sendall(b"GET /v1/status HTTP/1.1\r\n\r\n")
            status, headers, document = response(refused)
        assert status == 429 and headers["Retry-After"] == "1"
        assert "too many requests" in str(document["error"])
        assert response(holding)[0] == 503  # the engine did not answer within 3 s


def test_the_parsers_own_errors_are_json(server: ApiServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /v1/status HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n")
        status, headers, document = response(sock)
    assert status == 431 and headers["Content-Type"] == "application/json"
    assert document["error"]


def test_a_wrong_method_gets_405_with_allow(server: ApiServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"DELETE /v1/requests HTTP/1.1\r\n\r\n")
        status, headers, document = response(sock)
    assert status == 405 and headers["Allow"] == "POST"
    assert document == {"error": "use POST /v1/requests"}


def test_broken_connections_log_one_line_per_interval_with_the_count(
    server: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client can break connections at will: each once logged its own line."""
    caplog.set_level("INFO", logger="hmakv.producer.engine.api")
    hook = server._server.handle_error  # what socketserver calls for a failed connection
    for _ in range(50):
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionResetError:
            hook(None, ("10.0.0.9", 40000))
    lines = [r.getMessage() for r in caplog.records if "connection from" in r.getMessage()]
    assert lines == [
        "engine API: connection from 10.0.0.9 failed: ConnectionResetError('reset by peer')"
    ]
