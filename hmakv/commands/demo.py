"""``hmakv demo``: the whole pipeline on this machine, checked against the engines as it runs.

Wiring only: flags into a ``DemoConfig``; the run itself is ``hmakv.demo.run``, imported when
the command runs so that other subcommands never pay for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hmakv.argtypes import add_seconds, positive_float

if TYPE_CHECKING:
    from hmakv.demo.config import EngineSpec

EXIT_BAD_USAGE = 2

HELP = "run engines, bridge, index and a probing router on an embedded broker; summarise"

DESCRIPTION = """\
Start an embedded Kafka broker (or use yours), reference engines with different hybrid
KV-cache layouts, the bridge and the index, each as its own `hmakv` process on free loopback
ports; then route prompts with a probe client that asks /v1/score where to go and checks every
answer against the engine's real prefix hit. Live progress while it runs; at the end a summary
(zero loss, HMA-aware vs group-blind agreement, event age), optionally as JSON and as a report
with plots."""

EPILOG = """\
Exit codes: 0 the run passed its checks (no event lost, the HMA-aware index agreed with every
engine answer it was compared with), 1 it did not or a service failed, 2 bad usage, 130
interrupted while starting. Ctrl-C during the run ends it early with the summary; a second
Ctrl-C skips waiting for the last events.

examples:
  hmakv demo                                  # 60 s on Tansu, engines with their torch model
  hmakv demo --duration 20 --no-model --json out/summary.json --report out/report
  hmakv demo --kafka apache                   # Apache Kafka 4 (KRaft), needs Java
  hmakv demo --kafka 127.0.0.1:9092           # an existing cluster (its own topics, removed)
  hmakv demo --engine vllm                    # two real vLLM servers (scripts/setup-vllm)"""


def _engine_count(text: str) -> int:
    value = int(text)
    if not 2 <= value <= 6:
        raise ValueError(text)
    return value


def _kafka(text: str) -> str:
    if text in ("tansu", "apache"):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(text)
    return text


def _engine_choices(text: str) -> list[tuple[str, str, int | None] | str]:
    """One --engine, or several separated by commas (as one HMAKV_DEMO_ENGINE holds them)."""
    return [_engine_choice(part) for part in text.split(",") if part.strip()]


def _engine_choice(text: str) -> tuple[str, str, int | None] | str:
    from hmakv.demo.config import VLLM, parse_engine

    if text.strip() == VLLM:
        return VLLM
    try:
        return parse_engine(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_engine_count.__name__ = "engine count (2 to 6)"
_kafka.__name__ = "tansu, apache or HOST:PORT"


def register(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add_seconds(parser, "--duration", "seconds of probing once everything is up", default="60")
    add(
        "--kafka",
        type=_kafka,
        default="tansu",
        metavar="tansu|apache|HOST:PORT",
        help="tansu or apache: start that broker; HOST:PORT: use that cluster",
    )
    add(
        "--no-model",
        action="store_true",
        help="engines without their torch model (default: with it when torch is installed)",
    )
    _add_engine_options(parser.add_mutually_exclusive_group())
    add(
        "--rate",
        type=positive_float,
        default="4",
        metavar="PER_SECOND",
        help="each engine's own background requests per second",
    )
    add("--seed", type=int, default="0", help="seed of workloads and probes")
    _add_output_options(parser)
    parser.set_defaults(func=run)


def _add_engine_options(group: argparse._MutuallyExclusiveGroup) -> None:
    group.add_argument(
        "--engines",
        type=_engine_count,
        default="2",
        metavar="N",
        help="how many engines, each with another cache layout (2: gpt-oss-like and gemma3-like)",
    )
    group.add_argument(
        "--engine",
        dest="engine_choices",
        action="extend",
        type=_engine_choices,
        metavar="PROFILE:WORKLOAD[:BLOCKS]|vllm",
        help="run an engine with this profile, workload and pool size (default: the demo's for "
        "the profile) instead of the --engines line-up; repeat for each engine, 2 to 6, or "
        "separate them by commas; 'vllm' alone: two real vLLM servers (scripts/setup-vllm "
        "first) probed with real requests",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="where the services' logs go (default: a new directory under "
        "$HMAKV_CACHE_DIR/demo, kept after the run)",
    )
    add("--json", type=Path, metavar="PATH", help="write the summary here")
    add("--report", type=Path, metavar="DIR", help="write report.html and PNG plots here")
    add("--plain", action="store_true", help="plain progress lines even on a terminal")
    add_seconds(parser, "--interval", "seconds between plain progress lines", default="5")


def engines_of(args: argparse.Namespace) -> tuple[EngineSpec, ...]:
    """The engines asked for: --engine's, else the --engines line-up."""
    from hmakv.demo.config import engine_lineup

    if args.engine_choices:
        return _chosen(args.engine_choices, args.seed)
    return engine_lineup(args.engines, args.seed)


def _chosen(choices: list[tuple[str, str, int | None] | str], seed: int) -> tuple[EngineSpec, ...]:
    from hmakv.demo.config import VLLM, chosen_engines, vllm_lineup

    if VLLM in choices:
        if len(choices) > 1:
            raise ValueError("--engine vllm is the whole line-up: give it alone")
        return vllm_lineup(seed)
    return chosen_engines([c for c in choices if not isinstance(c, str)], seed)


def run(args: argparse.Namespace) -> int:
    from hmakv.demo.config import VLLM, DemoConfig, default_workdir
    from hmakv.demo.run import run_demo

    try:
        engines = engines_of(args)
    except ValueError as error:
        print(f"hmakv demo: {error}", file=sys.stderr)
        return EXIT_BAD_USAGE
    config = DemoConfig(
        duration_s=args.duration,
        kafka=args.kafka,
        use_model=not args.no_model,
        engines=engines,
        seed=args.seed,
        engine_rate=args.rate,
        workdir=args.workdir or default_workdir(),
        json_path=args.json,
        report_dir=args.report,
        refresh=sys.stdout.isatty() and not args.plain,
        interval_s=args.interval,
        real_vllm=any(spec.workload == VLLM for spec in engines),
    )
    return run_demo(config)
