"""``hmakv bench``: studies that run the pipeline's parts against their peers' designs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from hmakv.argtypes import (
    add_command,
    bootstrap_servers,
    non_negative_float,
    positive_float,
    positive_int,
)
from hmakv.fleet.scale import (
    SHARED_BLOCKS,
    SHARED_PROMPTS,
    TARGET_WORKERS,
    ScalePlan,
    measure_alone,
    scale_table,
    scale_targets,
)
from hmakv.fleet.services import apache_kafka
from hmakv.fleet.study import (
    FleetPlan,
    FleetSize,
    fleet_table,
    lossless,
    run_fleet,
    targets,
)
from hmakv.producer.engine.profiles import PROFILES
from hmakv.routing.policies import Weights
from hmakv.routing.study import (
    CONTROL_PROFILE,
    ROUTERS,
    STUDY_PROFILES,
    STUDY_WORKLOADS,
    RunReport,
    StudyPlan,
    report_table,
    run_study,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

HELP = (
    "benchmarks: what HMA-aware routing buys a fleet (routing), the pipeline at scale (fleet), "
    "one index at fleet scale (scale)"
)

DESCRIPTION = """\
Studies of the pipeline against the designs it is an alternative to, run in this process.
"""

EPILOG = """\
example:
  hmakv bench routing --smoke
  hmakv bench routing --json benchmarks/results/routing.json
  hmakv bench fleet --json benchmarks/results/fleet.json
  hmakv bench scale --workers 64,1000 --blocks 100000
"""

ROUTING_DESCRIPTION = """\
A fleet of reference engines (vLLM's scheduler and hybrid cache manager, no model; time from a
stated step-cost model, see hmakv/routing/README.md) behind each router in turn, on the same
seeded request stream, engines empty at the start of each run. Routers: hmakv (the HMA-aware
index with llm-d's load scorers), removal-means-gone and full-attention-only (group-blind
indexes fed the same events), approximate (the router's own history, no events), least-loaded,
round-robin. Prints one row per (profile, workload, router) and writes the reports as JSON.
"""


FLEET_DESCRIPTION = """\
Stand-in engines (the producer's own ZMQ publisher each, synthetic steps of 8 events in two
cache groups, no model or scheduler) -> hmakv bridge -> Apache Kafka -> hmakv index, each
service its own process, for each fleet size: a run at a fixed total rate and one as fast as the
engines publish, each until the index applied every step; in the same run each hop alone
(receive and decode, Kafka append, fetch and decode, the index catching up). Prints batches and
block events per second, event age (engine batch to index apply) p50/p99/max, the bridge's and
the index's CPU and peak RSS, loss (every worker's state in the index is checked against what
the engines published), each hop's efficiency and how cost grows with the fleet; exits 1 on any
loss. See hmakv/fleet/README.md.
"""


SCALE_DESCRIPTION = """\
One index in a fresh process of its own, for each number of workers: every worker holds --blocks
blocks in each of two cache groups (full attention and a 128-token window; 16 system prompts
shared by the whole fleet, the rest its own), applied as the bridge's records; then 8k-token
prompts (a system prompt and one worker's conversation) scored as /v1/score scores them, with
and without details; then the score's worst case, a ladder prompt of which worker i of W holds
the first (i+1)/W, so that nearly every worker's hit differs, scored with CPython's default
garbage collector and then, as everything else, with the heap frozen as `hmakv index` freezes
it once caught up; then each prompt asked of the score API in-process as a router asks (lean,
block hashes in msgpack), for every worker and for the best four ("top": 4). Prints the build's
block updates per second, RSS and bytes per resident entry, score p50/p99, the router's answer
p50/p99 and size both ways, and whether each prompt's best worker was the one holding it, each
worker's ladder hit its share and each top answer the whole answer's first.
"""


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
    return counts


_counts.__name__ = "N[,...]"


def _names(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A parser of comma-separated names, each one of ``known``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or 'empty list'}; from {', '.join(known)}"
            )
        return names

    return parse


_profiles = _names((*PROFILES, CONTROL_PROFILE))
_profiles.__name__ = "PROFILE[,...]"
_workloads = _names(STUDY_WORKLOADS)
_workloads.__name__ = "WORKLOAD[,...]"
_routers = _names(ROUTERS)
_routers.__name__ = "ROUTER[,...]"


def register(parser: argparse.ArgumentParser) -> None:
    studies = parser.add_subparsers(dest="bench_study", metavar="STUDY", required=True)
    routing = add_command(
        studies,
        "routing",
        help="every router on the same request streams: cached tokens, prefill, TTFT",
        description=ROUTING_DESCRIPTION,
        parent="bench",
    )
    add = routing.add_argument
    add("--profiles", type=_profiles, default=STUDY_PROFILES, help="cache layouts to study")
    add("--workloads", type=_workloads, default=STUDY_WORKLOADS, help="request streams")
    add("--routers", type=_routers, default=ROUTERS, help="routers to compare")
    add("--engines", type=positive_int, default=8, help="engines in the fleet")
    add("--duration", type=positive_float, default=30.0, help="seconds of arrivals per run")
    add("--rate-scale", type=positive_float, default=1.0, help="multiplies every stream's rate")
    add(
        "--pool-fraction",
        type=positive_float,
        default=0.5,
        help="each engine's block pool as a fraction of its profile's",
    )
    add("--prefix-weight", type=non_negative_float, default=3.0, help="llm-d's prefix scorer")
    add("--queue-weight", type=non_negative_float, default=2.0, help="llm-d's queue scorer")
    add("--kv-weight", type=non_negative_float, default=2.0, help="llm-d's KV-usage scorer")
    add("--prefill-factor", type=positive_float, default=1.0, help="scales the prefill cost")
    add(
        "--event-lag",
        type=non_negative_float,
        default=0.02,
        help="seconds from a step's end to its events reaching the routers",
    )
    add("--seed", type=int, default=0, help="seeds workloads, arrivals and tie breaks")
    add(
        "--smoke",
        action="store_true",
        help="a few seconds: gpt-oss-like and the control, agentic and burst",
    )
    add("--json", type=Path, help="write the reports here as JSON")
    routing.set_defaults(func=run_routing)
    _register_fleet(studies)
    _register_scale(studies)


def _register_fleet(studies: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fleet = add_command(
        studies,
        "fleet",
        help="engines -> bridge -> Kafka -> index end to end, each hop beside its ceiling",
        description=FLEET_DESCRIPTION,
        parent="bench",
    )
    add = fleet.add_argument
    add("--engines", type=_counts, default=FleetPlan.engine_counts, help="fleet sizes to run")
    add("--rate", type=positive_float, default=FleetPlan.rate, help="fixed total batches/s")
    add("--duration", type=positive_float, default=FleetPlan.duration_s, help="seconds per run")
    add(
        "--no-max-rate",
        action="store_true",
        help="only the fixed-rate runs: no max-rate run, no hop alone",
    )
    add(
        "--kafka",
        type=bootstrap_servers,
        metavar="HOST:PORT[,...]",
        help="an Apache Kafka to use (default: start one from its jars)",
    )
    add("--smoke", action="store_true", help="4 engines, 500 batches/s, 2 s: correctness only")
    add("--json", type=Path, help="write the report here as JSON")
    fleet.set_defaults(func=run_fleet_study)


def _register_scale(studies: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    scale = add_command(
        studies,
        "scale",
        help="one index at fleet scale: memory and score latency at 1,000 workers",
        description=SCALE_DESCRIPTION,
        parent="bench",
    )
    add = scale.add_argument
    add("--workers", type=_counts, default=(64, TARGET_WORKERS), help="fleet sizes, in order")
    add(
        "--blocks",
        type=positive_int,
        default=ScalePlan.blocks,
        help=f"resident blocks per worker and group (at least {SHARED_PROMPTS * SHARED_BLOCKS:,}"
        " + 3 prompts')",
    )
    add("--prompts", type=positive_int, default=ScalePlan.prompts, help="prompts scored")
    add("--smoke", action="store_true", help="16 and 64 workers x 4,096 blocks: correctness only")
    add("--json", type=Path, help="write the reports here as JSON")
    scale.set_defaults(func=run_scale_study)


def run_scale_study(args: argparse.Namespace) -> int:
    workers, blocks = ((16, 64), 4096) if args.smoke else (args.workers, args.blocks)
    if blocks < SHARED_PROMPTS * SHARED_BLOCKS + 3 * ScalePlan.prompt_blocks:
        print(
            f"--blocks {blocks}: too few for the system prompts, the ladder and a prompt",
            file=sys.stderr,
        )
        return EXIT_USAGE
    reports = []
    for count in workers:
        reports.append(measure_alone(ScalePlan(count, blocks, args.prompts)))
        print(f"{count} workers: done", file=sys.stderr)
    print(scale_table(reports))
    met = scale_targets(reports)
    _report_targets(met, args.json, {"reports": [dataclasses.asdict(r) for r in reports]})
    right = all(
        r.best_hits_right == r.prompts and r.ladder.right and r.ladder_default_gc.right
        for r in reports
    )
    return EXIT_OK if right else EXIT_FAILED


def fleet_plan_of(args: argparse.Namespace) -> FleetPlan:
    if args.smoke:
        return FleetPlan(engine_counts=(4,), rate=500.0, duration_s=2.0)
    return FleetPlan(
        engine_counts=args.engines,
        rate=args.rate,
        duration_s=args.duration,
        max_rate=not args.no_max_rate,
    )


def run_fleet_study(args: argparse.Namespace) -> int:
    plan = fleet_plan_of(args)
    sizes: list[FleetSize] = []
    with apache_kafka(args.kafka) as bootstrap:
        for size in run_fleet(plan, bootstrap):
            sizes.append(size)
            print(f"{size.engines} engines: done", file=sys.stderr)
    print(fleet_table(sizes))
    met = targets(sizes)
    report = {"plan": dataclasses.asdict(plan), "sizes": [dataclasses.asdict(s) for s in sizes]}
    _report_targets(met, args.json, report)
    return EXIT_OK if lossless(sizes) else EXIT_FAILED


def plan_of(args: argparse.Namespace) -> StudyPlan:
    plan = StudyPlan(
        profiles=args.profiles,
        workloads=args.workloads,
        routers=args.routers,
        engines=args.engines,
        duration_s=args.duration,
        rate_scale=args.rate_scale,
        pool_fraction=args.pool_fraction,
        weights=Weights(args.prefix_weight, args.queue_weight, args.kv_weight),
        prefill_factor=args.prefill_factor,
        event_lag=args.event_lag,
        seed=args.seed,
    )
    if args.smoke:
        plan = dataclasses.replace(
            plan,
            profiles=("gpt-oss-like", "full-attention-control"),
            workloads=("agentic", "burst"),
            duration_s=3.0,
        )
    return plan


def _report_targets(met: dict[str, bool], path: Path | None, report: Mapping[str, object]) -> None:
    """Print the targets met and missed; write the report with them to ``path``, if given."""
    print("targets:", "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in met.items()))
    if path is not None:
        command = " ".join(["hmakv", *sys.argv[1:]])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"command": command, **report, "targets": met}, indent=2) + "\n")


def run_routing(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    reports: list[RunReport] = []
    for report in run_study(plan):
        reports.append(report)
        print(f"{report.profile} {report.workload} {report.router}: done", file=sys.stderr)
    print(report_table(reports))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_as_json(plan, reports), indent=2) + "\n")
    return EXIT_OK


def _as_json(plan: StudyPlan, reports: list[RunReport]) -> dict[str, object]:
    return {
        "command": " ".join(["hmakv", *sys.argv[1:]]),
        "plan": dataclasses.asdict(plan),
        "runs": [dataclasses.asdict(report) for report in reports],
    }
