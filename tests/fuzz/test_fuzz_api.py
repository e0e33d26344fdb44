"""Schemathesis against the score API (and the router port serving its prompt endpoints), from the
OpenAPI document the live server serves: requests generated from each operation's schema, valid
ones and ones the schema forbids, and every answer checked against the same document. No 5xx;
every status is one the document lists for the operation, with its content type and a body its
schema accepts; what the schema forbids is refused with a 4xx. A bounded number of cases per
mode (``HMAKV_FUZZ_EXAMPLES`` for more).

The server is the index's app (``build_app``, bearer token on) served by ``kvlog.web.serve`` on
a free port, on its own event loop in a thread (schemathesis calls it with ``requests``). The
follower is not started, so no Kafka: its index is filled with workers as the log would fill it
(records and worker states through the follower's own applier, as if read from Kafka).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis: in the dev extras")

import requests  # noqa: E402  (schemathesis brings it)
from fuzz_kit import fuzz_settings  # noqa: E402
from hypothesis import given, reject  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from hmakv.consumers.api import MSGPACK, ApiLimits, ScoreApi, build_app  # noqa: E402
from hmakv.consumers.follower import Follower, FollowerConfig  # noqa: E402
from hmakv.consumers.metrics import index_registry  # noqa: E402
from hmakv.consumers.router_port import RouterPort  # noqa: E402
from hmakv.consumers.stats import ScoreStats  # noqa: E402
from hmakv.kafka.process import free_port  # noqa: E402
from hmakv.kvlog import records  # noqa: E402
from hmakv.kvlog.records import (  # noqa: E402
    EventRecord,
    Health,
    Topics,
    WorkerState,
    event_key,
)
from hmakv.kvlog.web import serve  # noqa: E402
from hmakv.producer.events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    GroupSpec,
)
from hmakv.producer.hashing import BlockHasher, external  # noqa: E402

TOKEN = "fuzz-token"
BLOCK = 16
# Small limits, so that generated requests meet them (413) as often as they keep to them.
LIMITS = ApiLimits(
    max_body_bytes=64 * 1024, max_prompt_tokens=512, max_prompt_blocks=32, max_worker_filter=8
)
PROMPT = list(range(8 * BLOCK + 3))
HASHES: list[ExternalBlockHash] = [
    external(d) for d in BlockHasher("sha256_cbor", "0").block_hashes(PROMPT, BLOCK)
]
LOOKAHEAD: list[ExternalBlockHash] = [
    external(d) for d in BlockHasher("sha256_cbor", "0").block_hashes(PROMPT, BLOCK, lookahead=1)
]
FULL = GroupSpec("full_attention", BLOCK)
WINDOW = GroupSpec("sliding_window", BLOCK, sliding_window=32)


def no_server_error(ctx: Any, response: Any, case: Any) -> None:
    """No 5xx but the 503 the document gives ``/readyz`` (not caught up with the log, as a
    follower never started is not): schemathesis' ``not_a_server_error`` refuses that one too."""
    if response.status_code >= 500 and (case.path, response.status_code) != ("/readyz", 503):
        raise AssertionError(f"{case.method} {case.path}: {response.status_code} {response.text}")


def to_msgpack(ctx: Any, value: Any) -> bytes:
    """The prompt endpoints' other request form (schemathesis knows JSON, not msgpack). An int
    beyond 64 bits has no msgpack form: that case cannot be sent so, and is dropped."""
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:
        reject()


def from_msgpack(ctx: Any, response: Any) -> Any:
    """As JSON reads it, for the document's schemas: maps keyed by group index have int keys in
    msgpack, string keys in JSON."""
    return msgspec.to_builtins(msgspec.msgpack.decode(response.content), str_keys=True)


schemathesis.serializer(MSGPACK)(to_msgpack)
schemathesis.deserializer(MSGPACK)(from_msgpack)


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def store(
    hashes: list[ExternalBlockHash], group: int, spec: GroupSpec, **fields: Any
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=spec.block_size,
        lora_id=None,
        medium=fields.pop("medium", "GPU"),
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
        **fields,
    )


def filled_follower() -> Follower:
    """Workers of every kind an answer distinguishes: a full hit, a window evicted, a CPU tier,
    lookahead hashing, degraded, and one the bridge says is far ahead (stale)."""
    follower = Follower(
        FollowerConfig("127.0.0.1:1", Topics("fuzz"), hash_block_size=BLOCK, mode="replica")
    )
    applier = follower._applier  # what the follower does with each record it reads from Kafka
    catalog = {0: FULL, 1: WINDOW}
    lookahead = [[PROMPT[(i + 1) * BLOCK]] for i in range(len(LOOKAHEAD))]
    stores: dict[str, list[EventRecord]] = {
        "full": [
            EventRecord("full", 0, 0, 1.0, g, [store(HASHES, g, s)]) for g, s in catalog.items()
        ],
        "evicted": [
            EventRecord("evicted", 0, 0, 1.0, 0, [store(HASHES, 0, FULL)]),
            EventRecord(
                "evicted",
                0,
                1,
                2.0,
                1,
                [store(HASHES, 1, WINDOW), BlockRemoved(HASHES[4:], "GPU", 1)],
            ),
        ],
        "cpu": [EventRecord("cpu", 0, 0, 1.0, 0, [store(HASHES, 0, FULL, medium="CPU")])],
        "eagle": [
            EventRecord(
                "eagle", 0, 0, 1.0, 0, [store(LOOKAHEAD, 0, FULL, lookahead_token_ids=lookahead)]
            )
        ],
        "degraded": [EventRecord("degraded", 0, 0, 1.0, 0, [store(HASHES[:2], 0, FULL)])],
        "behind": [EventRecord("behind", 0, 3, 1.0, 0, [store(HASHES, 0, FULL)])],
    }
    for worker, worker_records in stores.items():
        for record in worker_records:
            applier.apply_event(event_key(worker, record.group_idx), records.encode(record), 0)
        health: Health = "degraded" if worker == "degraded" else "live"
        last_seq = 500 if worker == "behind" else 1
        state = WorkerState(worker, 0, last_seq, health, catalog, 2.0, endpoint="tcp://e:5557")
        applier.apply_worker_state(state.key(), records.encode(state), replayed=True)
    return follower


@pytest.fixture(scope="module")
def live_api() -> Iterator[dict[str, str]]:
    """The app and the router port over one API on real sockets, on their own loop in a
    thread; their base URLs."""
    follower = filled_follower()
    stats = ScoreStats()
    api = ScoreApi(follower, index_registry(follower, stats), stats, limits=LIMITS)
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = loop.run_until_complete(serve(build_app(api, token=TOKEN), "127.0.0.1", port))
    router = RouterPort(api, token=TOKEN)
    loop.run_until_complete(router.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, name="score-api", daemon=True)
    thread.start()
    host, router_port = router.address
    try:
        yield {"main": f"http://127.0.0.1:{port}", "router": f"http://{host}:{router_port}"}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(router.stop())
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as opened:
        opened.headers["Authorization"] = f"Bearer {TOKEN}"
        yield opened


# Each operation with its examples: the score call has a body to vary, the others little or
# nothing (a request without parameters has no invalid form).
# The router port (``--router-listen``) serves the prompt endpoints by the same document.
OPERATIONS = [
    ("main", "POST /v1/score", GenerationMode.POSITIVE, 200),
    ("main", "POST /v1/score", GenerationMode.NEGATIVE, 200),
    ("router", "POST /v1/score", GenerationMode.POSITIVE, 100),
    ("router", "POST /v1/score", GenerationMode.NEGATIVE, 100),
    ("router", "POST /v1/routed", GenerationMode.POSITIVE, 50),
    ("main", "GET /v1/workers", GenerationMode.POSITIVE, 5),
    ("main", "GET /healthz", GenerationMode.POSITIVE, 5),
    ("main", "GET /readyz", GenerationMode.POSITIVE, 5),
    ("main", "GET /metrics", GenerationMode.POSITIVE, 5),
    ("main", "GET /openapi.json", GenerationMode.POSITIVE, 5),
]
# What refuses a request the schema forbids: 400, or 413 where it is too large (maxItems, the
# limits the document states), as documented.
CONFIG = schemathesis.Config.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": ["400", "413"]}}}
)


@pytest.mark.parametrize(
    ("server", "label", "mode", "examples"),
    OPERATIONS,
    ids=[f"{server}-{label}-{mode.value}" for server, label, mode, _ in OPERATIONS],
)
def test_every_answer_conforms_to_the_served_document(
    live_api: dict[str, str],
    session: requests.Session,
    server: str,
    label: str,
    mode: GenerationMode,
    examples: int,
) -> None:
    # The document as the server serves it (``from_url`` would leave out the operation that
    # serves it: here it is fuzzed like the others).
    document = session.get(f"{live_api['main']}/openapi.json", timeout=10).json()
    base_url = live_api[server]
    schema = schemathesis.openapi.from_dict(document, config=CONFIG)
    [operation] = [
        result.ok() for result in schema.get_all_operations() if result.ok().label == label
    ]
    negative = mode is GenerationMode.NEGATIVE
    checks = [*CHECKS, negative_data_rejection] if negative else CHECKS
    statuses: set[int] = set()
    media_types: set[str | None] = set()

    @fuzz_settings(examples)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        response = case.call_and_validate(base_url=base_url, session=session, checks=checks)
        statuses.add(response.status_code)
        media_types.add(case.media_type)

    fuzz()
    if label == "POST /v1/score":  # valid cases got answers, and invalid ones their 400
        assert statuses <= {400, 413} if negative else statuses >= {200, 400}, statuses
        assert 400 in statuses
        assert media_types == {"application/json", MSGPACK}
