"""deploy/prometheus/: the scrape configuration compose mounts, and its twin for services on
loopback (the demo, tests that run a real Prometheus). promtool, from Debian's `prometheus`
package, has the last word on both. That the targets are compose's services at their listen
ports is checked with the rest of compose in test_compose.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
COMPOSE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
LOCAL_CONFIG = PROMETHEUS_DIR / "prometheus-local.yml"
CONFIGS = (COMPOSE_CONFIG, LOCAL_CONFIG)
JOBS = {"hmakv-bridge", "hmakv-index"}

_DURATION = re.compile(r"(?P<value>\d+)(?P<unit>ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def seconds(duration: str) -> float:
    match = _DURATION.fullmatch(duration)
    assert match, f"not a simple Prometheus duration: {duration!r}"
    return int(match["value"]) * _UNIT_SECONDS[match["unit"]]


def targets(config: dict[str, Any]) -> list[str]:
    return [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]


def on_loopback(config: dict[str, Any]) -> dict[str, Any]:
    """The same configuration with every target's host replaced by 127.0.0.1."""
    jobs = [
        {
            **job,
            "static_configs": [
                {
                    **static,
                    "targets": [
                        "127.0.0.1:" + target.rsplit(":", 1)[1] for target in static["targets"]
                    ],
                }
                for static in job["static_configs"]
            ],
        }
        for job in config["scrape_configs"]
    ]
    return {**config, "scrape_configs": jobs}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, (
        "promtool is not on PATH: install Debian's `prometheus` package "
        "(apt-get install -y prometheus; scripts/setup does it)"
    )
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_config_scrapes_each_hmakv_job_every_5s(path: Path) -> None:
    config = load(path)
    interval = seconds(config["global"]["scrape_interval"])
    assert interval == 5
    assert seconds(config["global"]["scrape_timeout"]) < interval
    names = [job["job_name"] for job in config["scrape_configs"]]
    assert sorted(names) == sorted(JOBS)
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert "scrape_interval" not in job, "every job scrapes at the global interval"
        assert targets({"scrape_configs": [job]}), f"{job['job_name']} has no target"
    for target in targets(config):
        assert re.fullmatch(r"[\w.-]+:\d+", target), target


def test_local_config_is_the_compose_config_on_loopback() -> None:
    compose = load(COMPOSE_CONFIG)
    assert all(not target.startswith("127.") for target in targets(compose))
    assert load(LOCAL_CONFIG) == on_loopback(compose)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_promtool_accepts_the_config(path: Path) -> None:
    result = subprocess.run(
        [promtool(), "check", "config", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_broken_copy(tmp_path: Path) -> None:
    """The check above means something: the same promtool refuses the compose config with a scrape
    timeout longer than its interval."""
    config = load(COMPOSE_CONFIG)
    config["global"]["scrape_timeout"] = "1m"
    broken = tmp_path / "prometheus.yml"
    broken.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [promtool(), "check", "config", str(broken)], capture_output=True, text=True
    )
    assert result.returncode != 0, result.stdout
