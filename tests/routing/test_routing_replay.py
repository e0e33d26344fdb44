"""Recorded traffic replayed behind every router: each prompt served once, at its offset."""

from __future__ import annotations

import dataclasses

import pytest

from hmakv.producer.engine.profiles import get_profile
from hmakv.producer.engine.workloads import ChatWorkload
from hmakv.routing.cluster import Background
from hmakv.routing.replay import RECORDED, RecordedPrompt, RecordedTraffic, replay
from hmakv.routing.study import ROUTERS

PROFILE = dataclasses.replace(get_profile("gpt-oss-like"), num_blocks=512)


def recorded(count: int, *, gap_s: float = 0.05) -> list[RecordedPrompt]:
    """A chat's first turns, then each prompt again with a follow-up (cached where it went)."""
    chat = ChatWorkload(seed=3, vocab_size=PROFILE.dims.vocab_size, context_tokens=1024)
    firsts = [chat.next_request().prompt_token_ids for _ in range(count)]
    prompts = [*firsts, *(first + (7,) * 40 for first in firsts)]
    return [RecordedPrompt(i * gap_s, tokens) for i, tokens in enumerate(prompts)]


def test_the_traffic_yields_the_prompts_in_order_then_none() -> None:
    prompts = recorded(3)
    traffic = RecordedTraffic(prompts, max_tokens=5)
    specs = [traffic.next_request() for _ in prompts]
    assert [s.prompt_token_ids for s in specs if s] == [p.token_ids for p in prompts]
    assert {s.max_tokens for s in specs if s} == {5}
    assert len({s.request_id for s in specs if s}) == len(prompts)
    assert traffic.next_request() is None


def test_every_router_serves_every_recorded_prompt() -> None:
    prompts = recorded(12)
    reports = replay(PROFILE, prompts, engines=4, max_tokens=8)
    assert [r.router for r in reports] == list(ROUTERS)
    tokens = sum(len(p.token_ids) for p in prompts)
    for report in reports:
        assert (report.workload, report.profile) == (RECORDED, PROFILE.name)
        assert report.requests == report.served == len(prompts)
        assert report.prompt_tokens == tokens
    by_router = {r.router: r for r in reports}
    # the follow-ups find their first turns: where the index saw them, and nowhere by chance
    assert by_router["hmakv"].cached_share > 0.3
    assert by_router["hmakv"].predicted_exact == len(prompts)
    assert by_router["round-robin"].cached_share < by_router["hmakv"].cached_share


def test_the_offsets_are_kept_from_the_first_prompt() -> None:
    early = recorded(4)
    late = [RecordedPrompt(p.at_s + 1000.0, p.token_ids) for p in early]
    assert replay(PROFILE, late, engines=2, max_tokens=4, routers=["hmakv"]) == replay(
        PROFILE, early, engines=2, max_tokens=4, routers=["hmakv"]
    )


def test_prompts_out_of_order_are_refused() -> None:
    prompts = recorded(2)
    with pytest.raises(ValueError, match="time order"):
        replay(PROFILE, prompts[::-1], engines=2, max_tokens=4)


def test_background_traffic_loads_its_engine_and_is_not_reported() -> None:
    """An engine's own requests are served where they arrive, unrouted; a routed prompt that
    repeats one finds it cached there, and only the routed prompts are reported."""
    prompts = recorded(4, gap_s=1.0)
    own = [RecordedPrompt(0.0, p.token_ids) for p in prompts[:4]]

    def background() -> list[Background]:
        return [Background(2, RecordedTraffic(own, max_tokens=4), [0.0, 0.1, 0.2, 0.3])]

    later = [RecordedPrompt(10.0 + p.at_s, p.token_ids) for p in prompts[:4]]
    base = RecordedPrompt(0.0, (5,) * 64)  # the offsets count from here
    (report,) = replay(
        PROFILE, [base, *later], engines=4, max_tokens=4, routers=["hmakv"], background=background
    )
    assert report.requests == report.served == 5
    repeated = sum(len(p.token_ids) for p in later)
    assert report.cached_tokens >= repeated - 4 * 16  # each repeat: all but its last block
    assert report.predicted_exact == 5
