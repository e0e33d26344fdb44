"""``POST /v1/routed`` over real HTTP on loopback: a routed prompt's blocks count in the next
score's speculative hit and best, not in the confirmed figures, until its TTL passes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from test_api import BLOCK, HASHES, LIMITS, PROMPT, by_worker, fill

from hmakv.consumers.api import MSGPACK, ScoreApi, build_app
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.speculation import DEFAULT_CEILING_S, DEFAULT_TTL_S
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.records import Topics
from hmakv.producer.events import GroupSpec
from hmakv.producer.hashing import PackedTokenIds

TOKEN = "routed-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def client(clock: Clock) -> AsyncIterator[TestClient[Any, Any]]:
    """``fill``'s workers and an idle one, ``fresh``, with the same catalog and nothing held."""
    config = FollowerConfig("127.0.0.1:1", Topics("unused"), hash_block_size=BLOCK)
    follower = Follower(config, clock=clock)
    fill(follower)
    follower.index.set_catalog("fresh", follower.index.workers()[0].groups)
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats, limits=LIMITS)
    async with TestClient(TestServer(build_app(api, token=TOKEN))) as test_client:
        yield test_client


async def post(client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, Any]:
    response = await client.post(path, json=body, headers=AUTH)
    return response.status, await response.json()


async def test_a_routed_prompt_makes_its_worker_the_speculative_best_until_it_expires(
    client: TestClient[Any, Any], clock: Clock
) -> None:
    follow_up = [*PROMPT, 7, 7, 7]
    status, answer = await post(client, "/v1/score", {"token_ids": follow_up, "workers": ["fresh"]})
    assert status == 200 and answer["best"] is None
    status, routed = await post(client, "/v1/routed", {"worker": "fresh", "token_ids": PROMPT})
    assert status == 200
    # 8 full blocks in the full-attention group and 8 in the window group.
    assert routed == {"worker": "fresh", "speculated_blocks": 16, "expires_in_s": DEFAULT_TTL_S}
    status, answer = await post(client, "/v1/score", {"token_ids": follow_up, "workers": ["fresh"]})
    fresh = by_worker(answer)["fresh"]
    assert (fresh["hit_tokens"], fresh["speculative_hit_tokens"]) == (0, 8 * BLOCK)
    assert fresh["groups"] == {"0": 0, "1": 0} and fresh["group_blind_hit_tokens"] == 0
    assert fresh["speculative_score"] == 8 * BLOCK and answer["best"] == "fresh"
    listing = await (await client.get("/v1/workers", headers=AUTH)).json()
    views = {view["worker"]: view for view in listing["workers"]}
    assert views["fresh"]["speculative_blocks"] == 16 and views["fresh"]["resident_blocks"] == {}
    clock.now += DEFAULT_TTL_S
    status, answer = await post(client, "/v1/score", {"token_ids": follow_up, "workers": ["fresh"]})
    assert by_worker(answer)["fresh"]["speculative_hit_tokens"] == 0 and answer["best"] is None


async def test_a_msgpack_routed_prompt_with_packed_ids_is_answered_in_msgpack(
    client: TestClient[Any, Any],
) -> None:
    body = {"worker": "fresh", "packed_token_ids": PackedTokenIds.pack(PROMPT).data}
    headers = {**AUTH, "Content-Type": MSGPACK}
    response = await client.post("/v1/routed", data=msgspec.msgpack.encode(body), headers=headers)
    assert (response.status, response.content_type) == (200, MSGPACK)
    routed = msgspec.msgpack.decode(await response.read())
    assert routed == {"worker": "fresh", "speculated_blocks": 16, "expires_in_s": DEFAULT_TTL_S}


async def test_block_hashes_and_a_ttl_capped_at_the_ceiling(client: TestClient[Any, Any]) -> None:
    body = {"worker": "fresh", "block_hashes": HASHES[:4], "num_tokens": 4 * BLOCK, "ttl_s": 1e6}
    status, routed = await post(client, "/v1/routed", body)
    assert status == 200 and routed["expires_in_s"] == DEFAULT_CEILING_S
    assert routed["speculated_blocks"] == 8
    status, answer = await post(client, "/v1/score", {"token_ids": PROMPT})
    assert by_worker(answer)["fresh"]["speculative_hit_tokens"] == 4 * BLOCK


async def test_routing_holds_again_what_the_worker_lost(client: TestClient[Any, Any]) -> None:
    """A routed prompt is computed again where its blocks were evicted: its window blocks count
    speculatively, its confirmed hit stays what the events say."""
    await post(client, "/v1/routed", {"worker": "evicted", "token_ids": PROMPT})
    status, answer = await post(client, "/v1/score", {"token_ids": PROMPT})
    evicted = by_worker(answer)["evicted"]
    assert status == 200
    # Window blocks 4..7, removed for real before routing, are held speculatively again.
    assert (evicted["hit_tokens"], evicted["speculative_hit_tokens"]) == (4 * BLOCK, 8 * BLOCK)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        pytest.param({"worker": "nobody", "token_ids": PROMPT}, 404, "unknown worker", id="404"),
        pytest.param({"token_ids": PROMPT}, 400, "missing required field `worker`", id="no-w"),
        pytest.param({"worker": "fresh"}, 400, "exactly one of", id="no-prompt"),
        pytest.param({"worker": "fresh", "token_ids": [1], "ttl_s": 0}, 400, "> 0", id="ttl"),
        pytest.param({"worker": "fresh", "token_ids": [1], "workers": []}, 400, "unknown", id="w"),
        pytest.param({"worker": "fresh", "token_ids": [1] * 2049}, 413, "at most", id="tokens"),
        pytest.param({"worker": "fresh", "block_hashes": [1] * 129}, 413, "at most", id="blocks"),
    ],
)
async def test_bad_routed_requests_are_json_errors(
    client: TestClient[Any, Any], body: dict[str, Any], status: int, says: str
) -> None:
    got, answer = await post(client, "/v1/routed", body)
    assert got == status and says in answer["error"], answer
    views = (await (await client.get("/v1/workers", headers=AUTH)).json())["workers"]
    assert [view["worker"] for view in views] == ["evicted", "fresh", "full", "lora"]
    assert all(view["speculative_blocks"] == 0 for view in views)


async def test_a_body_past_the_limit_is_413(client: TestClient[Any, Any]) -> None:
    body = b'{"worker": "fresh", "token_ids": [' + b"1, " * LIMITS.max_body_bytes + b"1]}"
    response = await client.post("/v1/routed", data=body, headers=AUTH)
    assert response.status == 413 and "error" in await response.json()


async def test_routed_wants_the_bearer_token(client: TestClient[Any, Any]) -> None:
    response = await client.post("/v1/routed", json={"worker": "fresh", "token_ids": PROMPT})
    assert response.status == 401 and "Bearer" in (await response.json())["error"]


async def test_the_document_describes_routed_and_its_answers(client: TestClient[Any, Any]) -> None:
    document = await (await client.get("/openapi.json")).json()
    operation = document["paths"]["/v1/routed"]["post"]
    assert set(operation["responses"]) == {"200", "400", "401", "404", "408", "413", "429"}
    request = document["components"]["schemas"]["RoutedRequest"]
    assert request["required"] == ["worker"] and "oneOf" in request
    assert request["additionalProperties"] is False
    validator = jsonschema.Draft202012Validator({**request, "components": document["components"]})
    assert validator.is_valid({"worker": "fresh", "token_ids": [1]})
    assert not validator.is_valid({"worker": "fresh", "token_ids": [1], "block_hashes": [1]})
    status, routed = await post(client, "/v1/routed", {"worker": "fresh", "token_ids": PROMPT})
    assert status == 200
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.validate(routed, {**schema, "components": document["components"]})
    status, answer = await post(client, "/v1/score", {"token_ids": PROMPT})
    assert status == 200
    score = document["paths"]["/v1/score"]["post"]["responses"]["200"]["content"]
    score_schema = score["application/json"]["schema"]
    jsonschema.validate(answer, {**score_schema, "components": document["components"]})


async def test_speculation_metrics(client: TestClient[Any, Any], clock: Clock) -> None:
    await post(client, "/v1/routed", {"worker": "fresh", "token_ids": PROMPT})
    await post(client, "/v1/routed", {"worker": "nobody", "token_ids": PROMPT})
    found = await scrape(client)
    assert found[("hmakv_index_speculative_blocks", "fresh")] == 16
    assert found[("hmakv_index_speculative_blocks_outcomes_total", "speculated")] == 16
    assert found[("hmakv_index_routed_requests_total", "ok")] == 1
    assert found[("hmakv_index_routed_requests_total", "unknown_worker")] == 1
    assert found[("hmakv_index_speculative_ttl_seconds", "")] == DEFAULT_TTL_S
    assert found[("hmakv_index_reserved_medium_blocks_total", "")] == 0
    clock.now += DEFAULT_TTL_S
    await post(client, "/v1/score", {"token_ids": PROMPT})
    found = await scrape(client)
    assert found[("hmakv_index_speculative_blocks_outcomes_total", "expired")] == 16
    assert ("hmakv_index_speculative_blocks", "fresh") not in found


async def scrape(client: TestClient[Any, Any]) -> dict[tuple[str, str], float]:
    text = await (await client.get("/metrics")).text()
    return {
        (sample.name, sample.labels.get("outcome") or sample.labels.get("worker") or ""): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize(("chunk", "states"), [(None, [8]), (2 * BLOCK, [2, 4, 6, 8])])
async def test_the_engines_prefill_chunk_adds_the_mamba_states_where_chunks_stop(
    clock: Clock, chunk: int | None, states: list[int]
) -> None:
    """``--speculative-prefill-chunk`` reaches the index: a mamba group (block 16, as the hash
    block) gets a state wherever a lone prefill of the prompt stops a chunk (blocks 2, 4, 6) as
    well as at its last full block (8); a follow-up that branches after block 5 then hits 4."""
    config = FollowerConfig(
        "127.0.0.1:1",
        Topics("unused"),
        hash_block_size=BLOCK,
        speculative_prefill_chunk_tokens=chunk,
    )
    follower = Follower(config, clock=clock)
    mamba = {
        0: GroupSpec(kind="full_attention", block_size=BLOCK),
        1: GroupSpec(kind="mamba", block_size=BLOCK),
    }
    follower.index.set_catalog("hybrid", mamba)
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats, limits=LIMITS)
    async with TestClient(TestServer(build_app(api, token=TOKEN))) as client:
        status, routed = await post(client, "/v1/routed", {"worker": "hybrid", "token_ids": PROMPT})
        assert status == 200 and routed["speculated_blocks"] == 8 + len(states)
        branch = [*PROMPT[: 5 * BLOCK + 3], 1, 2, 3]
        status, answer = await post(client, "/v1/score", {"token_ids": branch})
        expected = 4 * BLOCK if chunk else 0
        assert by_worker(answer)["hybrid"]["speculative_hit_tokens"] == expected
