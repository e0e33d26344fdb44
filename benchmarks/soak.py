"""Soak: the whole pipeline for a long run, its memory sampled, its answers checked throughout.

Runs ``hmakv demo`` (reference engines, the bridge, the index, a broker; probes comparing the
index with the engines all along) for ``--duration`` seconds and samples every service's
resident memory from /proc meanwhile. What a leak or a slow drift would show: memory still
growing after warm-up, probes that stop agreeing, batches lost. The baseline is the run's own
start: each service's RSS at the end against its RSS once warm (after ``--warmup`` of the run),
and the growth per hour past that point.

    python benchmarks/soak.py [--duration 600] [--kafka apache|tansu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import write_report

DEFAULT_JSON = Path(__file__).parent / "results" / "soak.json"
HMAKV = Path(sys.executable).with_name("hmakv")
SERVICES = ("bridge", "index", "engine")  # matched against each process's command line
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc (no psutil here)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def service_rss_mib(root: int) -> dict[str, float]:
    """Resident MiB per service (engines summed), by the hmakv subcommand in each command line."""
    totals: dict[str, float] = {}
    for pid in descendants(root):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except OSError:
            continue
        service = next((s for s in SERVICES if s.encode() in words), None)
        if service is not None:
            totals[service] = totals.get(service, 0.0) + pages * PAGE_KIB / 1024
    return totals


def run(
    duration: float, kafka: str, interval: float
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """The demo's samples, its summary and its exit code."""
    summary_path = Path(tempfile.mkdtemp()) / "summary.json"
    command = [
        *(str(HMAKV), "demo", "--no-model", "--plain", "--interval", "30"),
        *("--duration", str(duration), "--kafka", kafka, "--json", str(summary_path)),
    ]
    demo = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    while demo.poll() is None:
        rss = service_rss_mib(demo.pid)
        if set(rss) == set(SERVICES):  # every service up
            samples.append({"t_s": round(time.monotonic() - started, 1), "rss_mib": rss})
        time.sleep(interval)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return samples, summary, demo.returncode


def growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, float]]:
    warm = [s for s in samples if s["t_s"] >= warmup_s] or samples
    first, last = warm[0], warm[-1]
    hours = max(last["t_s"] - first["t_s"], 1.0) / 3600
    return {
        service: {
            "warm_mib": first["rss_mib"][service],
            "end_mib": last["rss_mib"][service],
            "end_over_warm": last["rss_mib"][service] / first["rss_mib"][service],
            "mib_per_hour": (last["rss_mib"][service] - first["rss_mib"][service]) / hours,
        }
        for service in SERVICES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of probing")
    parser.add_argument("--kafka", default="apache", help="the demo's --kafka")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the baseline")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    args = parser.parse_args()
    samples, summary, code = run(args.duration, args.kafka, args.interval)
    if not samples:
        raise SystemExit(f"no sample: the demo exited {code} before every service was up")
    grown = growth(samples, args.warmup)
    routing, pipeline = summary.get("routing", {}), summary.get("pipeline", {})
    print(f"{'service':8} {'warm':>9} {'end':>9} {'end/warm':>9} {'MiB/hour':>9}")
    for service, g in grown.items():
        print(
            f"{service:8} {g['warm_mib']:8.1f}M {g['end_mib']:8.1f}M "
            f"{g['end_over_warm']:9.3f} {g['mib_per_hour']:9.1f}"
        )
    print(
        f"demo exit {code}, ok {summary.get('ok')}; lost batches {pipeline.get('lost_batches')}, "
        f"HMA agreement {routing.get('hma_agreement')} over "
        f"{routing.get('worker_answers_compared')} answers"
    )
    report = {
        "duration_s": args.duration,
        "kafka": args.kafka,
        "exit_code": code,
        "growth": grown,
        "samples": samples,
        "summary": summary,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()
