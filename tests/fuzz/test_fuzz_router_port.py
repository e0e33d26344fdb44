"""The router port's own HTTP handling on raw bytes: valid requests of every shape it takes
(JSON and msgpack, chunked, pipelined, ``Expect: 100-continue``, HTTP/1.0, refused ones), their
byte-level mutations, and noise, each on a connection of its own over a real socket, half-closed
once sent.

Whatever arrives: nothing escapes the protocol (asyncio would log the error and drop the
connection), no 500, every answer is well-formed HTTP/1.1 that a parser reads to its end, every
refusal is a JSON error with a status the port documents, no body slot stays held, and the port
answers a valid request afterwards. Schemathesis (``test_fuzz_api.py``) covers what is inside a
well-formed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httptools
import msgspec
import pytest
from fuzz_kit import byte_mutations, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from hmakv.consumers.api import MSGPACK, ApiLimits, ScoreApi
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.router_port import RouterPort
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.records import Topics

TOKEN = "fuzz-token"
LIMITS = ApiLimits(max_body_bytes=4096, max_prompt_tokens=256, max_concurrent=4, read_timeout=2.0)
REFUSALS = {400, 401, 404, 405, 408, 413, 429, 431}
AUTH = f"Authorization: Bearer {TOKEN}\r\n"
SCORE = json.dumps({"token_ids": list(range(40))}).encode()
PACKED = msgspec.msgpack.encode({"packed_token_ids": bytes(64), "details": False})


def post(
    body: bytes, *, headers: str = AUTH, path: str = "/v1/score", version: str = "1.1"
) -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: x\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def chunked(body: bytes) -> bytes:
    half = len(body) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]))
    head = f"POST /v1/score HTTP/1.1\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n"
    return head.encode() + chunks + b"0\r\n\r\n"


TEMPLATES = [
    post(SCORE),
    post(PACKED, headers=AUTH + f"Content-Type: {MSGPACK}\r\n"),
    chunked(SCORE),
    post(SCORE) + post(b"[]") + post(SCORE),
    post(SCORE, headers=AUTH + "Expect: 100-continue\r\n"),
    post(SCORE, headers=AUTH + "Connection: keep-alive\r\n", version="1.0"),
    post(json.dumps({"worker": "w", "token_ids": [1] * 20}).encode(), path="/v1/routed"),
    post(SCORE, headers=""),
    b"GET /v1/score HTTP/1.1\r\nHost: x\r\n\r\n",
    post(b" " * 5000),
]
requests = st.one_of(
    st.sampled_from(TEMPLATES),
    st.sampled_from(TEMPLATES).flatmap(byte_mutations),
    st.binary(max_size=512),
)


@pytest.fixture(scope="module")
def port() -> Iterator[RouterPort]:
    """The router port over an empty index, on its own loop in a thread."""
    follower = Follower(FollowerConfig("127.0.0.1:1", Topics("fuzz"), hash_block_size=16))
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats, limits=LIMITS)
    loop = asyncio.new_event_loop()
    router = RouterPort(api, token=TOKEN)
    loop.run_until_complete(router.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, name="router-port", daemon=True)
    thread.start()
    try:
        yield router
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(router.stop())
        loop.close()


def exchange(address: tuple[str, int], raw: bytes) -> bytes:
    """``raw`` sent and the sending side closed; everything the port answers until it closes."""
    with socket.create_connection(address, timeout=10) as client:
        client.sendall(raw)
        client.shutdown(socket.SHUT_WR)
        received = []
        while data := client.recv(65536):
            received.append(data)
    return b"".join(received)


class Answers:
    """httptools' response parser's calls, collected: each response's status, headers, body."""

    def __init__(self) -> None:
        self.done: list[tuple[int, dict[bytes, bytes], bytes]] = []
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []

    def read(self, data: bytes) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(data)


def check_answers(data: bytes) -> list[int]:
    answers = Answers()
    answers.read(data)  # raises on anything but well-formed responses
    statuses = []
    for status, headers, body in answers.done:
        if status == 100:
            continue
        statuses.append(status)
        if status == 200:
            assert headers[b"content-type"] in (b"application/json", MSGPACK.encode())
            continue
        assert status in REFUSALS, (status, body)
        assert headers[b"content-type"] == b"application/json"
        assert isinstance(json.loads(body)["error"], str)
    return statuses


class Errors(logging.Handler):
    """The port's errors: asyncio logs what escapes a protocol (or a timer's callback) naming
    it. Other tests' leftovers (a task destroyed pending, collected now) are not the port's."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.name.startswith("hmakv.consumers.router_port") or "router_port" in message:
            self.messages.append(message)


@pytest.fixture(scope="module")
def errors() -> Iterator[Errors]:
    handler = Errors()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)


def released(port: RouterPort) -> bool:
    """No body slot held once the port has seen the connection go (it may lag the client)."""
    deadline = time.monotonic() + 5
    while port.receiving and time.monotonic() < deadline:
        time.sleep(0.005)
    return port.receiving == 0


@fuzz_settings(300)
@given(raw=requests)
def test_any_bytes_get_well_formed_answers_and_leave_nothing_held(
    port: RouterPort, errors: Errors, raw: bytes
) -> None:
    check_answers(exchange(port.address, raw))
    assert not errors.messages
    assert released(port)
    assert check_answers(exchange(port.address, post(SCORE))) == [200]
