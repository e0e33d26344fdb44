"""What the index answers on ``POST /v1/score`` and ``GET /v1/workers``, and which worker a score
answer names best.

The wire contract of the score API: the index builds ``WorkerHit``s (one struct, from the scan
to the JSON), the API encodes a ``ScoreResponse`` and the demo's probe, a router as any would
be, decodes it. It lives here, beside the log's contract, because the index and the demo may
both import ``kvlog`` and neither may import the other.

The best-worker policy is here for the same reason: the API names ``best`` and the group-blind
best with it, and the demo judges what routing by each answer would have picked with it, so the
two can only differ where their ranks do. The structs' docstrings and ``Doc`` descriptions are
the OpenAPI document's text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Protocol, TypeVar

import msgspec

from hmakv.kvlog.records import Health
from hmakv.producer.events import GroupSpec

Doc = msgspec.Meta
Rank = tuple[float, ...]
"""How much an answer promises, figure by figure, most significant first; a first figure of 0
means no hit."""


class WorkerHit(msgspec.Struct, frozen=True, gc=False):
    """One worker's prefix hit for the prompt, as vLLM's hybrid lookup would find it."""

    worker: str
    hit_tokens: Annotated[int, Doc(description="the hit vLLM's lookup finds on the worker's GPU")]
    hit_blocks: int
    group_hit_tokens: Annotated[
        dict[int, int], Doc(description="per group: the hit it alone accepts")
    ] = msgspec.field(name="groups")
    tier_hit_tokens: Annotated[
        dict[str, int], Doc(description="per medium: the hit with it and faster")
    ] = msgspec.field(name="tiers")
    weighted_tokens: Annotated[
        float, Doc(description="tokens weighted by the slowest tier each needs")
    ] = msgspec.field(name="score")
    health: Health
    degraded: Annotated[bool, Doc(description="not live: its cache may differ from the index")]
    catalog_ok: Annotated[
        bool, Doc(description="false when its groups are unknown: 0 means no answer")
    ]
    group_blind_hit_tokens: Annotated[int, Doc(description="an index ignoring groups would say")]
    stale_groups: Annotated[
        tuple[int, ...],
        Doc(
            description="group mode: groups whose partition this follower no longer reads; "
            "their blocks may be gone, so the worker is never the best"
        ),
    ]
    hash_lookahead: Annotated[
        int,
        Doc(
            description="tokens past each block that the worker's hashes cover (vLLM's EAGLE "
            "lookahead hashing; 0: classic hashes). token_ids are hashed that way for this "
            "worker; given block_hashes are used as they are for every worker"
        ),
    ] = 0
    stale: Annotated[
        bool,
        Doc(
            description="the index may be behind the worker: more seqs behind the bridge than "
            "--max-worker-lag, or Kafka silent (then every worker is); never the best"
        ),
    ] = False
    speculative_hit_tokens: Annotated[
        int | None,
        Doc(
            description="the GPU hit when the blocks of prompts routed to the worker and not yet "
            "confirmed by its events count as held (POST /v1/routed); equals hit_tokens when it "
            "holds none (null: an index without speculation)"
        ),
    ] = None
    speculative_weighted_tokens: Annotated[
        float | None,
        Doc(
            description="score plus the GPU tier's weight times (speculative_hit_tokens - "
            "hit_tokens): what best ranks by first (null: an index without speculation)"
        ),
    ] = msgspec.field(default=None, name="speculative_score")


class GroupBlindAnswer(msgspec.Struct, kw_only=True):
    """What an index ignoring cache groups would answer (the usual peer design), for comparison."""

    best: str | None
    hit_tokens: int


class ScoreResponse(msgspec.Struct, kw_only=True):
    """Workers best first; ``best`` is the first live one with a usable catalog, neither stale
    nor with stale groups, and a hit."""

    best: str | None
    hash_block_size: int
    num_tokens: int
    prompt_blocks: int
    workers: list[WorkerHit]
    group_blind: Annotated[
        GroupBlindAnswer | None, Doc(description="null when the request asked for no details")
    ]


# ----------------------------------------------------------------------------- best worker


class WorkerView(msgspec.Struct, kw_only=True):
    """One worker as the index sees it, beside the bridge's latest state for it."""

    worker: str
    epoch: int
    health: Health
    groups: dict[int, GroupSpec]
    last_seq: dict[int, int]
    resident_blocks: dict[int, dict[str, int]]
    bridge_epoch: int | None
    bridge_last_seq: int | None
    lag_seqs: Annotated[
        int | None,
        Doc(
            description="seqs forwarded by the bridge in this life, not applied (null: no "
            "bridge state of this life)"
        ),
    ]
    stale: Annotated[
        bool,
        Doc(description="lag_seqs above --max-worker-lag, or Kafka silent: as in /v1/score"),
    ]
    applied_age_s: Annotated[
        float | None,
        Doc(
            description="seconds since the engine stamped the newest record applied for it "
            "(null: none applied since the index started); an idle worker ages too"
        ),
    ]
    stale_groups: Annotated[list[int], Doc(description="group mode: partition no longer read")]
    hash_lookahead: Annotated[
        int, Doc(description="tokens past each block its hashes cover (0: classic hashes)")
    ] = 0
    speculative_blocks: Annotated[
        int,
        Doc(description="blocks held speculatively (routed prompts not confirmed yet), all groups"),
    ] = 0


class WorkersResponse(msgspec.Struct, kw_only=True):
    mode: str
    lag_records: int
    broker_silence_s: Annotated[
        float, Doc(description="seconds since Kafka last answered the index")
    ]
    workers: list[WorkerView]


class Answer(Protocol):
    """Anything that answers for one worker."""

    @property
    def worker(self) -> str: ...


A = TypeVar("A", bound=Answer)


def best_worker(answers: Iterable[A], rank: Callable[[A], Rank]) -> A | None:
    """The answer whose worker the prompt should go to: the highest rank, and the first worker
    name among equal ranks, so the choice never depends on the order answers come in. None when
    no answer has a hit (its rank's first figure above 0): then no worker is better than any
    other, and a router sends the prompt where it likes."""
    best: A | None = None
    top: Rank = (0.0,)
    for answer in answers:  # one pass: a wide fleet's answer is scanned once per request
        figures = rank(answer)
        if figures > top or (best is not None and figures == top and answer.worker < best.worker):
            best, top = answer, figures
    return best if top[0] > 0 else None


def hma_best(hits: Iterable[WorkerHit], *, ranked: bool = False) -> WorkerHit | None:
    """``ScoreResponse.best``: of the workers a router may be sent to, the one with the most
    tier-weighted tokens counting speculative blocks as GPU ones, then without them, then the
    longest GPU hit. A prompt routed a moment ago is where its follow-up hits, before the
    engine's events say so; without speculation the first two figures are equal.

    ``ranked``: the hits come in this very order, names ascending among equals, as the index
    answers them (``KVIndex.score``); then the first routable one is the best, found without
    ranking every worker (at 1,000 workers that pass cost more than the score).
    """
    if not ranked:
        return best_worker(filter(routable, hits), _hma_rank)
    first = next(filter(routable, hits), None)
    return first if first is not None and speculative_score(first) > 0 else None


def group_blind_answer(hits: Iterable[WorkerHit]) -> GroupBlindAnswer:
    """What an index ignoring groups would answer: the longest group-blind hit among the workers
    the index follows wholly (degraded and stale workers, and those with stale groups, are left
    out, as from ``hma_best``)."""
    best = best_worker(filter(current, hits), _group_blind_rank)
    if best is None:
        return GroupBlindAnswer(best=None, hit_tokens=0)
    return GroupBlindAnswer(best=best.worker, hit_tokens=best.group_blind_hit_tokens)


def current(hit: WorkerHit) -> bool:
    """Whether the index may hold what the worker holds: live, every group followed, and not
    stale (behind the bridge, or Kafka silent: a router falls back to its own choice)."""
    return not hit.degraded and not hit.stale_groups and not hit.stale


def routable(hit: WorkerHit) -> bool:
    """A worker a router may be sent to on the strength of this answer: followed wholly, and
    with known groups (otherwise its 0 is no answer)."""
    return current(hit) and hit.catalog_ok


def _hma_rank(hit: WorkerHit) -> Rank:
    return speculative_score(hit), hit.weighted_tokens, hit.hit_tokens


def speculative_hit(hit: WorkerHit) -> int:
    """The hit with speculative blocks counted as held, or the plain one from an older index."""
    speculative = hit.speculative_hit_tokens
    return hit.hit_tokens if speculative is None else speculative


def speculative_score(hit: WorkerHit) -> float:
    """The score with speculative blocks counted, or the plain one from an older index."""
    speculative = hit.speculative_weighted_tokens
    return hit.weighted_tokens if speculative is None else speculative


def _group_blind_rank(hit: WorkerHit) -> Rank:
    return (hit.group_blind_hit_tokens,)
