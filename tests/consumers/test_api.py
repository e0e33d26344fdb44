"""The score API over real HTTP on loopback, on an index filled by applying records directly.

No broker: the follower is not started (so /readyz must say 503), and the records a follower
would apply from Kafka are applied to its index here. The OpenAPI document is checked against
the routes the app really serves and against the bodies it really answers with.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from hmakv.consumers.api import MSGPACK, ApiLimits, HashingDefaults, ScoreApi, build_app
from hmakv.consumers.follower import Follower, FollowerConfig
from hmakv.consumers.metrics import index_registry
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.records import EventRecord, Topics
from hmakv.producer.events import BlockRemoved, BlockStored, ExternalBlockHash, decode
from hmakv.producer.hashing import BlockHasher, PackedTokenIds, block_extra_keys, external

BLOCK = 16
LIMITS = ApiLimits(max_body_bytes=64 * 1024, max_prompt_tokens=2048, max_prompt_blocks=128)
PROMPT = list(range(100, 100 + 8 * BLOCK + 5))  # 8 full blocks and 5 tokens
HASHER = BlockHasher("sha256_cbor", "0")
HASHES: list[ExternalBlockHash] = [
    external(digest) for digest in HASHER.block_hashes(PROMPT, BLOCK)
]
LORA_HASHES: list[ExternalBlockHash] = [
    external(digest)
    for digest in HASHER.block_hashes(
        PROMPT, BLOCK, extra_keys=block_extra_keys(8, BLOCK, lora_name="adapter")
    )
]


def stored(
    hashes: list[ExternalBlockHash], group: int, *, window: int | None = None, medium: str = "GPU"
) -> Any:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=BLOCK,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind="sliding_window" if window else "full_attention",
        kv_cache_spec_sliding_window=window,
    )


def fill(follower: Follower) -> None:
    """Three workers with groups full (0) and sliding window 32 (1), two blocks of window.

    - ``full``: the whole prompt in both groups: a hit of all 8 blocks.
    - ``evicted``: all 8 full-attention blocks, but window blocks 4..7 evicted: vLLM can only
      hit 4 blocks (it needs the two window blocks before the hit); a group-blind index says 8.
    - ``lora``: the prompt cached under a LoRA adapter's hashes, degraded.
    """
    index = follower.index
    for worker, hashes in (("full", HASHES), ("evicted", HASHES), ("lora", LORA_HASHES)):
        index.apply(EventRecord(worker, 0, 0, 0.0, 0, [stored(hashes, 0)]))
        index.apply(EventRecord(worker, 0, 0, 0.0, 1, [stored(hashes, 1, window=32)]))
    index.apply(EventRecord("evicted", 0, 1, 0.0, 1, [BlockRemoved(HASHES[4:], "GPU", 1)]))
    index.set_health("lora", "degraded")


@asynccontextmanager
async def serving(filled: Callable[[Follower], None]) -> AsyncIterator[TestClient[Any, Any]]:
    follower = Follower(FollowerConfig("127.0.0.1:1", Topics("unused"), hash_block_size=BLOCK))
    filled(follower)
    stats = ScoreStats()
    api = ScoreApi(
        follower, index_registry(follower, stats), stats, hashing=HashingDefaults(), limits=LIMITS
    )
    async with TestClient(TestServer(build_app(api))) as test_client:
        yield test_client


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async with serving(fill) as test_client:
        yield test_client


async def post_score(client: TestClient[Any, Any], body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post("/v1/score", data=data)
    return response.status, await response.json()


def by_worker(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {hit["worker"]: hit for hit in answer["workers"]}


def packed(tokens: list[int]) -> str:
    """``packed_token_ids`` as JSON carries it: base64."""
    return base64.b64encode(PackedTokenIds.pack(tokens).data).decode()


async def post_msgpack(client: TestClient[Any, Any], body: Any) -> tuple[int, Any]:
    """A msgpack request; its answer decoded as the JSON one is (string keys), for comparing."""
    data = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
    response = await client.post("/v1/score", data=data, headers={"Content-Type": MSGPACK})
    raw = await response.read()
    if response.content_type == MSGPACK:
        assert response.status == 200
        return response.status, msgspec.to_builtins(msgspec.msgpack.decode(raw), str_keys=True)
    assert response.content_type == "application/json"  # errors are JSON in either form
    return response.status, json.loads(raw)


async def test_token_ids_are_hashed_as_vllm_hashes_them_and_scored_per_group(
    client: TestClient[Any, Any],
) -> None:
    status, answer = await post_score(client, {"token_ids": PROMPT})
    assert status == 200
    hits = by_worker(answer)
    assert hits["full"]["hit_tokens"] == 8 * BLOCK
    assert hits["full"]["groups"] == {"0": 8 * BLOCK, "1": 8 * BLOCK}
    assert hits["evicted"]["hit_tokens"] == 4 * BLOCK
    assert hits["evicted"]["group_blind_hit_tokens"] == 8 * BLOCK
    assert hits["lora"]["hit_tokens"] == 0
    assert answer["best"] == "full"
    assert answer["prompt_blocks"] == 8 and answer["num_tokens"] == len(PROMPT)
    assert [hit["worker"] for hit in answer["workers"]] == ["full", "evicted", "lora"]


@pytest.mark.parametrize(
    ("body", "holder"),
    [
        ({"packed_token_ids": packed(PROMPT)}, "full"),
        ({"packed_token_ids": packed(PROMPT), "lora_name": "adapter"}, "lora"),  # Python's path
    ],
    ids=["packed", "packed-lora"],
)
async def test_packed_token_ids_in_json_and_msgpack_answer_as_token_ids(
    client: TestClient[Any, Any], body: dict[str, Any], holder: str
) -> None:
    plain = {**body, "token_ids": PROMPT}
    del plain["packed_token_ids"]
    status, expected = await post_score(client, plain)
    assert status == 200 and by_worker(expected)[holder]["hit_tokens"] == 8 * BLOCK
    assert await post_score(client, body) == (200, expected)
    binary = {**body, "packed_token_ids": PackedTokenIds.pack(PROMPT).data}  # msgpack bin
    assert await post_msgpack(client, binary) == (200, expected)
    assert await post_msgpack(client, plain) == (200, expected)  # msgpack with a list of ints


async def test_block_hashes_lora_and_worker_filter(client: TestClient[Any, Any]) -> None:
    status, answer = await post_score(client, {"block_hashes": HASHES[:6], "workers": ["evicted"]})
    assert status == 200
    assert list(by_worker(answer)) == ["evicted"]
    assert by_worker(answer)["evicted"]["hit_tokens"] == 4 * BLOCK

    status, answer = await post_score(client, {"token_ids": PROMPT, "lora_name": "adapter"})
    assert status == 200
    lora = by_worker(answer)["lora"]
    assert (lora["hit_tokens"], lora["degraded"], lora["health"]) == (8 * BLOCK, True, "degraded")
    assert answer["best"] is None, "a degraded worker is never the best"

    # A whole digest (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) is its last 8 bytes' int.
    digest = (bytes(24) + int(HASHES[0]).to_bytes(8, "big")).hex()
    status, answer = await post_score(client, {"block_hashes": [digest]})
    assert status == 200 and by_worker(answer)["full"]["hit_tokens"] == BLOCK


async def test_naive_group_blind_answer_is_reported_beside(client: TestClient[Any, Any]) -> None:
    status, answer = await post_score(client, {"token_ids": PROMPT, "workers": ["evicted"]})
    assert status == 200
    assert answer["best"] == "evicted"
    assert answer["group_blind"] == {"best": "evicted", "hit_tokens": 8 * BLOCK}


async def test_without_details_each_worker_gets_its_gpu_hit_and_nothing_else(
    client: TestClient[Any, Any],
) -> None:
    _, full = await post_score(client, {"token_ids": PROMPT})
    status, lean = await post_score(client, {"token_ids": PROMPT, "details": False})
    assert status == 200
    assert lean["best"] == full["best"] and lean["group_blind"] is None
    assert [w["worker"] for w in lean["workers"]] == [w["worker"] for w in full["workers"]]
    detailed = by_worker(full)
    for worker, hit in by_worker(lean).items():
        assert (hit["hit_tokens"], hit["hit_blocks"]) == (
            detailed[worker]["hit_tokens"],
            detailed[worker]["hit_blocks"],
        )
        assert hit["groups"] == {} and hit["tiers"] == {} and hit["group_blind_hit_tokens"] == 0
    # Only answers with both the HMA-aware and the group-blind best are compared in /metrics.
    assert await routing_counters(client) == (8 * BLOCK, 8 * BLOCK, 1)


async def test_top_answers_the_best_workers_a_router_may_be_sent_to(
    client: TestClient[Any, Any],
) -> None:
    _, full = await post_score(client, {"token_ids": PROMPT})
    assert [w["worker"] for w in full["workers"]] == ["full", "evicted", "lora"]
    for details in (True, False):
        cases = ((1, ["full"]), (2, ["full", "evicted"]), (3, ["full", "evicted"]))
        for top, workers in (*cases, (2**63, ["full", "evicted"])):
            status, answer = await post_score(
                client, {"token_ids": PROMPT, "top": top, "details": details}
            )
            assert status == 200
            # "lora" is degraded: a router may not be sent there, so top leaves it out.
            assert [w["worker"] for w in answer["workers"]] == workers
            assert answer["workers"] == full["workers"][: len(workers)] or not details
            assert answer["best"] == "full"
    # Only answers over the whole fleet are compared in /metrics: top's is HMA's own pick.
    assert await routing_counters(client) == (8 * BLOCK, 8 * BLOCK, 1)
    status, refused = await post_score(client, {"token_ids": PROMPT, "top": 0})
    assert status == 400 and "top" in refused["error"]


async def routing_counters(client: TestClient[Any, Any]) -> tuple[float, float, float]:
    """(HMA-aware hit tokens, group-blind hit tokens, best differs) from /metrics."""
    response = await client.get("/metrics")
    assert response.status == 200
    text = await response.text()
    lint = subprocess.run(
        [shutil.which("promtool") or "promtool", "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
    found = {
        (sample.name, sample.labels.get("answer")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return (
        found[("hmakv_index_score_hit_tokens_total", "hma")],
        found[("hmakv_index_score_hit_tokens_total", "group_blind")],
        found[("hmakv_index_score_best_differs_total", None)],
    )


async def test_score_requests_add_each_answers_best_hit_and_count_disagreements(
    client: TestClient[Any, Any],
) -> None:
    assert await routing_counters(client) == (0, 0, 0)  # exported before any request

    # HMA-aware: "full" with 8 blocks. Group-blind: "evicted" and "full" tie at 8 blocks and
    # the tie goes to the first name, "evicted": another worker, so the answers differ.
    status, answer = await post_score(client, {"token_ids": PROMPT})
    assert status == 200
    assert (answer["best"], answer["group_blind"]["best"]) == ("full", "evicted")
    assert await routing_counters(client) == (8 * BLOCK, 8 * BLOCK, 1)

    # Only "evicted": both answers name it, HMA-aware with 4 blocks, group-blind with 8.
    status, answer = await post_score(client, {"token_ids": PROMPT, "workers": ["evicted"]})
    assert status == 200
    assert await routing_counters(client) == (12 * BLOCK, 16 * BLOCK, 1)

    # Only the degraded worker: neither answer has a best worker, so both add 0 and agree.
    status, answer = await post_score(client, {"token_ids": PROMPT, "workers": ["lora"]})
    assert status == 200 and answer["best"] is None and answer["group_blind"]["best"] is None
    # A rejected request answers nothing and moves neither counter.
    status, _ = await post_score(client, {"token_ids": []})
    assert status == 400
    assert await routing_counters(client) == (12 * BLOCK, 16 * BLOCK, 1)


BAD_REQUESTS = [
    pytest.param(b"", 400, "empty body", id="empty-body"),
    pytest.param(b"{not json", 400, "invalid JSON", id="not-json"),
    pytest.param(b"[1, 2]", 400, "Expected `object`", id="not-an-object"),
    pytest.param({}, 400, "exactly one of", id="empty-object"),
    pytest.param({"token_ids": []}, 400, "token_ids is empty", id="no-tokens"),
    pytest.param({"block_hashes": []}, 400, "block_hashes is empty", id="no-hashes"),
    pytest.param({"token_ids": [1, "2"]}, 400, "$.token_ids[1]", id="wrong-type"),
    pytest.param({"token_ids": [-1]}, 400, ">= 0", id="negative-token"),
    pytest.param({"token_ids": [1], "prompt": "x"}, 400, "unknown field `prompt`", id="unknown"),
    pytest.param({"token_ids": [1], "block_hashes": [1]}, 400, "exactly one of", id="both"),
    pytest.param({"token_ids": [1], "num_tokens": 3}, 400, "num_tokens goes", id="num-tokens"),
    pytest.param({"token_ids": [1], "block_size": 32}, 400, "blocks of 16", id="block-size"),
    pytest.param({"token_ids": [1], "hash_fn": "sha256"}, 400, "pickle", id="pickle-hash"),
    pytest.param({"token_ids": [1], "hash_fn": "md5"}, 400, "unknown hash", id="unknown-hash"),
    pytest.param({"block_hashes": [2**64]}, 400, "unsigned 64-bit", id="hash-too-big"),
    pytest.param({"block_hashes": [-1]}, 400, "unsigned 64-bit", id="negative-hash"),
    pytest.param({"block_hashes": ["xyz"]}, 400, "neither an int nor hex", id="bad-hex"),
    pytest.param({"block_hashes": [1], "seed": "1"}, 400, "go with token_ids", id="seed-hashes"),
    pytest.param({"block_hashes": [1, 2], "num_tokens": 17}, 400, "shorter", id="short"),
    pytest.param(
        {"token_ids": [1] * 32, "extra_keys": [["a"]], "lora_name": "x"},
        400,
        "extra_keys",
        id="extra-keys-and-lora",
    ),
    pytest.param({"token_ids": [1] * 32, "extra_keys": [["a"]]}, 400, "extra_keys", id="few-keys"),
    pytest.param({"packed_token_ids": ""}, 400, "packed_token_ids is empty", id="no-packed"),
    pytest.param({"packed_token_ids": "AAAAAAA="}, 400, "4 bytes each: 5", id="packed-odd"),
    pytest.param({"packed_token_ids": "not base64!"}, 400, "base64", id="packed-not-base64"),
    pytest.param({"packed_token_ids": [1]}, 400, "Expected `bytes", id="packed-list"),
    pytest.param(
        {"packed_token_ids": packed([1]), "token_ids": [1]}, 400, "exactly one of", id="both-ids"
    ),
    pytest.param({"token_ids": [1] * 2049}, 413, "at most 2048", id="too-many-tokens"),
    pytest.param(
        {"packed_token_ids": packed([1] * 2049)}, 413, "at most 2048", id="too-many-packed"
    ),
    pytest.param({"block_hashes": [1] * 129}, 413, "at most 128", id="too-many-blocks"),
    pytest.param(b" " * (64 * 1024 + 1), 413, "larger than 65536", id="body-too-large"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_REQUESTS)
async def test_bad_requests_get_a_4xx_and_a_json_error_that_says_why(
    client: TestClient[Any, Any], body: Any, status: int, message: str
) -> None:
    got_status, answer = await post_score(client, body)
    assert got_status == status
    assert list(answer) == ["error"]
    assert message in answer["error"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        pytest.param(b"", 400, "expected a msgpack map", id="empty-body"),
        pytest.param(b"\xc1", 400, "invalid msgpack", id="not-msgpack"),
        pytest.param([1, 2], 400, "Expected `object`", id="not-a-map"),
        pytest.param({"packed_token_ids": b"\x01\x00"}, 400, "4 bytes each: 2", id="packed-odd"),
        pytest.param({"block_hashes": [2**64 - 1, 1]}, 200, "", id="uint64-hashes"),
    ],
)
async def test_msgpack_requests_are_checked_as_json_ones(
    client: TestClient[Any, Any], body: Any, status: int, message: str
) -> None:
    got_status, answer = await post_msgpack(client, body)
    assert got_status == status
    if status != 200:
        assert list(answer) == ["error"] and message in answer["error"]


async def test_a_body_that_does_not_decompress_is_a_json_400(client: TestClient[Any, Any]) -> None:
    response = await client.post(
        "/v1/score", data=b"not gzip at all", headers={"Content-Encoding": "gzip"}
    )
    assert response.status == 400
    assert "unreadable body" in (await response.json())["error"]


async def test_unknown_paths_and_methods_answer_json_errors(client: TestClient[Any, Any]) -> None:
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/score", 405)):
        response = await client.request(method, path)
        assert response.status == status
        assert list(await response.json()) == ["error"]


async def test_workers_health_and_readiness(client: TestClient[Any, Any]) -> None:
    response = await client.get("/v1/workers")
    workers = {view["worker"]: view for view in (await response.json())["workers"]}
    assert workers["evicted"]["resident_blocks"] == {"0": {"GPU": 8}, "1": {"GPU": 4}}
    assert workers["evicted"]["last_seq"] == {"0": 0, "1": 1}
    assert workers["evicted"]["groups"]["1"] == {
        "kind": "sliding_window",
        "block_size": 16,
        "sliding_window": 32,
        "chunk_size": None,
    }
    assert workers["lora"]["health"] == "degraded"
    assert (await client.get("/healthz")).status == 200
    response = await client.get("/readyz")
    assert response.status == 503, "a follower that never started is not ready"
    assert (await response.json())["ready"] is False


# ----------------------------------------------------------------------------- OpenAPI


async def openapi(client: TestClient[Any, Any]) -> dict[str, Any]:
    response = await client.get("/openapi.json")
    assert response.status == 200
    document: dict[str, Any] = await response.json()
    return document


async def test_openapi_document_lists_exactly_the_routes_the_app_serves(
    client: TestClient[Any, Any],
) -> None:
    document = await openapi(client)
    assert document["openapi"].startswith("3.")
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in client.app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    documented = {(method, path) for path, item in document["paths"].items() for method in item}
    assert served == documented
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    limits = document["components"]["schemas"]["ScoreRequest"]["properties"]["token_ids"]
    assert {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 2048} in (
        limits["anyOf"]
    )


def validate(document: dict[str, Any], path: str, method: str, status: int, body: Any) -> None:
    """The body must match the schema the document gives for this route and status."""
    response = document["paths"][path][method]["responses"][str(status)]
    schema = response["content"]["application/json"]["schema"]
    jsonschema.validate(body, {**schema, "components": document["components"]})


async def test_answers_match_the_documented_schemas(client: TestClient[Any, Any]) -> None:
    document = await openapi(client)
    status, answer = await post_score(client, {"token_ids": PROMPT})
    validate(document, "/v1/score", "post", status, answer)
    status, answer = await post_score(client, {"token_ids": [1] * 2049})
    validate(document, "/v1/score", "post", status, answer)
    status, answer = await post_score(client, {"token_ids": "x"})
    validate(document, "/v1/score", "post", status, answer)
    for path in ("/v1/workers", "/healthz", "/readyz", "/openapi.json"):
        response = await client.get(path)
        validate(document, path, "get", response.status, await response.json())
    # The schemas are not vacuous: a wrong body fails them.
    with pytest.raises(jsonschema.ValidationError):
        validate(document, "/v1/score", "post", 200, {"best": 1})
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    response = await client.get("/metrics")
    assert response.content_type in metrics


# ----------------------------------------------------------------------------- lookahead hashing

DATA = Path(__file__).parents[1] / "data"
WIRE_VECTORS = [json.loads(line) for line in (DATA / "vllm-wire.jsonl").read_text().splitlines()]
HASH_VECTORS = {
    case["case"]: case
    for case in map(json.loads, (DATA / "vllm-hash-sha256_cbor.jsonl").read_text().splitlines())
}
# vLLM 0.33.0's own hashes of tokens 0..48 with one lookahead token (EAGLE), and its own store of
# the first two of them (tests/data/README.md).
LOOKAHEAD_CASE = HASH_VECTORS["v033-seed0-lookahead1-bs16"]
EAGLE_STORE = next(
    v for v in WIRE_VECTORS if v["vllm"] == "0.33.0" and v["case"] == "lookahead-store-with-session"
)


def fill_lookahead(follower: Follower) -> None:
    """``eagle`` holds vLLM 0.33.0's lookahead-hashed blocks 0..1 of the prompt; ``classic``
    holds all three blocks of the same prompt hashed the classic way."""
    events = decode(bytes.fromhex(EAGLE_STORE["payload_hex"])).batch.events
    follower.index.apply(EventRecord("eagle", 0, 0, 0.0, 0, events))
    classic = HASHER.block_hashes(LOOKAHEAD_CASE["token_ids"], BLOCK)
    follower.index.apply(
        EventRecord("classic", 0, 0, 0.0, 0, [stored(list(map(external, classic)), 0)])
    )


async def test_a_lookahead_workers_blocks_are_found_from_the_prompts_token_ids() -> None:
    assert EAGLE_STORE["expected"]["events"][0]["lookahead_token_ids"] == [[16], [32]]
    async with serving(fill_lookahead) as test_client:
        status, answer = await post_score(test_client, {"token_ids": LOOKAHEAD_CASE["token_ids"]})
        assert status == 200
        hits = by_worker(answer)
        assert (hits["eagle"]["hit_tokens"], hits["eagle"]["hash_lookahead"]) == (2 * BLOCK, 1)
        assert (hits["classic"]["hit_tokens"], hits["classic"]["hash_lookahead"]) == (3 * BLOCK, 0)
        assert answer["best"] == "classic"
        assert answer["prompt_blocks"] == 3

        # Given hashes are taken as they are: these are the eagle's, which the classic lacks.
        status, answer = await post_score(
            test_client, {"block_hashes": LOOKAHEAD_CASE["external_ints"]}
        )
        hits = by_worker(answer)
        assert (hits["eagle"]["hit_tokens"], hits["classic"]["hit_tokens"]) == (2 * BLOCK, 0)
        assert hits["eagle"]["hash_lookahead"] == 1

        response = await test_client.get("/v1/workers")
        views = {view["worker"]: view for view in (await response.json())["workers"]}
        assert {name: view["hash_lookahead"] for name, view in views.items()} == {
            "classic": 0,
            "eagle": 1,
        }


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"token_ids": PROMPT, "block_hashes": None}, 200),
        ({"token_ids": None, "block_hashes": HASHES[:2]}, 200),
        ({"token_ids": None, "block_hashes": None}, 400),
        ({"token_ids": PROMPT, "block_hashes": HASHES[:2]}, 400),
        ({"packed_token_ids": packed(PROMPT), "token_ids": None}, 200),
        ({"packed_token_ids": packed(PROMPT), "block_hashes": HASHES[:2]}, 400),
    ],
    ids=[
        "tokens-and-null-hashes",
        "null-tokens-and-hashes",
        "both-null",
        "both",
        "packed-and-null-tokens",
        "packed-and-hashes",
    ],
)
async def test_the_document_says_which_prompts_the_server_takes(
    client: TestClient[Any, Any], body: dict[str, Any], status: int
) -> None:
    """A null prompt field is as absent, for the server and its document alike (schemathesis
    found the document refusing ``"block_hashes": null`` beside token_ids, which gets 200)."""
    document = await openapi(client)
    request = {"$ref": "#/components/schemas/ScoreRequest", "components": document["components"]}
    assert jsonschema.Draft202012Validator(request).is_valid(body) == (status == 200)
    got, _ = await post_score(client, body)
    assert got == status
