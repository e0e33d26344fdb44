"""The score API against callers it must not trust: no token, a flood, requests its own
document should have refused (issue 16). A real aiohttp server on a real socket."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from aiohttp.test_utils import TestClient, TestServer

from hmakv.consumers.api import ApiLimits, ScoreApi, build_app
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.stats import ScoreStats
from hmakv.kafka.process import free_port
from hmakv.kvlog.records import Topics
from hmakv.kvlog.web import serve

TOKEN = "s3cret-token"
SCORE = {"token_ids": list(range(64))}


def score_api(limits: ApiLimits) -> ScoreApi:
    follower = Follower(FollowerConfig("127.0.0.1:1", Topics("unused"), hash_block_size=16))
    stats = ScoreStats()
    return ScoreApi(follower, index_registry(follower, stats), stats, limits=limits)


@pytest.fixture
async def guarded() -> AsyncIterator[TestClient[Any, Any]]:
    app = build_app(score_api(ApiLimits(max_concurrent=1)), token=TOKEN)
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_score_and_workers_want_the_bearer_token(guarded: TestClient[Any, Any]) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = await guarded.post("/v1/score", json=SCORE, headers=headers)
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert "Bearer" in (await response.json())["error"]
        assert (await guarded.get("/v1/workers", headers=headers)).status == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert (await guarded.post("/v1/score", json=SCORE, headers=good)).status == 200
    assert (await guarded.get("/v1/workers", headers=good)).status == 200


async def test_probes_and_scrapers_need_no_token(guarded: TestClient[Any, Any]) -> None:
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert (await guarded.get(path)).status == 200, path
    assert (await guarded.get("/readyz")).status in (200, 503)  # not followed: not ready


async def hold_the_slot(
    server: Any, token: str = TOKEN
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request with headers and half a body: it holds a slot while its body is awaited."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(
        b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        + f"Authorization: Bearer {token}\r\n\r\n".encode()
        + b'{"token_ids": ['
    )
    await writer.drain()
    await asyncio.sleep(0.2)
    return reader, writer


async def test_a_request_beyond_the_concurrency_limit_gets_429_at_once_but_probes_do_not(
    guarded: TestClient[Any, Any],
) -> None:
    _, writer = await hold_the_slot(guarded.server)
    response = await guarded.get("/openapi.json")
    assert response.status == 429 and response.headers["Retry-After"] == "1"
    assert "in progress" in (await response.json())["error"]
    # a liveness probe refused under load would have a busy index restarted
    for path in ("/healthz", "/metrics"):
        assert (await guarded.get(path)).status == 200, path
    assert (await guarded.get("/readyz")).status == 503  # not followed: not ready, but answered
    writer.close()
    await writer.wait_closed()
    for _ in range(50):  # the slot comes back once the held request ends
        if (await guarded.get("/openapi.json")).status == 200:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the slot of the abandoned request never came back")


async def test_a_body_that_never_arrives_gets_408_and_frees_its_slot() -> None:
    app = build_app(score_api(ApiLimits(max_concurrent=1, read_timeout=0.5)), token=TOKEN)
    async with TestClient(TestServer(app)) as client:
        reader, writer = await hold_the_slot(client.server)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 408"), head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert b"not read within 0.5 s" in await reader.readexactly(length)
        assert (await client.get("/openapi.json")).status == 200  # its slot is back
        writer.close()


async def test_idle_and_half_sent_connections_are_closed_and_bad_requests_log_once() -> None:
    """aiohttp kept both for an hour and logged a traceback per malformed request (issue 16)."""
    port = free_port()
    runner = await serve(build_app(score_api(ApiLimits())), "127.0.0.1", port, idle_timeout=0.5)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("aiohttp.server").addHandler(handler)
    try:
        idle_reader, _ = await asyncio.open_connection("127.0.0.1", port)
        half_reader, half = await asyncio.open_connection("127.0.0.1", port)
        half.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers never end
        for reader in (idle_reader, half_reader):
            assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed by the server
        for _ in range(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 5.0)).startswith(b"HTTP/1.0 400")
            writer.close()
    finally:
        logging.getLogger("aiohttp.server").removeHandler(handler)
        await runner.cleanup()
    assert 1 <= len(records) <= 2, [r.getMessage() for r in records]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",  # broken header
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS hello: not HTTP
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line too long
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"b" * 9000 + b"\r\n\r\n",  # a header too long
    ],
    ids=["broken-header", "not-http", "long-line", "long-header"],
)
async def test_what_the_parser_refuses_is_answered_with_the_json_error_body(
    request_bytes: bytes,
) -> None:
    """aiohttp answers these in plain text before any middleware runs (issue 16)."""
    port = free_port()
    runner = await serve(build_app(score_api(ApiLimits())), "127.0.0.1", port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes)
        head, _, body = (await asyncio.wait_for(reader.read(), 5.0)).partition(b"\r\n\r\n")
        writer.close()
    finally:
        await runner.cleanup()
    assert head.split(b" ")[1] in (b"400", b"431"), head
    assert b"Content-Type: application/json" in head, head
    assert json.loads(body)["error"], body


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        ({"token_ids": [1, 2]}, True),
        ({"block_hashes": [1, "ab"]}, True),
        ({}, False),
        ({"token_ids": [1], "block_hashes": [1]}, False),
        ({"token_ids": [1], "hash_fn": ""}, False),
        ({"token_ids": [1], "hash_fn": "md5"}, False),
        ({"token_ids": [1], "hash_fn": "xxhash_cbor"}, True),
    ],
)
async def test_the_document_refuses_what_the_server_refuses(
    body: dict[str, Any], valid: bool
) -> None:
    async with TestClient(TestServer(build_app(score_api(ApiLimits())))) as client:
        document = await (await client.get("/openapi.json")).json()
        status = (await client.post("/v1/score", data=json.dumps(body))).status
    schema = {"$ref": "#/components/schemas/ScoreRequest", "components": document["components"]}
    accepted = jsonschema.Draft202012Validator(schema).is_valid(body)
    assert accepted is valid
    assert (status == 200) is valid
