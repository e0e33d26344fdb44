"""The router port over real sockets on loopback: the main port's answers, and its bounds.

The same requests go to the aiohttp app and to the router port, each over a follower filled the
same way (``test_api.fill``, no broker), and must get the same bytes back. The bounds are driven
with raw bytes on a socket, because a well-behaved client cannot send what they refuse.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_api import BLOCK, HASHES, LIMITS, PROMPT, fill

from hmakv.consumers.api import MSGPACK, ApiLimits, ScoreApi, build_app
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.router_port import MAX_HEAD_BYTES, RouterPort
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.records import Topics
from hmakv.producer.hashing import PackedTokenIds

TOKEN = "router-token"
CHUNKED = "Transfer-Encoding: chunked\r\n"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"
FAST = ApiLimits(
    max_body_bytes=LIMITS.max_body_bytes,
    max_prompt_tokens=LIMITS.max_prompt_tokens,
    max_prompt_blocks=LIMITS.max_prompt_blocks,
    max_concurrent=1,
    idle_timeout=0.3,
    read_timeout=0.3,
)

Answer = tuple[int, dict[str, str], bytes]


def filled_api(limits: ApiLimits = LIMITS) -> ScoreApi:
    follower = Follower(FollowerConfig("127.0.0.1:1", Topics("unused"), hash_block_size=BLOCK))
    fill(follower)
    stats = ScoreStats()
    return ScoreApi(follower, index_registry(follower, stats), stats, limits=limits)


@asynccontextmanager
async def router_port(
    limits: ApiLimits = LIMITS, token: str | None = TOKEN
) -> AsyncIterator[RouterPort]:
    port = RouterPort(filled_api(limits), token=token)
    await port.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await port.stop()


async def connect(port: RouterPort) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*port.address)


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One response: status, headers (lower-case names), body by its Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def request(
    body: bytes, *, path: str = "/v1/score", headers: str = AUTH, method: str = "POST"
) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 2) == b""


async def send_refused(
    port: RouterPort, raw: bytes
) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    """``raw`` on a new connection, whose answer must be a JSON error."""
    reader, writer = await connect(port)
    writer.write(raw)
    status, headers, body = await read_answer(reader)
    assert headers["content-type"] == "application/json" and "error" in json.loads(body)
    return status, headers, reader, writer


async def eventually(condition: Callable[[], bool]) -> None:
    """What the port does once a client's close reaches it."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the port did not get there in 2 s")


def refused(port: RouterPort) -> dict[int, int]:
    return dict(port.stats.router_port_refused)


# ----------------------------------------------------------------------------- the answers

CASES = [
    ("/v1/score", "application/json", json.dumps({"token_ids": PROMPT}).encode()),
    (
        "/v1/score",
        MSGPACK,
        msgspec.msgpack.encode(
            {"packed_token_ids": PackedTokenIds.pack(PROMPT).data, "details": False}
        ),
    ),
    ("/v1/score", "application/json", json.dumps({"block_hashes": HASHES[:6]}).encode()),
    ("/v1/score", "application/json", b'{"token_ids": "not a list"}'),
    ("/v1/score", MSGPACK, b"\xc1"),
    ("/v1/score", "application/json", b""),
    (
        "/v1/routed",
        "application/json",
        json.dumps({"worker": "full", "token_ids": PROMPT}).encode(),
    ),
    ("/v1/routed", "application/json", json.dumps({"worker": "nobody", "token_ids": [1]}).encode()),
]


async def test_the_router_port_answers_as_the_main_port_does() -> None:
    main = TestServer(build_app(filled_api(), token=TOKEN))
    await main.start_server()
    try:
        async with router_port() as port, aiohttp.ClientSession() as session:
            host, number = port.address
            headers = {"Authorization": f"Bearer {TOKEN}"}
            statuses = []
            for path, content_type, body in CASES:
                answers = []
                for base in (str(main.make_url("")), f"http://{host}:{number}"):
                    async with session.post(
                        base + path, data=body, headers={**headers, "Content-Type": content_type}
                    ) as response:
                        answers.append(
                            (response.status, response.content_type, await response.read())
                        )
                assert answers[0] == answers[1], (path, body[:40])
                statuses.append(answers[0][0])
            assert statuses == [200, 200, 200, 400, 400, 400, 200, 404]
    finally:
        await main.close()


async def test_answers_on_one_connection_pipelined_or_not_come_in_order() -> None:
    async with router_port() as port:
        reader, writer = await connect(port)
        score = request(json.dumps({"token_ids": PROMPT}).encode())
        bad = request(b"[]")
        writer.write(score + bad + score)  # pipelined: one write
        answers = [await read_answer(reader) for _ in range(3)]
        assert [status for status, *_ in answers] == [200, 400, 200]
        assert json.loads(answers[0][2])["best"] == "full"
        assert answers[0][2] == answers[2][2]
        writer.write(score)  # and after a pause, on the same connection
        assert (await read_answer(reader))[0] == 200
        writer.close()


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (request(b"{}", headers=""), 401),
        (request(b"{}", headers="Authorization: Bearer wrong\r\n"), 401),
        (request(b"{}", path="/healthz"), 404),
        (request(b"{}", path="/v1/workers"), 404),
        (request(b"", method="GET"), 405),
    ],
    ids=["no-token", "wrong-token", "health-elsewhere", "workers-elsewhere", "get"],
)
async def test_a_refused_complete_request_is_a_json_error_and_the_connection_stays(
    raw: bytes, status: int
) -> None:
    async with router_port() as port:
        got, headers, reader, writer = await send_refused(port, raw)
        assert got == status
        if status == 401:
            assert headers["www-authenticate"] == 'Bearer realm="hmakv"'
        if status == 405:
            assert headers["allow"] == "POST"
        writer.write(request(json.dumps({"token_ids": PROMPT}).encode()))
        assert (await read_answer(reader))[0] == 200
        assert refused(port) == {status: 1}
        writer.close()


async def test_without_a_token_configured_none_is_asked_for() -> None:
    async with router_port(token=None) as port:
        reader, writer = await connect(port)
        writer.write(request(json.dumps({"token_ids": PROMPT}).encode(), headers=""))
        assert (await read_answer(reader))[0] == 200
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (
            f"POST /v1/score HTTP/1.1\r\n{AUTH}Content-Length: {LIMITS.max_body_bytes + 1}"
            "\r\n\r\n".encode(),
            413,
        ),
        (
            f"POST /v1/score HTTP/1.1\r\n{AUTH}{CHUNKED}\r\n".encode()
            + (b"8000\r\n" + b" " * 0x8000 + b"\r\n") * 3,
            413,
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (f"POST /v1/score HTTP/1.1\r\nX: {'a' * MAX_HEAD_BYTES}\r\n\r\n".encode(), 431),
        (f"POST /v1/score HTTP/1.1\r\nX: {'a' * MAX_HEAD_BYTES}".encode(), 431),  # unfinished
        (f"POST /{'a' * MAX_HEAD_BYTES} HTTP/1.1\r\n\r\n".encode(), 431),
    ],
    ids=["length", "chunks", "not-http", "head", "head-unfinished", "url"],
)
async def test_a_request_refused_before_its_end_is_answered_and_the_connection_closed(
    raw: bytes, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    async with router_port() as port:
        got, headers, reader, _ = await send_refused(port, raw)
        assert (got, headers["connection"]) == (status, "close")
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not [error for error in errors if "router_port" in error]  # asyncio names it
        assert await closed(reader)
        assert refused(port) == {status: 1}
        assert port.receiving == 0


async def test_a_chunked_body_within_the_limit_is_read() -> None:
    async with router_port() as port:
        reader, writer = await connect(port)
        body = json.dumps({"token_ids": PROMPT}).encode()
        half = len(body) // 2
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:])
        )
        writer.write(
            f"POST /v1/score HTTP/1.1\r\n{AUTH}{CHUNKED}\r\n".encode() + chunks + b"0\r\n\r\n"
        )
        status, _, answer = await read_answer(reader)
        assert status == 200 and json.loads(answer)["best"] == "full"
        writer.close()


async def test_a_slow_request_is_408_and_an_idle_connection_is_closed() -> None:
    async with router_port(FAST) as port:
        reader, writer = await connect(port)
        writer.write(request(b'{"token_ids": [1, 2, 3]}')[:-5])  # the body's end never comes
        status, headers, _ = await read_answer(reader)
        assert (status, headers["connection"]) == (408, "close")
        assert await closed(reader)
        writer.close()

        reader, writer = await connect(port)  # says nothing at all
        assert await closed(reader)
        writer.close()

        reader, writer = await connect(port)  # one answer, then nothing
        writer.write(request(json.dumps({"token_ids": PROMPT}).encode()))
        assert (await read_answer(reader))[0] == 200
        assert await closed(reader)
        writer.close()
        assert refused(port) == {408: 1}
        await eventually(lambda: port.stats.router_port_connections == 0)


async def test_a_client_still_sending_a_refused_body_reads_its_answer() -> None:
    """Closing a socket with unread input resets it, which can cost the client the answer it
    was sent: the port half-closes and drains the rest first."""
    async with router_port() as port:
        for _ in range(20):
            reader, writer = await connect(port)
            writer.write(f"POST /v1/score HTTP/1.1\r\n{AUTH}{CHUNKED}\r\n".encode())
            chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
            for _ in range(16):  # 1 MiB against a 64 KiB limit, still arriving after the 413
                writer.write(chunk)
                await writer.drain()
            status, headers, _ = await read_answer(reader)
            assert (status, headers["connection"]) == (413, "close")
            assert await closed(reader)
            writer.close()
        await eventually(lambda: port.stats.router_port_connections == 0)


async def test_bodies_past_max_concurrent_get_429_and_the_slot_comes_back() -> None:
    async with router_port(FAST) as port:
        holder_reader, holder = await connect(port)
        body = json.dumps({"token_ids": PROMPT}).encode()
        raw = request(body)
        holder.write(raw[:-10])  # holds the one slot while the rest of its body is awaited
        await eventually(lambda: port.receiving == 1)
        reader, writer = await connect(port)
        writer.write(raw)
        status, headers, _ = await read_answer(reader)
        assert (status, headers["retry-after"], headers["connection"]) == (429, "1", "close")
        holder.write(raw[-10:])
        assert (await read_answer(holder_reader))[0] == 200
        reader, writer = await connect(port)
        writer.write(raw)
        assert (await read_answer(reader))[0] == 200
        assert refused(port) == {429: 1}


async def test_expect_100_continue_is_answered_before_the_body_and_refused_without_it() -> None:
    async with router_port() as port:
        reader, writer = await connect(port)
        body = json.dumps({"token_ids": PROMPT}).encode()
        head = f"POST /v1/score HTTP/1.1\r\n{AUTH}Expect: 100-continue\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await read_answer(reader))[0] == 200

        reader, writer = await connect(port)
        writer.write(
            b"POST /v1/score HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 9\r\n\r\n"
        )
        status, headers, _ = await read_answer(reader)  # no 100 first: the token is missing
        assert (status, headers["connection"]) == (401, "close")
        assert await closed(reader)


async def test_http_1_0_closes_unless_kept_alive() -> None:
    async with router_port() as port:
        body = json.dumps({"token_ids": PROMPT}).encode()
        reader, writer = await connect(port)
        writer.write(request(body).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        status, headers, _ = await read_answer(reader)
        assert (status, headers["connection"]) == (200, "close")
        assert await closed(reader)

        reader, writer = await connect(port)
        kept = request(body, headers=AUTH + "Connection: keep-alive\r\n")
        writer.write(kept.replace(b"HTTP/1.1", b"HTTP/1.0", 1) * 2)
        for _ in range(2):
            status, headers, _ = await read_answer(reader)
            assert (status, headers["connection"]) == (200, "keep-alive")
        writer.close()


async def test_a_client_that_does_not_read_its_answers_is_not_read_either() -> None:
    """Pipelined requests without reading the answers: the port stops reading once its write
    buffer is full, instead of buffering every answer; all of them still come, in order."""
    async with router_port() as port:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(port.address)
        reader, writer = await asyncio.open_connection(sock=client)
        await asyncio.sleep(0.05)
        (connection,) = port.connections
        transport = connection.transport
        assert transport is not None
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        count = 4000
        # Each request ~1 KiB, each answer ~250 bytes: whatever one read takes in (asyncio reads
        # up to 256 KiB), its answers stay under the buffer's 64 KiB high-water mark again.
        padded = request(b"{}", path="/nowhere", headers=f"X-Pad: {'p' * 900}\r\n")
        writer.write(padded * count)
        await asyncio.sleep(1.0)
        assert not transport.is_reading()
        assert transport.get_write_buffer_size() < 256 * 1024
        statuses = [(await read_answer(reader))[0] for _ in range(count)]
        assert statuses == [404] * count
        writer.close()


async def test_refusals_and_connections_show_in_the_metrics() -> None:
    async with router_port() as port:
        reader, writer = await connect(port)
        writer.write(request(b"{}", headers="") + request(b"", path="/nope"))
        for _ in range(2):
            await read_answer(reader)
        families = {
            family.name: family
            for family in text_string_to_metric_families(
                generate_latest(port.api.registry).decode()
            )
        }
        by_status = {
            sample.labels["status"]: sample.value
            for sample in families["hmakv_index_router_port_refused"].samples
            if sample.name.endswith("_total")
        }
        assert by_status == {"401": 1.0, "404": 1.0}
        (connections,) = families["hmakv_index_router_port_connections"].samples
        assert connections.value == 1
        writer.close()
