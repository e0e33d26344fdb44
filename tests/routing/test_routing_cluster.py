"""The simulated fleet: deterministic, conserving every request and token, on the stated clock."""

from __future__ import annotations

import dataclasses

import pytest

from hmakv.producer.engine.hit_rule import hash_block_size
from hmakv.producer.engine.profiles import get_profile
from hmakv.producer.engine.workloads import ArrivalSchedule, DocumentsWorkload
from hmakv.routing.cluster import FleetSpec, PromptHasher, arrival_times, simulate
from hmakv.routing.costs import StepCost
from hmakv.routing.policies import RoundRobin
from hmakv.routing.study import (
    CONTROL_PROFILE,
    ROUTERS,
    StudyPlan,
    fleet_for,
    run_one,
    stream_for,
    study_profile,
)

PLAN = StudyPlan(profiles=("gpt-oss-like",), workloads=("chat",), engines=4, duration_s=2.0)


def test_a_run_is_the_same_every_time() -> None:
    spec, stream = fleet_for(PLAN, "gpt-oss-like"), stream_for(PLAN, "chat")
    size = hash_block_size(spec.profile.groups)
    first = run_one(spec, stream, "hmakv", hasher=PromptHasher(spec.profile, size))
    again = run_one(spec, stream, "hmakv", hasher=PromptHasher(spec.profile, size))
    assert first == again
    assert first.requests > 50


@pytest.mark.parametrize("router", ROUTERS)
def test_every_request_is_served_and_tokens_add_up(router: str) -> None:
    """Light load, no preemption: what the engines computed is every prompt token not cached."""
    plan = dataclasses.replace(PLAN, rate_scale=0.5, pool_fraction=2.0)
    spec, stream = fleet_for(plan, "gpt-oss-like"), stream_for(plan, "chat")
    report = run_one(spec, stream, router, hasher=PromptHasher(spec.profile, 16))
    assert report.served == report.requests > 0
    assert 0 < report.cached_tokens < report.prompt_tokens
    assert report.prefill_tokens == report.prompt_tokens - report.cached_tokens
    predicts = router not in ("least-loaded", "round-robin")
    assert report.predicted == (report.requests if predicts else 0)
    assert (
        report.predicted_exact + report.predicted_under + report.predicted_over == report.predicted
    )


def test_a_lone_request_takes_what_the_cost_model_says() -> None:
    profile = get_profile("gpt-oss-like")
    cost = StepCost(step_s=0.004, prefill_token_s=1e-5, decode_context_token_s=0.0)
    spec = FleetSpec(engines=2, profile=profile, cost=cost)
    workload = DocumentsWorkload(seed=1, vocab_size=profile.dims.vocab_size, context_tokens=1024)
    result = simulate(spec, RoundRobin(), workload, [1.0], hasher=PromptHasher(profile, 16))
    (request,) = result.requests
    assert request.cached_tokens == 0
    assert request.first_token_at == pytest.approx(1.0 + 0.004 + 1e-5 * request.prompt_tokens)
    assert request.finished_at is not None and request.finished_at > request.first_token_at


def test_every_router_gets_the_same_arrivals() -> None:
    def times() -> list[float]:
        return arrival_times(ArrivalSchedule(40.0, seed=2, duration=3.0, burst_size=4))

    assert times() == times()
    assert 60 < len(times()) < 190


def test_the_control_is_gpt_oss_like_without_its_window_layers() -> None:
    control = study_profile(CONTROL_PROFILE)
    assert [g.kind for g in control.groups] == ["full_attention"]
    assert control.num_blocks == get_profile("gpt-oss-like").num_blocks


def test_on_the_control_every_event_fed_index_routes_alike() -> None:
    """Without window groups the group-blind indexes see what hmakv sees: the same decisions."""
    plan = dataclasses.replace(PLAN, profiles=(CONTROL_PROFILE,))
    spec, stream = fleet_for(plan, CONTROL_PROFILE), stream_for(plan, "chat")
    hasher = PromptHasher(spec.profile, 16)
    reports = [
        run_one(spec, stream, router, hasher=hasher)
        for router in ("hmakv", "removal-means-gone", "full-attention-only")
    ]
    figures = {dataclasses.replace(r, router="") for r in reports}
    assert len(figures) == 1
