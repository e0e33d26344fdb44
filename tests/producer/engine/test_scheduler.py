"""The continuous-batching scheduler over the real cache manager (and, once, the torch model).

Invariants a vLLM-like scheduler must keep whatever the load: the token budget and the running
limit hold in every step, every request finishes with exactly its ``max_tokens``, preempted
requests resume with the same output, every block comes back, and chunking a prefill changes
nothing about the hits.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import pytest

from hmakv.producer.engine import PROFILES, HybridCacheManager, ModelProfile, get_profile
from hmakv.producer.engine.model_sampler import ModelSampler
from hmakv.producer.engine.scheduler import (
    FinishReason,
    ScheduledChunk,
    Scheduler,
    StepResult,
    SyntheticSampler,
)
from hmakv.producer.engine.workloads import RandomPrefixWorkload
from hmakv.producer.events import KVEventBatch
from hmakv.producer.recorder import EventRecorder

MAX_STEPS = 20_000


class BatchList:
    """A recorder sink keeping every batch it is handed."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


def make_scheduler(
    profile: ModelProfile, *, token_budget: int = 256, max_running: int = 16
) -> tuple[Scheduler, BatchList]:
    sink = BatchList()
    manager = HybridCacheManager(profile, EventRecorder(profile.groups, sink))
    sampler = SyntheticSampler(profile.dims.vocab_size, seed=3)
    return Scheduler(manager, sampler, token_budget=token_budget, max_running=max_running), sink


def drain(scheduler: Scheduler) -> list[StepResult]:
    results: list[StepResult] = []
    while scheduler.has_work:
        assert len(results) < MAX_STEPS, "the scheduler stopped making progress"
        results.append(scheduler.step())
    return results


def pressured(name: str, num_blocks: int) -> ModelProfile:
    return dataclasses.replace(get_profile(name), num_blocks=num_blocks)


def submit_random(scheduler: Scheduler, count: int, *, seed: int, context: int) -> dict[str, int]:
    """Queue ``count`` stress requests; returns their max_tokens by id."""
    workload = RandomPrefixWorkload(seed=seed, vocab_size=512, context_tokens=context)
    wanted = {}
    for _ in range(count):
        spec = workload.next_request()
        scheduler.add_request(spec.request_id, spec.prompt_token_ids, spec.max_tokens)
        wanted[spec.request_id] = spec.max_tokens
    return wanted


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_budget_and_running_limit_hold_and_every_request_finishes(name: str) -> None:
    # Two of the longest requests fit: admission waits, and running requests get preempted.
    longest = 128 + 64 + 16  # prefix cut + tail + output at context 256
    per_request = sum(-(-longest // g.block_size) for g in get_profile(name).groups)
    profile = pressured(name, num_blocks=2 * per_request + 1)
    scheduler, _ = make_scheduler(profile, token_budget=128, max_running=6)
    wanted = submit_random(scheduler, 40, seed=5, context=256)

    results = drain(scheduler)

    assert all(r.num_scheduled_tokens <= 128 for r in results)
    assert max(len(r.chunks) for r in results) <= 6
    finished = {f.request_id: f for r in results for f in r.finished}
    assert set(finished) == set(wanted)
    assert all(f.reason is FinishReason.LENGTH for f in finished.values())
    assert {rid: len(f.output_token_ids) for rid, f in finished.items()} == wanted
    assert scheduler.manager.num_free_blocks == profile.num_blocks - 1
    assert sum(len(r.preempted) for r in results) > 0, "the pool was meant to run out"
    assert any(len(c.token_ids) > 1 and c.start_pos > 0 for r in results for c in r.chunks), (
        "some prefill was meant to be chunked"
    )


def test_preempted_requests_resume_with_the_same_output() -> None:
    """Recompute preemption loses nothing: outputs match a run that never ran out of blocks."""
    outputs = {}
    preemptions = {}
    for num_blocks in (41, 1024):
        scheduler, _ = make_scheduler(pressured("gpt-oss-like", num_blocks), token_budget=128)
        submit_random(scheduler, 30, seed=9, context=256)
        results = drain(scheduler)
        outputs[num_blocks] = {
            f.request_id: f.output_token_ids for r in results for f in r.finished
        }
        preemptions[num_blocks] = sum(len(r.preempted) for r in results)

    assert preemptions[41] > 0
    assert preemptions[1024] == 0
    assert outputs[41] == outputs[1024]


def test_the_request_arriving_last_is_preempted_and_goes_back_first() -> None:
    # 12 blocks: two 40-token prompts fit (3 per group each), not once both grow past 48 tokens.
    scheduler, _ = make_scheduler(pressured("gpt-oss-like", 13), token_budget=256)
    scheduler.add_request("early", list(range(40)), max_tokens=20)
    scheduler.add_request("late", list(range(100, 140)), max_tokens=20)

    results = drain(scheduler)

    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and set(preempted) == {"late"}
    order = [f.request_id for r in results for f in r.finished]
    assert order == ["early", "late"]
    readmitted = [a for r in results for a in r.admitted if a.request_id == "late" and not a.first]
    assert readmitted, "the preempted request is admitted again"


def test_one_event_batch_per_step_goes_to_the_sink() -> None:
    scheduler, sink = make_scheduler(get_profile("swa-small"), token_budget=64)
    submit_random(scheduler, 10, seed=2, context=200)

    results = drain(scheduler)

    published = [r.batch for r in results if r.batch is not None]
    assert len(published) == len(sink.batches) > 0
    assert all(a is b for a, b in zip(published, sink.batches, strict=True))


@pytest.mark.parametrize(
    "name",
    # Mamba is left out by design: chunked prefill caches a state at every chunk boundary,
    # one unchunked pass only at the last, so later hits rightly differ (vLLM's "align" mode).
    sorted(n for n in PROFILES if not any(g.kind == "mamba" for g in PROFILES[n].groups)),
)
def test_chunked_prefill_gets_the_same_hits_as_unchunked(name: str) -> None:
    profile = get_profile(name)
    workload = RandomPrefixWorkload(seed=11, vocab_size=512, context_tokens=256, num_prefixes=3)
    prompts = [workload.next_request() for _ in range(12)]
    hits: dict[int, list[int]] = {}
    resident: dict[int, list[Counter[object]]] = {}
    for budget in (64, 4096):
        scheduler, _ = make_scheduler(profile, token_budget=budget)
        hits[budget] = []
        for spec in prompts:  # one at a time, so each sees everything before it cached
            scheduler.add_request(spec.request_id, spec.prompt_token_ids, spec.max_tokens)
            results = drain(scheduler)
            hits[budget] += [a.num_cached_tokens for r in results for a in r.admitted]
        resident[budget] = [
            Counter(e.block_hashes[0] for e in group)
            for group in scheduler.manager.resident_blocks()
        ]

    assert hits[64] == hits[4096]
    assert sum(hits[64]) > 0
    assert resident[64] == resident[4096]


def test_requests_that_can_never_fit_are_aborted_before_they_take_blocks() -> None:
    # 8 blocks: full attention alone holds 128 tokens; with the window's blocks, 100 is too many.
    scheduler, _ = make_scheduler(pressured("gpt-oss-like", 9), token_budget=256)
    assert scheduler.max_model_len == 128
    scheduler.add_request("beyond-max-len", list(range(120)), max_tokens=9)
    scheduler.add_request("first-chunk-too-big", list(range(100)), max_tokens=4)
    scheduler.add_request("small", list(range(10)), max_tokens=4)

    results = drain(scheduler)

    finished = {f.request_id: f for r in results for f in r.finished}
    for request_id in ("beyond-max-len", "first-chunk-too-big"):
        assert finished[request_id].reason is FinishReason.TOO_LONG
        assert finished[request_id].output_token_ids == ()
    assert finished["small"].reason is FinishReason.LENGTH
    assert [a.request_id for r in results for a in r.admitted] == ["small"]
    assert scheduler.manager.num_free_blocks == 8


def test_max_model_len_counts_only_the_groups_that_keep_every_block() -> None:
    assert make_scheduler(pressured("mixed-block-like", 11))[0].max_model_len == 10 * 64
    assert make_scheduler(get_profile("gemma3-like"))[0].max_model_len == 4095 * 16


def test_a_request_outgrowing_the_cache_alone_is_aborted_not_requeued() -> None:
    # Fits at admission (3 blocks per group) and within max_model_len (128), but 120 tokens
    # need 8 blocks in each group, and the pool has 8 in all.
    scheduler, _ = make_scheduler(pressured("gpt-oss-like", 9), token_budget=256)
    scheduler.add_request("grower", list(range(40)), max_tokens=80)

    results = drain(scheduler)

    (finished,) = [f for r in results for f in r.finished]
    assert finished.reason is FinishReason.TOO_LONG
    assert 0 < len(finished.output_token_ids) < 80
    assert scheduler.manager.num_free_blocks == 8


def test_bad_requests_and_settings_are_refused() -> None:
    scheduler, _ = make_scheduler(get_profile("gpt-oss-like"))
    scheduler.add_request("a", [1, 2, 3], max_tokens=1)
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add_request("a", [1], max_tokens=1)
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request("b", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request("c", [1], max_tokens=0)
    mamba = get_profile("mamba-hybrid-like")
    with pytest.raises(ValueError, match="alignment"):
        make_scheduler(mamba, token_budget=32)


def test_synthetic_tokens_depend_only_on_seed_request_and_position() -> None:
    sampler = SyntheticSampler(512, seed=1)
    chunk = ScheduledChunk("r", [5, 6, 7], 10)
    assert sampler.sample([chunk]) == sampler.sample([ScheduledChunk("r", [9], 12)])
    assert sampler.sample([chunk]) == SyntheticSampler(512, seed=1).sample([chunk])
    tokens = {sampler.token(f"r{i}", 13) for i in range(200)}
    assert len(tokens) > 150 and all(0 <= t < 512 for t in tokens)
    assert sampler.token("r", 13) != SyntheticSampler(512, seed=2).token("r", 13)


def serve(scheduler: Scheduler, request_id: str, prompt: Sequence[int]) -> tuple[int, ...]:
    """Serve one request alone; returns its prefix hit and its generated tokens."""
    scheduler.add_request(request_id, prompt, max_tokens=6)
    results = drain(scheduler)
    (finished,) = [f for r in results for f in r.finished]
    return (finished.num_cached_tokens, *finished.output_token_ids)


def test_with_the_model_a_prefix_hit_generates_what_a_cold_prefill_does() -> None:
    """The scheduler's block tables, chunking and hits feed the torch model correctly: a request
    that reuses 256 cached tokens decodes exactly the tokens a fresh engine computes in full."""
    profile = get_profile("gpt-oss-like")
    prompt = [(7 * i) % 512 for i in range(300)]

    def scheduler_with_model() -> Scheduler:
        manager = HybridCacheManager(profile, EventRecorder(profile.groups))
        return Scheduler(manager, ModelSampler(manager, seed=4, device="cpu"), token_budget=64)

    warm = scheduler_with_model()
    serve(warm, "first", [*prompt[:280], 1, 2, 3])
    hot_hit, *hot = serve(warm, "second", prompt)
    cold_hit, *cold = serve(scheduler_with_model(), "second", prompt)

    assert (hot_hit, cold_hit) == (272, 0)
    assert hot == cold
