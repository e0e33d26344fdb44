"""The summary's routing comparison: what each router would have made of this run's traffic.

The demo routes with hmakv's index alone. Afterwards the prompts the probe routed, at the
offsets it routed them, are replayed behind every router of the routing study
(``hmakv.routing.replay``) on a simulated fleet per engine layout of the run: ``FLEET_ENGINES``
empty engines with that engine's profile and pool, on the study's cost model, each serving its
own background traffic as the run's engine did (its workload at ``--engine-rate``: the first
with the engine's very seed, the others with seeds of their own), which fills and evicts their
caches. Only the routed prompts are reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from hmakv.demo.config import EngineSpec
from hmakv.demo.probe import ROUTED_MAX_TOKENS
from hmakv.demo.prompts import sized
from hmakv.producer.engine.profiles import ModelProfile
from hmakv.producer.engine.runner import context_tokens
from hmakv.producer.engine.workloads import ArrivalSchedule, make_workload
from hmakv.routing.cluster import Background, arrival_times
from hmakv.routing.replay import RecordedPrompt, replay
from hmakv.routing.study import ROUTERS, RunReport

FLEET_ENGINES = 4
"""Engines per simulated fleet: enough for a choice to matter, few enough to take seconds."""
SEED_STRIDE = 1000
"""Between the background seeds of a fleet's engines (the run's engines are seeded 0, 1, ...)."""


class FleetComparison(msgspec.Struct, kw_only=True):
    """Every router on one simulated fleet: engines of one of the run's layouts."""

    profile: str
    num_blocks: int
    engines: int
    runs: list[RunReport]


class RoutingComparison(msgspec.Struct, kw_only=True):
    prompts: int
    """The routed prompts replayed (the probe keeps the first ``MAX_RECORDED_PROMPTS``)."""
    fleets: list[FleetComparison]
    source: str


def compare_routers(
    engines: Sequence[EngineSpec], traffic: Sequence[RecordedPrompt], engine_rate: float
) -> RoutingComparison:
    """Every router on the traffic, once per distinct (profile, pool) among the engines."""
    layouts = {(spec.profile, spec.num_blocks): spec for spec in engines}
    span = traffic[-1].at_s - traffic[0].at_s if traffic else 0.0
    return RoutingComparison(
        prompts=len(traffic),
        fleets=[_fleet(spec, traffic, engine_rate, span) for spec in layouts.values()],
        source=(
            f"the probe's routed prompts replayed at their offsets behind each of "
            f"{', '.join(ROUTERS)} on {FLEET_ENGINES} simulated engines per layout, each with "
            f"its own traffic at {engine_rate:g} requests/s (hmakv bench routing's cost model)"
        ),
    )


def _fleet(
    spec: EngineSpec, traffic: Sequence[RecordedPrompt], engine_rate: float, span: float
) -> FleetComparison:
    profile = sized(spec)

    def background() -> list[Background]:
        return [_background(spec, profile, n, engine_rate, span) for n in range(FLEET_ENGINES)]

    runs = (
        replay(
            profile,
            traffic,
            engines=FLEET_ENGINES,
            max_tokens=ROUTED_MAX_TOKENS,
            background=background,
        )
        if traffic
        else []
    )
    return FleetComparison(
        profile=profile.name, num_blocks=profile.num_blocks, engines=FLEET_ENGINES, runs=runs
    )


def _background(
    spec: EngineSpec, profile: ModelProfile, engine: int, rate: float, span: float
) -> Background:
    """Engine ``engine``'s own traffic, made as ``hmakv engine`` makes the run's."""
    seed = spec.seed + SEED_STRIDE * engine
    workload = make_workload(
        spec.workload,
        seed=seed,
        vocab_size=profile.dims.vocab_size,
        context_tokens=context_tokens(profile),
    )
    arrivals = arrival_times(ArrivalSchedule(rate, seed=seed, duration=span)) if span else []
    return Background(engine, workload, arrivals)
