"""The routing study: every router on the same seeded request stream, one report row each.

A run is (profile, workload, router): a fresh fleet of empty engines, the workload's requests on
the same arrival times, and the router under test. The report per run, from the engines
themselves:

- ``cached_tokens``: the engines' real prefix hits (vLLM's ``num_cached_tokens`` at first
  admission), and their share of all prompt tokens;
- ``prefill_tokens``: tokens the engines computed for prompts (misses and recomputation after
  preemption);
- ``load_cv``: the coefficient of variation of the engines' busy time (0: perfectly even);
- ``ttft_p50_s`` / ``ttft_p99_s``: time to first token on the cost model's clock;
- ``predicted_exact``: how often the router's predicted hit on the engine it chose equalled the
  engine's real hit, with the under- and over-predictions counted apart (a group-blind index
  under-predicts when a window block's eviction hides a valid path, and over-predicts when it
  takes a path whose window is gone).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hmakv.consumers.speculation import SpeculationTtl
from hmakv.producer.engine.hit_rule import hash_block_size
from hmakv.producer.engine.profiles import ModelProfile, get_profile
from hmakv.producer.engine.workloads import ArrivalSchedule, make_workload
from hmakv.producer.events import GroupSpec
from hmakv.routing.cluster import FleetSpec, PromptHasher, RunResult, arrival_times, simulate
from hmakv.routing.costs import StepCost
from hmakv.routing.estimates import (
    HashSetEstimate,
    HmaIndexEstimate,
    PrefixEstimate,
    RoutingHistory,
    every_group,
    full_attention,
)
from hmakv.routing.policies import (
    LLM_D_WEIGHTS,
    LeastLoaded,
    RoundRobin,
    Router,
    ScoredRouter,
    Weights,
)

ROUTERS = (
    "hmakv",
    "hmakv-speculative",
    "hmakv-affinity",
    "removal-means-gone",
    "full-attention-only",
    "approximate",
    "least-loaded",
    "round-robin",
)
APPROXIMATE_TTL_S = 120.0
"""Dynamo's default ``--router-ttl`` for its approximate (event-less) mode."""

CONTROL_PROFILE = "full-attention-control"
"""gpt-oss-like without its sliding-window layers: the non-hybrid control."""


def study_profile(name: str) -> ModelProfile:
    """A profile of the engine's, or the non-hybrid control made from gpt-oss-like."""
    if name != CONTROL_PROFILE:
        return get_profile(name)
    base = get_profile("gpt-oss-like")
    full: GroupSpec = base.groups[0]
    dims = dataclasses.replace(base.dims, layers_per_group=(sum(base.dims.layers_per_group),))
    return dataclasses.replace(base, name=CONTROL_PROFILE, groups=(full,), dims=dims)


@dataclass(frozen=True)
class StreamSpec:
    """A workload's request stream: what is asked, how fast, for how long."""

    workload: str
    rate: float
    duration_s: float
    context_tokens: int
    burst_size: int = 1
    seed: int = 0


@dataclass(frozen=True)
class RunReport:
    profile: str
    workload: str
    router: str
    requests: int
    served: int
    prompt_tokens: int
    cached_tokens: int
    cached_share: float
    prefill_tokens: int
    load_cv: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    predicted: int
    predicted_exact: int
    predicted_under: int
    predicted_over: int


def make_router(
    name: str,
    engines: int,
    groups: Sequence[GroupSpec],
    hash_block_size: int,
    weights: Weights = LLM_D_WEIGHTS,
    *,
    seed: int = 0,
    token_budget: int | None = None,
) -> Router:
    """The router called ``name`` for ``engines`` engines of one cache layout; the engines'
    ``token_budget`` (``max_num_batched_tokens``), when known, tells the speculative index where
    their mamba prefills stop."""
    estimates: dict[str, Callable[[], PrefixEstimate]] = {
        "hmakv": lambda: HmaIndexEstimate(engines, groups, hash_block_size),
        "hmakv-speculative": lambda: HmaIndexEstimate(
            engines,
            groups,
            hash_block_size,
            speculation=SpeculationTtl(),
            prefill_chunk_tokens=token_budget,
        ),
        "removal-means-gone": lambda: HashSetEstimate(
            engines, groups, hash_block_size, keep=every_group
        ),
        "full-attention-only": lambda: HashSetEstimate(
            engines, groups, hash_block_size, keep=full_attention
        ),
        "approximate": lambda: RoutingHistory(engines, hash_block_size, ttl=APPROXIMATE_TTL_S),
    }
    if name in estimates:
        return ScoredRouter(name, estimates[name](), weights, seed=seed)
    if name == "hmakv-affinity":
        history = RoutingHistory(engines, hash_block_size, ttl=APPROXIMATE_TTL_S)
        index = HmaIndexEstimate(engines, groups, hash_block_size)
        return ScoredRouter(name, index, weights, seed=seed, affinity=history)
    if name == "least-loaded":
        return LeastLoaded(seed=seed)
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown router {name!r}; known routers: {', '.join(ROUTERS)}")


def run_one(
    spec: FleetSpec,
    stream: StreamSpec,
    router_name: str,
    *,
    hasher: PromptHasher,
    weights: Weights = LLM_D_WEIGHTS,
) -> RunReport:
    """One router on the stream, from empty engines."""
    profile = spec.profile
    workload = make_workload(
        stream.workload,
        seed=stream.seed,
        vocab_size=profile.dims.vocab_size,
        context_tokens=stream.context_tokens,
    )
    schedule = ArrivalSchedule(
        stream.rate, seed=stream.seed, duration=stream.duration_s, burst_size=stream.burst_size
    )
    groups = profile.groups
    router = make_router(
        router_name,
        spec.engines,
        groups,
        hash_block_size(groups),
        weights,
        seed=stream.seed,
        token_budget=spec.token_budget,
    )
    result = simulate(spec, router, workload, arrival_times(schedule), hasher=hasher)
    return summarize(profile.name, stream.workload, router_name, result)


def summarize(profile: str, workload: str, router: str, result: RunResult) -> RunReport:
    requests = result.requests
    admitted = [r for r in requests if r.cached_tokens is not None]
    ttfts = sorted(r.first_token_at - r.arrival for r in requests if r.first_token_at is not None)
    judged = [r for r in admitted if r.predicted_hit is not None]
    prompt_tokens = sum(r.prompt_tokens for r in admitted)
    cached = sum(r.cached_tokens or 0 for r in admitted)
    busy = [engine.busy_s for engine in result.engines]
    mean_busy = statistics.fmean(busy) if busy else 0.0
    return RunReport(
        profile=profile,
        workload=workload,
        router=router,
        requests=len(requests),
        served=len(ttfts),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        cached_share=cached / prompt_tokens if prompt_tokens else 0.0,
        prefill_tokens=sum(engine.prefill_tokens for engine in result.engines),
        load_cv=statistics.pstdev(busy) / mean_busy if mean_busy else 0.0,
        ttft_p50_s=_quantile(ttfts, 0.50),
        ttft_p99_s=_quantile(ttfts, 0.99),
        predicted=len(judged),
        predicted_exact=sum(r.predicted_hit == r.cached_tokens for r in judged),
        predicted_under=sum((r.predicted_hit or 0) < (r.cached_tokens or 0) for r in judged),
        predicted_over=sum((r.predicted_hit or 0) > (r.cached_tokens or 0) for r in judged),
    )


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted values (None for none)."""
    if not ordered:
        return None
    rank = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass(frozen=True)
class StudyPlan:
    """Which runs a study makes, and the fleet they share."""

    profiles: tuple[str, ...]
    workloads: tuple[str, ...]
    routers: tuple[str, ...] = ROUTERS
    engines: int = 8
    duration_s: float = 30.0
    context_tokens: int = 4096
    rate_scale: float = 1.0
    pool_fraction: float = 0.5
    weights: Weights = LLM_D_WEIGHTS
    prefill_factor: float = 1.0
    event_lag: float = 0.02
    seed: int = 0


WORKLOAD_RATES: dict[str, tuple[float, int]] = {
    # requests/s across the fleet (8 engines) and burst size: a fleet well used, not swamped
    "chat": (80.0, 1),
    "agentic": (40.0, 1),
    "documents": (80.0, 1),
    "burst": (40.0, 8),
}
STUDY_PROFILES = ("gpt-oss-like", "gemma3-like", "mamba-hybrid-like", CONTROL_PROFILE)
STUDY_WORKLOADS = tuple(WORKLOAD_RATES)


def fleet_for(plan: StudyPlan, profile_name: str) -> FleetSpec:
    """The plan's fleet on one profile, with pools of ``pool_fraction`` of the profile's own."""
    profile = study_profile(profile_name)
    blocks = max(2, round(profile.num_blocks * plan.pool_fraction))
    return FleetSpec(
        engines=plan.engines,
        profile=dataclasses.replace(profile, num_blocks=blocks),
        cost=StepCost().scaled(plan.prefill_factor),
        event_lag=plan.event_lag,
    )


def stream_for(plan: StudyPlan, workload: str) -> StreamSpec:
    rate, burst = WORKLOAD_RATES.get(workload, (80.0, 1))
    return StreamSpec(
        workload,
        rate=rate * plan.rate_scale * plan.engines / 8,
        duration_s=plan.duration_s,
        context_tokens=plan.context_tokens,
        burst_size=burst,
        seed=plan.seed,
    )


def run_study(plan: StudyPlan) -> Iterator[RunReport]:
    """Every (profile, workload, router) of the plan, routers innermost."""
    for profile_name in plan.profiles:
        spec = fleet_for(plan, profile_name)
        hasher = PromptHasher(spec.profile, hash_block_size(spec.profile.groups))
        for workload in plan.workloads:
            stream = stream_for(plan, workload)
            for router in plan.routers:
                yield run_one(spec, stream, router, hasher=hasher, weights=plan.weights)


def report_table(reports: Sequence[RunReport]) -> str:
    """One row per run; prefill and TTFT p99 also as ratios to hmakv's run of the same stream."""
    baseline = {(r.profile, r.workload): r for r in reports if r.router == "hmakv"}
    lines = [
        "profile                 workload   router               cached  prefill/hmakv  "
        "load_cv  ttft_p50_ms  ttft_p99_ms  p99/hmakv  predicted exact/under/over"
    ]
    for report in reports:
        base = baseline.get((report.profile, report.workload))
        prefill = _ratio(report.prefill_tokens, base.prefill_tokens if base else None)
        p99 = _ratio(report.ttft_p99_s, base.ttft_p99_s if base else None)
        predicted = _shares(report)
        lines.append(
            f"{report.profile:23s} {report.workload:10s} {report.router:20s} "
            f"{report.cached_share:6.1%}  {prefill:>13s}  {report.load_cv:7.3f}  "
            f"{_ms(report.ttft_p50_s):>11s}  {_ms(report.ttft_p99_s):>11s}  {p99:>9s}  "
            f"{predicted:>26s}"
        )
    return "\n".join(lines)


def _shares(report: RunReport) -> str:
    """Predicted hits equal to, below and above the engine's real ones, as shares."""
    if not report.predicted:
        return "n/a"
    figures = (report.predicted_exact, report.predicted_under, report.predicted_over)
    return "/".join(f"{count / report.predicted:.1%}" for count in figures)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}"
