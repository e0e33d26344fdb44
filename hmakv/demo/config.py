"""What a demo run starts: the broker choice, the engines and their traffic, where output goes.

Engines get different model profiles on purpose: the point of the demo is that one index answers
correctly for a gpt-oss-like cache (full attention + a 128-token window) and a gemma3-like one
(full attention + five 1024-token windows) at once, where a group-blind index goes wrong.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from hmakv.kafka import cache_dir


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


def engine_lineup(count: int, seed: int) -> tuple[EngineSpec, ...]:
    """``count`` engines named engine-a, engine-b, ..., each with its own profile and seed."""
    if count < MIN_ENGINES:
        raise ValueError(f"the demo needs at least {MIN_ENGINES} engines, got {count}")
    if count > len(ENGINE_LINEUP):
        raise ValueError(f"the demo runs at most {len(ENGINE_LINEUP)} engines, got {count}")
    return tuple(
        EngineSpec(
            name=f"engine-{chr(ord('a') + index)}",
            profile=profile,
            workload=workload,
            seed=seed + index,
            num_blocks=num_blocks,
        )
        for index, (profile, workload, num_blocks) in enumerate(ENGINE_LINEUP[:count])
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

    @property
    def embedded_broker(self) -> EmbeddedBroker | None:
        """The broker to start, or None when ``kafka`` names an existing cluster."""
        try:
            return EmbeddedBroker(self.kafka)
        except ValueError:
            return None
