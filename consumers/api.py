"""The score API and the exporter's endpoint: aiohttp, JSON (or msgpack) through msgspec structs.

One route table (``ROUTES`` built by ``routes``) both registers the handlers and generates the
OpenAPI 3.1 document at ``/openapi.json`` from the same msgspec structs that validate requests
and encode responses, so the document cannot drift from what the server does. The answer's
structs, and the rule that names the best worker, are ``kvlog.answers``: the index builds those
structs and the demo decodes them, so the three share one definition.

A prompt's two endpoints also take msgpack (``Content-Type: application/msgpack``) and answer in
it; with ``packed_token_ids`` (bin in msgpack, base64 in JSON) the index makes no Python int per
token, the largest cost of a long prompt after hashing. Every error, aiohttp's own (404, 405,
413) included, is a JSON body ``{"error": "..."}``. With
an access token configured, ``/v1/score`` and ``/v1/workers`` want ``Authorization: Bearer
<token>`` (compared in constant time; 401 otherwise), while health, readiness, metrics and the
document stay open to probes and scrapers. At most ``max_concurrent`` requests are served at once
(probes aside), the rest answered 429 with ``Retry-After`` at once: a flood must not queue up in
front of the follower's event loop, which applies the log. A body not read within
``read_timeout`` is 408; ``kvlog.web`` closes idle connections and quiets aiohttp's log.

The prompt endpoints' answers are made from the body alone (``score_reply``, ``routed_reply``:
a ``Reply`` of status, bytes and type), so that the router port (``router_port``) sends the
very bytes the aiohttp handlers send.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from hmakv.consumers.follower import Follower
from hmakv.consumers.freshness import Freshness, NotReady, not_ready, record_age
from hmakv.consumers.index import UnknownWorker, WorkerInfo
from hmakv.consumers.stats import ScoreStats
from hmakv.kvlog.answers import (
    ScoreResponse,
    WorkerHit,
    WorkersResponse,
    WorkerView,
    group_blind_answer,
    hma_best,
)
from hmakv.kvlog.web import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONCURRENT, concurrency_gate
from hmakv.producer.events import ExternalBlockHash
from hmakv.producer.hashing import (
    HASH_FUNCTIONS,
    PACKED_TOKEN_BYTES,
    BlockHasher,
    PackedTokenIds,
    TokenIds,
    UnsupportedHashFunction,
    block_extra_keys,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
P = TypeVar("P", bound="Prompt")

_MAX_EXTERNAL_HASH = 2**64 - 1
_HASHER_CACHE_SIZE = 16
MSGPACK = "application/msgpack"
# The names msgpack goes by: its registered one, the de facto one, and the old x- one.
_MSGPACK_TYPES = frozenset({MSGPACK, "application/vnd.msgpack", "application/x-msgpack"})

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class HashingDefaults:
    """How prompts are hashed when a request does not say: must match the engines' settings."""

    hash_fn: str = "sha256_cbor"
    seed: str = "0"

    def __post_init__(self) -> None:  # also when it comes from the environment, unchecked
        if self.hash_fn not in HASH_FUNCTIONS:
            raise ValueError(f"hash function must be one of {HASH_FUNCTIONS}, got {self.hash_fn!r}")


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on one request, so that one caller cannot stall the follower's event loop."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 262_144
    max_prompt_blocks: int = 16_384
    max_worker_filter: int = 4096
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # requests in progress, probes aside
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S  # a connection waiting for its request head
    read_timeout: float = 10.0  # seconds to read a request's body


# ----------------------------------------------------------------------------- wire structs

Doc = msgspec.Meta
TokenId = Annotated[int, Doc(ge=0)]
BlockHashIn = Annotated[
    int | str,
    Doc(description="vLLM's external hash: an unsigned 64-bit int, or the raw digest in hex"),
]
ExtraKey = str | int | list[str | int]


class Prompt(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A prompt: its token ids (hashed here as vLLM hashes them), packed or not, or its block
    hashes."""

    token_ids: list[TokenId] | None = None
    packed_token_ids: Annotated[
        bytes | None,
        Doc(
            description="token_ids as one buffer of little-endian uint32s, 4 bytes a token "
            "(bin in msgpack, base64 in JSON): the fastest form for a long prompt"
        ),
    ] = None
    block_hashes: list[BlockHashIn] | None = None
    num_tokens: Annotated[
        Annotated[int, Doc(ge=1)] | None,
        Doc(description="prompt length with block_hashes (default: one token past them)"),
    ] = None
    hash_fn: Annotated[
        Annotated[str, Doc(min_length=1)] | None, Doc(description="sha256_cbor or xxhash_cbor")
    ] = None
    seed: Annotated[str | None, Doc(description="the engines' PYTHONHASHSEED")] = None
    block_size: Annotated[
        Annotated[int, Doc(ge=1)] | None, Doc(description="must equal the server's hash block size")
    ] = None
    lora_name: Annotated[str | None, Doc(description="LoRA adapter, in every block's keys")] = None
    cache_salt: Annotated[str | None, Doc(description="vLLM's cache_salt, in block 0's keys")] = (
        None
    )
    extra_keys: Annotated[
        list[list[ExtraKey] | None] | None,
        Doc(description="each full block's extra keys as vLLM builds them (or lora_name/salt)"),
    ] = None


class ScoreRequest(Prompt, forbid_unknown_fields=True, kw_only=True):
    """A prompt to score: its token ids (hashed here as vLLM hashes them) or its block hashes."""

    workers: Annotated[
        list[str] | None, Doc(description="score only these (unknown: left out)")
    ] = None
    details: Annotated[
        bool,
        Doc(
            description="false: each worker's GPU hit only (hit_tokens, hit_blocks, and score "
            "as the GPU hit at the GPU's weight), no per-group, tier or group-blind answers: "
            "what a router needs, 2-3x sooner on a large fleet"
        ),
    ] = True
    top: Annotated[
        Annotated[int, Doc(ge=1)] | None,
        Doc(
            description="answer only the best `top` live and current workers (degraded and "
            "stale workers, and those with stale groups, are left out), best first, for a "
            "router choosing among the best: on a wide fleet the answer, and its cost, are "
            "then top's size, not the fleet's. best and group_blind are chosen among them"
        ),
    ] = None


class RoutedRequest(Prompt, forbid_unknown_fields=True, kw_only=True):
    """A prompt a router sent to ``worker``: its blocks count as held there (speculative_hit_tokens
    in /v1/score) until the worker's events confirm or remove them, or the TTL passes."""

    worker: Annotated[str, Doc(min_length=1, description="a worker the index knows")]
    ttl_s: Annotated[
        Annotated[float, Doc(gt=0)] | None,
        Doc(description="seconds to hold them (default: follows the measured event lag; capped)"),
    ] = None


class RoutedResponse(msgspec.Struct, kw_only=True):
    worker: str
    speculated_blocks: Annotated[
        int, Doc(description="blocks newly held speculatively, over every group")
    ]
    expires_in_s: Annotated[float, Doc(description="seconds until they expire, unless settled")]


class Liveness(msgspec.Struct, kw_only=True):
    status: Literal["ok"]


class Readiness(msgspec.Struct, kw_only=True):
    """200 when ``ready``; 503 with the ``reasons`` otherwise."""

    ready: bool
    reasons: Annotated[
        list[NotReady],
        Doc(
            description="why not ready: catching_up (not caught up with the log yet: starting, "
            "restoring, rebalancing or behind it), broker_silent (Kafka has not answered for "
            "longer than --max-broker-silence); empty when ready"
        ),
    ]
    lag_records: int
    broker_silence_s: Annotated[float, Doc(description="seconds since Kafka last answered")]
    stale_workers: Annotated[
        int, Doc(description="workers whose answers may be behind (all while Kafka is silent)")
    ]


class ErrorBody(msgspec.Struct):
    error: str


# ----------------------------------------------------------------------------- route table


@dataclass(frozen=True)
class Route:
    """One endpoint: how it is served and how the OpenAPI document describes it."""

    method: str
    path: str
    handler: Handler
    summary: str
    response: Any
    request: Any = None
    errors: tuple[int, ...] = ()
    extra_statuses: tuple[tuple[int, str], ...] = ()
    content_type: str = "application/json"
    msgpack: bool = False  # also takes a msgpack request, and answers it in msgpack


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer as bytes, for whichever server sends it: the aiohttp app or the router port."""

    status: int
    body: bytes
    content_type: str = "application/json"


_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def _json(body: msgspec.Struct | dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(body), status=status, content_type="application/json")


def _answer(body: msgspec.Struct, msgpack: bool) -> Reply:
    """A prompt's answer in the request's format."""
    if msgpack:
        return Reply(200, _msgpack_encoder.encode(body), MSGPACK)
    return Reply(200, _encoder.encode(body))


def error_reply(status: int, message: str) -> Reply:
    return Reply(status, _encoder.encode(ErrorBody(message)))


def _response(reply: Reply) -> web.Response:
    return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)


def is_msgpack(content_type: str) -> bool:
    """Whether a ``Content-Type`` (parameters and case aside) names msgpack."""
    return content_type.partition(";")[0].strip().lower() in _MSGPACK_TYPES


class _Decoder(Generic[P]):
    """One request struct's decoders, JSON's and msgpack's."""

    def __init__(self, kind: type[P]) -> None:
        self._json = msgspec.json.Decoder(kind)
        self._msgpack = msgspec.msgpack.Decoder(kind)

    def decode(self, body: bytes | _BadRequest, msgpack: bool) -> P:
        """The request in ``body``, or the reason it was not read raised."""
        if isinstance(body, _BadRequest):
            raise body
        if not body:
            raise _BadRequest(400, f"empty body: expected a {'msgpack' if msgpack else 'JSON'} map")
        try:
            return self._msgpack.decode(body) if msgpack else self._json.decode(body)
        except msgspec.ValidationError as exc:
            raise _BadRequest(400, f"invalid request: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise _BadRequest(400, f"invalid {'msgpack' if msgpack else 'JSON'}: {exc}") from exc


def _error(status: int, message: str) -> web.Response:
    return _response(error_reply(status, message))


@functools.lru_cache(maxsize=_HASHER_CACHE_SIZE)
def _hasher(hash_fn: str, seed: str) -> BlockHasher:
    return BlockHasher(hash_fn, seed)


class ScoreApi:
    """The handlers; they read the follower's index at request time (it is replaced on restore)."""

    def __init__(
        self,
        follower: Follower,
        registry: CollectorRegistry,
        stats: ScoreStats,
        *,
        hashing: HashingDefaults = HashingDefaults(),
        limits: ApiLimits = ApiLimits(),
    ) -> None:
        self.follower = follower
        self.registry = registry
        self.stats = stats
        self.hashing = hashing
        self.limits = limits
        self._decoder = _Decoder(ScoreRequest)
        self._routed_decoder = _Decoder(RoutedRequest)

    def routes(self) -> list[Route]:
        return [
            Route(
                "POST",
                "/v1/score",
                self.score,
                "Score a prompt's prefix hit on every worker",
                ScoreResponse,
                request=ScoreRequest,
                errors=(400, 401, 408, 413, 429),
                msgpack=True,
            ),
            Route(
                "POST",
                "/v1/routed",
                self.routed,
                "A prompt was routed to a worker: hold its blocks there speculatively until its "
                "events arrive",
                RoutedResponse,
                request=RoutedRequest,
                errors=(400, 401, 404, 408, 413, 429),
                msgpack=True,
            ),
            Route(
                "GET",
                "/v1/workers",
                self.workers,
                "Every worker: catalog, epoch, health, applied seqs, resident blocks, lag",
                WorkersResponse,
                errors=(401, 429),
            ),
            Route("GET", "/healthz", self.healthz, "The process answers", Liveness),
            Route(
                "GET",
                "/readyz",
                self.readyz,
                "Caught up with the log and hearing from Kafka (503 otherwise, with the reasons)",
                Readiness,
                extra_statuses=((503, "Not caught up, or Kafka silent"),),
            ),
            Route(
                "GET",
                "/metrics",
                self.metrics,
                "Prometheus metrics (text format)",
                str,
                content_type=CONTENT_TYPE_LATEST,
            ),
            Route("GET", "/openapi.json", self.openapi, "This document", dict[str, Any]),
        ]

    # ------------------------------------------------------------------------- handlers

    async def score(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = await self._body(request)
        return _response(self.score_reply(body, is_msgpack(request.content_type), started))

    async def routed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return _response(self.routed_reply(body, is_msgpack(request.content_type)))

    def score_reply(self, body: bytes | _BadRequest, msgpack: bool, started: float) -> Reply:
        """``POST /v1/score``'s answer to a body read since ``started`` (or why it was not)."""
        try:
            response = self._score(self._decoder.decode(body, msgpack))
        except _BadRequest as bad:
            self.stats.record("rejected", time.perf_counter() - started)
            return error_reply(bad.status, str(bad))
        self.stats.record("ok", time.perf_counter() - started)
        return _answer(response, msgpack)

    def routed_reply(self, body: bytes | _BadRequest, msgpack: bool) -> Reply:
        """``POST /v1/routed``'s answer to a body (or to why it was not read)."""
        try:
            routed = self._routed_decoder.decode(body, msgpack)
            hashes, num_tokens = self._prompt(routed, self.follower.index.hash_block_size)
            blocks, ttl = self.follower.speculate(routed.worker, hashes, num_tokens, routed.ttl_s)
        except _BadRequest as bad:
            self.stats.record_routed("rejected")
            return error_reply(bad.status, str(bad))
        except UnknownWorker as unknown:
            self.stats.record_routed("unknown_worker")
            return error_reply(404, f"unknown worker {unknown}: the index makes none up")
        self.stats.record_routed("ok")
        answer = RoutedResponse(worker=routed.worker, speculated_blocks=blocks, expires_in_s=ttl)
        return _answer(answer, msgpack)

    async def _body(self, request: web.Request) -> bytes | _BadRequest:
        """The body, or why it could not be read: the handlers count either."""
        try:
            async with asyncio.timeout(self.limits.read_timeout):
                return await request.read()
        except TimeoutError:  # a body shorter than its Content-Length, or a slow one
            return _BadRequest(408, f"body not read within {self.limits.read_timeout:g} s")
        except web.HTTPRequestEntityTooLarge:
            return _BadRequest(413, f"body larger than {self.limits.max_body_bytes} bytes")
        except web.RequestPayloadError as exc:  # e.g. Content-Encoding: gzip on a body that is not
            return _BadRequest(400, f"unreadable body: {exc}")

    def _score(self, request: ScoreRequest) -> ScoreResponse:
        index = self.follower.index
        hashes, num_tokens = self._prompt(request, index.hash_block_size)
        self.follower.expire_speculation()
        rehash = None
        token_ids = _token_ids(request)
        if token_ids is not None:
            rehash = functools.partial(
                self._lookahead_hashes, request, token_ids, index.hash_block_size
            )
        stale_groups, stale = self.follower.stale_groups_by_worker(), self.follower.stale_workers()
        scores = index.score(
            hashes,
            num_tokens,
            workers=self._worker_filter(request.workers),
            details=request.details,
            lookahead_hashes=rehash,
            top=request.top,
            passed_over=stale | stale_groups.keys() if request.top is not None else (),
        )
        hits = _with_follower_view(scores, stale_groups, stale)
        best = hma_best(hits, ranked=True)  # the follower's view keeps the index's order
        best_worker = best.worker if best is not None else None
        blind = None
        if request.details:  # the HMA and group-blind answers are compared where both exist
            blind = group_blind_answer(hits)
            if request.top is None:  # among the top alone, the comparison would be HMA's pick
                self.stats.record_answer(
                    best.hit_tokens if best is not None else 0, blind, best_worker
                )
        return ScoreResponse(
            best=best_worker,
            hash_block_size=index.hash_block_size,
            num_tokens=num_tokens,
            prompt_blocks=len(hashes),
            workers=hits,
            group_blind=blind,
        )

    def _worker_filter(self, workers: list[str] | None) -> set[str] | None:
        if workers is None:
            return None
        if len(workers) > self.limits.max_worker_filter:
            raise _BadRequest(413, f"more than {self.limits.max_worker_filter} workers to filter")
        return set(workers)

    def _prompt(
        self, request: Prompt, hash_block_size: int
    ) -> tuple[Sequence[ExternalBlockHash], int]:
        """The prompt's block hashes at the index's block size, and its length in tokens."""
        given = (request.token_ids, request.packed_token_ids, request.block_hashes)
        if sum(prompt is not None for prompt in given) != 1:
            raise _BadRequest(
                400, "give exactly one of token_ids, packed_token_ids and block_hashes"
            )
        block_size = request.block_size or hash_block_size
        if block_size != hash_block_size:
            raise _BadRequest(
                400,
                f"block_size {block_size}: this index hashes prompts in blocks of "
                f"{hash_block_size} tokens",
            )
        token_ids = _token_ids(request)
        if token_ids is not None:
            return self._hash_tokens(request, token_ids, block_size)
        return self._given_hashes(request, request.block_hashes or [], block_size)

    def _hash_tokens(
        self, request: Prompt, token_ids: TokenIds, block_size: int
    ) -> tuple[Sequence[ExternalBlockHash], int]:
        if not len(token_ids):
            packed = isinstance(token_ids, PackedTokenIds)
            raise _BadRequest(400, f"{'packed_token_ids' if packed else 'token_ids'} is empty")
        if len(token_ids) > self.limits.max_prompt_tokens:
            raise _BadRequest(
                413, f"{len(token_ids)} tokens: at most {self.limits.max_prompt_tokens}"
            )
        if request.num_tokens is not None:
            raise _BadRequest(
                400, "num_tokens goes with block_hashes; with token ids it is their count"
            )
        try:
            hashes = self._lookahead_hashes(request, token_ids, block_size, 0)
        except (UnsupportedHashFunction, ValueError) as exc:
            raise _BadRequest(400, str(exc)) from exc
        return hashes, len(token_ids)

    def _lookahead_hashes(
        self, request: Prompt, token_ids: TokenIds, block_size: int, lookahead: int
    ) -> Sequence[ExternalBlockHash]:
        """The prompt's hashes as a worker with that lookahead hashing makes them.

        The index asks for each lookahead in the fleet only after the classic hashes (0) were
        made, so nothing can fail here that did not fail with a 400 there: lookahead hashes
        cover fewer blocks, with the same function, seed and extra keys.
        """
        hasher = _hasher(
            request.hash_fn or self.hashing.hash_fn,
            request.seed if request.seed is not None else self.hashing.seed,
        )
        return hasher.external_hashes(
            token_ids,
            block_size,
            extra_keys=self._extra_keys(request, len(token_ids), block_size),
            lookahead=lookahead,
        )

    @staticmethod
    def _extra_keys(
        request: Prompt, num_tokens: int, block_size: int
    ) -> list[tuple[object, ...] | None] | None:
        if request.extra_keys is not None:
            if request.lora_name is not None or request.cache_salt is not None:
                raise _BadRequest(
                    400,
                    "extra_keys already holds every block's keys: do not "
                    "also give lora_name or cache_salt",
                )
            return [tuple(keys) if keys is not None else None for keys in request.extra_keys]
        if request.lora_name is None and request.cache_salt is None:
            return None
        return block_extra_keys(
            num_tokens // block_size,
            block_size,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
        )

    def _given_hashes(
        self, request: Prompt, given: list[int | str], block_size: int
    ) -> tuple[Sequence[ExternalBlockHash], int]:
        if not given:
            raise _BadRequest(400, "block_hashes is empty")
        if len(given) > self.limits.max_prompt_blocks:
            raise _BadRequest(413, f"{len(given)} blocks: at most {self.limits.max_prompt_blocks}")
        if any(
            field is not None
            for field in (
                request.hash_fn,
                request.seed,
                request.lora_name,
                request.cache_salt,
                request.extra_keys,
            )
        ):
            raise _BadRequest(400, "hashing parameters go with token_ids, not block_hashes")
        hashes = [_external_hash(value) for value in given]
        # Without a length the hashes are taken to cover the prompt's full blocks, and at least
        # one more token follows (vLLM always computes the last token itself).
        num_tokens = request.num_tokens or len(hashes) * block_size + 1
        if num_tokens < len(hashes) * block_size:
            raise _BadRequest(
                400, f"num_tokens {num_tokens} is shorter than the {len(hashes)} full blocks given"
            )
        return hashes, num_tokens

    async def workers(self, request: web.Request) -> web.Response:
        follower = self.follower
        freshness = follower.freshness()
        now = time.time()
        views = [_worker_view(info, follower, freshness, now) for info in follower.index.workers()]
        return _json(
            WorkersResponse(
                mode=follower.config.mode,
                lag_records=follower.lag(),
                broker_silence_s=freshness.broker_silence_s,
                workers=views,
            )
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return _json(Liveness(status="ok"))

    async def readyz(self, request: web.Request) -> web.Response:
        follower = self.follower
        freshness = follower.freshness()
        reasons = not_ready(caught_up=follower.ready, freshness=freshness)
        readiness = Readiness(
            ready=not reasons,
            reasons=reasons,
            lag_records=follower.lag(),
            broker_silence_s=freshness.broker_silence_s,
            stale_workers=len(freshness.stale_workers()),
        )
        return _json(readiness, 503 if reasons else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        response.charset = "utf-8"
        return response

    async def openapi(self, request: web.Request) -> web.Response:
        return _json(openapi_document(self.routes(), self.limits))


def _with_follower_view(
    hits: list[WorkerHit], stale_groups: Mapping[str, set[int]], stale: set[str]
) -> list[WorkerHit]:
    """The index's answers with what only the follower knows: the groups whose partition it no
    longer reads (group mode) and the workers that are stale. A current worker's answer, fully
    followed, is not copied: in replica mode with Kafka answering, none is."""
    if not stale_groups and not stale:
        return hits
    return [_followed(hit, stale_groups.get(hit.worker), hit.worker in stale) for hit in hits]


def _followed(hit: WorkerHit, stale_groups: set[int] | None, stale: bool) -> WorkerHit:
    if not stale_groups and not stale:
        return hit
    return msgspec.structs.replace(hit, stale_groups=tuple(sorted(stale_groups or ())), stale=stale)


def _token_ids(prompt: Prompt) -> TokenIds | None:
    if prompt.packed_token_ids is None:
        return prompt.token_ids
    try:
        return PackedTokenIds(prompt.packed_token_ids)
    except ValueError as exc:
        raise _BadRequest(400, f"packed_token_ids: {exc}") from exc


def _external_hash(value: int | str) -> ExternalBlockHash:
    if isinstance(value, int):
        if not 0 <= value <= _MAX_EXTERNAL_HASH:
            raise _BadRequest(400, f"block hash {value} is not an unsigned 64-bit int")
        return value
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise _BadRequest(400, f"block hash {value!r} is neither an int nor hex") from exc


def _worker_view(
    info: WorkerInfo, follower: Follower, freshness: Freshness, now: float
) -> WorkerView:
    state = follower.worker_state(info.name)
    return WorkerView(
        worker=info.name,
        epoch=info.epoch,
        health=info.health,
        groups=info.groups,
        last_seq=info.last_seq,
        resident_blocks=info.resident,
        bridge_epoch=state.epoch if state is not None else None,
        bridge_last_seq=state.last_seq if state is not None else None,
        lag_seqs=freshness.lags.get(info.name),
        stale=freshness.stale(info.name),
        applied_age_s=record_age(follower.applied_ts(info.name), now),
        stale_groups=sorted(follower.stale_groups(info.name)),
        hash_lookahead=info.hash_lookahead,
        speculative_blocks=info.speculative_blocks,
    )


# ----------------------------------------------------------------------------- the app


_PROTECTED = frozenset({"/v1/score", "/v1/routed", "/v1/workers"})


def _token_check(token: str) -> Any:
    """The middleware that asks for the bearer token on ``_PROTECTED`` paths."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _PROTECTED:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                response = _error(401, "a valid Authorization: Bearer <token> header is required")
                response.headers["WWW-Authenticate"] = 'Bearer realm="hmakv"'
                return response
        return await handler(request)

    return check


def _too_many(message: str) -> web.Response:
    return _error(429, message)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method, body too large) as JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}")


def build_app(api: ScoreApi, *, token: str | None = None) -> web.Application:
    """The app; with ``token``, the score and workers endpoints want it as a bearer token."""
    middlewares: list[Middleware] = [
        _json_errors,
        concurrency_gate(api.limits.max_concurrent, _too_many),
    ]
    if token:
        middlewares.append(_token_check(token))
    app = web.Application(middlewares=middlewares, client_max_size=api.limits.max_body_bytes)
    for route in api.routes():
        app.router.add_route(route.method, route.path, route.handler)
    return app


# ----------------------------------------------------------------------------- OpenAPI

_STATUS_TEXT = {
    400: "Invalid request",
    401: "A bearer token is required (when the index has one)",
    404: "No such worker",
    408: "The body did not arrive in time",
    413: "Request or prompt too large",
    429: "Too many requests in progress",
}


def openapi_document(routes: Iterable[Route], limits: ApiLimits) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes, schemas generated from their msgspec types."""
    routes = list(routes)
    json_types = [
        t
        for route in routes
        for t in (route.request, route.response)
        if t is not None and t is not str
    ]
    schemas, components = msgspec.json.schema_components(
        [*json_types, ErrorBody], ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip([*json_types, ErrorBody], schemas, strict=True))
    _document_limits(components, limits)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schema_of)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "hmakv index",
            "version": "1",
            "description": "Which worker already holds a prompt's prefix, per vLLM's hybrid "
            "(HMA) prefix-cache rule, from the KV-cache events in Kafka.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }


def _operation(route: Route, schema_of: dict[Any, Any]) -> dict[str, Any]:
    if route.response is str:
        content = {route.content_type.split(";")[0]: {"schema": {"type": "string"}}}
    else:
        content = _media(route, schema_of[route.response])
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status, description in route.extra_statuses:
        responses[str(status)] = {"description": description, "content": content}
    error = {"application/json": {"schema": schema_of[ErrorBody]}}
    for status in route.errors:
        responses[str(status)] = {"description": _STATUS_TEXT[status], "content": error}
    operation: dict[str, Any] = {
        "operationId": route.handler.__name__,
        "summary": route.summary,
        "responses": responses,
    }
    if route.request is not None:
        operation["requestBody"] = {
            "required": True,
            "content": _media(route, schema_of[route.request]),
        }
    return operation


def _media(route: Route, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON, and msgpack where the route takes it (its bytes are bin there, not base64)."""
    media = {"application/json": {"schema": schema}}
    if route.msgpack:
        media[MSGPACK] = {"schema": schema}
    return media


def _document_limits(components: dict[str, Any], limits: ApiLimits) -> None:
    """The configured limits as maxItems, the one-prompt rule and the hash functions, so the
    document states what the server enforces."""
    for name in ("ScoreRequest", "RoutedRequest"):
        _document_prompt(components[name], limits)
    for option in components["ScoreRequest"]["properties"]["workers"]["anyOf"]:
        if option.get("type") == "array":
            option["maxItems"] = limits.max_worker_filter


def _document_prompt(request: dict[str, Any], limits: ApiLimits) -> None:
    # Exactly one prompt field is given: null is as absent (the server reads it as None), so
    # "given" is present and not null; ``required`` alone made {"token_ids": [..],
    # "block_hashes": null} invalid by the document, which the server answers (schemathesis).
    request["oneOf"] = [_given(name, kind) for name, kind in _PROMPT_FIELDS.items()]
    properties = request["properties"]
    for option in properties["hash_fn"]["anyOf"]:
        if option.get("type") == "string":
            option["enum"] = list(HASH_FUNCTIONS)
    for name, most in (
        ("token_ids", limits.max_prompt_tokens),
        ("block_hashes", limits.max_prompt_blocks),
    ):
        for option in properties[name]["anyOf"]:
            if option.get("type") == "array":
                option["maxItems"] = most
    packed_bytes = limits.max_prompt_tokens * PACKED_TOKEN_BYTES
    for option in properties["packed_token_ids"]["anyOf"]:
        if option.get("type") == "string":
            option["maxLength"] = 4 * math.ceil(packed_bytes / 3)  # in base64


# The fields a prompt may come in, and their JSON types.
_PROMPT_FIELDS = {"token_ids": "array", "packed_token_ids": "string", "block_hashes": "array"}


def _given(name: str, kind: str) -> dict[str, Any]:
    """A JSON schema for: the request gives this field, present and not null."""
    return {"required": [name], "properties": {name: {"type": kind}}}
