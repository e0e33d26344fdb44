"""What a demo run starts: the broker choice, the engines and their traffic, where output goes.

Engines get different model profiles on purpose: the point of the demo is that one index answers
correctly for a gpt-oss-like cache (full attention + a 128-token window) and a gemma3-like one
(full attention + five 1024-token windows) at once, where a group-blind index goes wrong.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from hmakv.kafka import cache_dir
from hmakv.producer.engine.profiles import PROFILES
from hmakv.producer.engine.workloads import WORKLOADS


class EmbeddedBroker(StrEnum):
    """A broker the demo starts itself (anything else given to ``--kafka`` is a bootstrap)."""

    TANSU = "tansu"
    APACHE = "apache"


@dataclass(frozen=True)
class EngineSpec:
    """One reference engine: its worker name, cache layout and background traffic."""

    name: str
    profile: str
    workload: str
    seed: int
    num_blocks: int | None = None
    """A smaller pool than the profile's, so the cache fills and evicts within a short run."""
    hmakv_publisher: bool = False
    """A real vLLM server publishing through hmakv's publisher (the plugin) instead of its own."""


# The first two are the pair; more engines cycle through further layouts. Pools are
# sized so that evictions, and with them sliding-window blocks gone while full-attention blocks
# stay, begin within seconds at the demo's request rates.
ENGINE_LINEUP: tuple[tuple[str, str, int | None], ...] = (
    ("gpt-oss-like", "chat", 512),
    ("gemma3-like", "documents", 2048),
    ("swa-small", "chat", None),
    ("mamba-hybrid-like", "documents", 512),
    ("chunked-local-like", "chat", 512),
    ("mixed-block-like", "documents", 512),
)
MIN_ENGINES = 2
MAX_ENGINES = len(ENGINE_LINEUP)
MIN_POOL_BLOCKS = 16


def engine_lineup(count: int, seed: int) -> tuple[EngineSpec, ...]:
    """``count`` engines named engine-a, engine-b, ..., each with its own profile and seed."""
    if count < MIN_ENGINES:
        raise ValueError(f"the demo needs at least {MIN_ENGINES} engines, got {count}")
    if count > MAX_ENGINES:
        raise ValueError(f"the demo runs at most {MAX_ENGINES} engines, got {count}")
    return chosen_engines(ENGINE_LINEUP[:count], seed)


ENGINE_WORKLOADS = tuple(w for w in WORKLOADS if w != "none")
"""What ``--engine`` accepts: a workload with traffic (the probe draws its prompts from them)."""

POOL_SIZES: dict[str, int | None] = {profile: blocks for profile, _, blocks in ENGINE_LINEUP}
"""The demo's pool size per profile, whichever workload the engine runs."""


EngineChoice = tuple[str, str, int | None]
"""What ``--engine`` names: profile, workload and pool size (None: the demo's for the profile)."""


def parse_engine(text: str) -> EngineChoice:
    """``PROFILE:WORKLOAD[:BLOCKS]`` as ``--engine`` takes it; ValueError names what is wrong."""
    parts = text.strip().split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"engine {text!r}: expected PROFILE:WORKLOAD[:BLOCKS]")
    profile, workload = parts[:2]
    if profile not in PROFILES:
        raise ValueError(f"engine {text!r}: unknown profile (one of {', '.join(PROFILES)})")
    if workload not in ENGINE_WORKLOADS:
        raise ValueError(
            f"engine {text!r}: unknown workload (one of {', '.join(ENGINE_WORKLOADS)})"
        )
    if len(parts) == 2:
        return profile, workload, None
    blocks = parts[2]
    if not blocks.isdigit() or int(blocks) < MIN_POOL_BLOCKS:
        raise ValueError(f"engine {text!r}: BLOCKS must be a whole number >= {MIN_POOL_BLOCKS}")
    return profile, workload, int(blocks)


def chosen_engines(choices: Sequence[EngineChoice], seed: int) -> tuple[EngineSpec, ...]:
    """Engines named engine-a, engine-b, ... with the given profiles, workloads and pool sizes
    (the demo's for the profile where None), each with its own seed."""
    if len(choices) < MIN_ENGINES:
        raise ValueError(f"the demo needs at least {MIN_ENGINES} engines, got {len(choices)}")
    if len(choices) > MAX_ENGINES:
        raise ValueError(f"the demo runs at most {MAX_ENGINES} engines, got {len(choices)}")
    return tuple(
        _nth_engine(
            index, seed, profile, workload, POOL_SIZES[profile] if blocks is None else blocks
        )
        for index, (profile, workload, blocks) in enumerate(choices)
    )


def _nth_engine(
    index: int,
    seed: int,
    profile: str,
    workload: str,
    num_blocks: int | None,
    hmakv_publisher: bool = False,
) -> EngineSpec:
    """A line-up's engine ``index``: named engine-a, engine-b, ..., seeded ``seed + index``."""
    return EngineSpec(
        name=f"engine-{chr(ord('a') + index)}",
        profile=profile,
        workload=workload,
        seed=seed + index,
        num_blocks=num_blocks,
        hmakv_publisher=hmakv_publisher,
    )


VLLM = "vllm"
"""What ``--engine`` takes for the real-vLLM line-up instead of reference engines."""

VLLM_LINEUP: tuple[tuple[str, bool], ...] = (
    ("gemma3-swa64", False),
    ("qwen3next-gdn3", True),
)
"""Real vLLM servers: a sliding-window hybrid (Gemma 3) and a mamba hybrid (Qwen3-Next, gated
delta-net layers), the second one publishing through hmakv's plugin."""


def vllm_lineup(seed: int) -> tuple[EngineSpec, ...]:
    """engine-a, engine-b: real vLLM servers with the ``VLLM_LINEUP`` profiles and pools."""
    from hmakv.vllm.profiles import PROFILES

    return tuple(
        _nth_engine(index, seed, profile, VLLM, PROFILES[profile].num_gpu_blocks, hmakv_publisher)
        for index, (profile, hmakv_publisher) in enumerate(VLLM_LINEUP)
    )


KEPT_RUNS = 10


def default_workdir() -> Path:
    """A fresh directory per run under the cache dir, so logs outlive the run and never clash;
    only the newest ``KEPT_RUNS`` earlier runs are kept."""
    runs = cache_dir() / "demo"
    earlier = sorted(runs.glob("run-*")) if runs.is_dir() else []
    for old in earlier[: max(0, len(earlier) - KEPT_RUNS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return runs / time.strftime("run-%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class DemoConfig:
    """Everything ``hmakv demo`` can set; defaults are the command's defaults."""

    duration_s: float = 60.0
    kafka: str = EmbeddedBroker.TANSU
    use_model: bool = True
    engines: tuple[EngineSpec, ...] = field(default_factory=lambda: engine_lineup(2, 0))
    seed: int = 0
    engine_rate: float = 4.0
    """Each engine's own workload, requests per second, on top of what the probe routes."""
    probe_pause_s: float = 0.02
    """Pause between probes: leaves CPU to the pipeline on small machines."""
    workdir: Path = field(default_factory=default_workdir)
    json_path: Path | None = None
    report_dir: Path | None = None
    refresh: bool = False
    """A refreshing view (a TTY) instead of one plain line per ``interval_s``."""
    interval_s: float = 5.0
    sample_interval_s: float = 1.0
    real_vllm: bool = False
    """The engines are real vLLM servers (``--engine vllm``), probed with real requests."""

    @property
    def embedded_broker(self) -> EmbeddedBroker | None:
        """The broker to start, or None when ``kafka`` names an existing cluster."""
        try:
            return EmbeddedBroker(self.kafka)
        except ValueError:
            return None
