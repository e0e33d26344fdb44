"""What hmakv's publisher costs real vLLM: step time and requests/s against vLLM's own publisher.

Real vLLM 0.32 (CPU, ``scripts/setup-vllm``) serves the tiny hybrid model ``gemma3-swa64`` with
KV events on, once with vLLM's own ``"zmq"`` publisher and once with hmakv's (the vLLM plugin,
``hmakv vllm serve --hmakv-publisher``). Both get the same workload: seeded prompts from
``hmakv.vllm.workload.VllmPrompts`` (warm-up prompts first, then a fixed number of measured ones),
sent by ``--concurrency`` closed-loop clients, ``max_tokens`` greedy tokens each, so that most
engine steps are decode steps with a few prefills mixed in, as in serving.

Rounds interleave the sides: vLLM, hmakv, vLLM, hmakv, ... (``--rounds`` of each). Every round
starts a fresh server and stops it at the end, rather than keeping one server per side, because:
(a) the machine allows one vLLM server at a time (2 cores: two engines would compete for them,
and an idle engine still costs memory); (b) a fresh server starts from an empty prefix cache, so
every round of both sides does exactly the same work (the same stores, hits and evictions),
which the event counts show; a reused server would start each round with the previous round's
cache. The price is a ~50 s start per round, spent outside the measurement.

Step time: vLLM 0.32 exports no per-step duration on ``/metrics`` (``vllm:iteration_tokens_total``
counts tokens per step; ``--enable-logging-iteration-details`` times only the forward pass, not
the scheduler's ``update_from_output`` where the KV events are published). The most direct
measure is ``vllm:inter_token_latency_seconds``: for a decoding request, the difference between
the engine-core timestamps of two consecutive outputs, i.e. the whole engine loop of one step
(schedule, forward, ``update_from_output`` with ``publish()``, output hand-off), and any GIL time
the publisher thread takes from the engine thread. Each run reports its mean (the histogram's
sum/count difference over the run: the buckets, 10 ms wide at the low end, are too coarse for a
median); ``wall / vllm:iteration_tokens_total_count`` (the step period, idle gaps included) is a
cross-check. Per side the table shows the median over rounds. So does the CPU time of the
engine-core process (``/proc``), over the run and while idle before it: the publisher's thread
lives there and shares the GIL with the scheduler, so this is where its cost shows first.

Events: a SUB socket on each server's events port, connected before the warm-up, keeps the
measured run's batches (the engine is idle, publishing nothing, between warm-up and run); the
table shows batches, events and lost seqs per round, which must match across sides. After each
run the script also checks the plugin: the ``replaces vLLM's 'zmq' publisher`` log line, what
seq 0 carries (a replay from 0) and how a snapshot request is answered.

    python benchmarks/vllm_publisher.py [--json PATH] [--rounds N] [--requests N] [--quick]

Defaults: 4 rounds per side, 8 warm-up and 120 measured requests per run, 4 concurrent,
``max_tokens`` 16; about 10 minutes, mostly server starts. ``--quick`` (one round per side, 24
requests) takes about two.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq
from harness import write_report

from hmakv.kafka.process import LOOPBACK, free_port
from hmakv.producer import events as wire
from hmakv.producer import protocol
from hmakv.producer.protocol import END_SEQ_FRAME, SNAPSHOT_REQUEST, decode_seq
from hmakv.vllm.server import DEFAULT_TOPIC, SERVED_MODEL_NAME
from hmakv.vllm.workload import VllmPrompts

DEFAULT_JSON = Path(__file__).parent / "results" / "vllm_publisher.json"
HMAKV_BIN = Path(sys.executable).parent / "hmakv"
PROFILE = "gemma3-swa64"
SIDES = ("vllm", "hmakv")
PLUGIN_LOG_LINE = "hmakv's KV-event publisher replaces vLLM's 'zmq' publisher"
ITL = "vllm:inter_token_latency_seconds"
ITERATIONS = "vllm:iteration_tokens_total"
START_TIMEOUT_S = 300.0
IDLE_WINDOW_S = 3.0  # how long the idle engine core's CPU use is measured
QUIET_S = 0.5  # no batch for this long after the last response: the step's events are all in
REQUEST_TIMEOUT_S = 120.0
PROMPT_LIMIT = 1000  # + max_tokens stays under the profile's max-model-len (1024)
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class Settings:
    rounds: int
    requests: int
    warmup: int
    concurrency: int
    max_tokens: int
    seed: int


@dataclass
class Round:
    """One server's measured run."""

    side: str
    round: int
    start_s: float
    wall_s: float
    req_per_s: float
    step_ms: float  # mean inter-token latency: the engine loop of one step
    step_period_ms: float  # wall / iterations, idle gaps included
    engine_cpu_s: float  # CPU the engine-core process used during the run
    idle_engine_cpu_pct: float  # its CPU while idle, before the warm-up
    iterations: int
    itl_samples: int
    generated_tokens: int
    cached_tokens: int
    batches: int
    events: int
    event_types: dict[str, int]
    blocks_stored: int
    blocks_removed: int
    lost_seqs: int
    checks: dict[str, Any] = field(default_factory=dict)


# --- a server -------------------------------------------------------------------------------------


class Server:
    """``hmakv vllm serve`` in its own process group, stopped with the group."""

    def __init__(self, side: str, log: Path) -> None:
        self.side = side
        self.log = log
        self.api, self.events, self.replay = free_port(), free_port(), free_port()
        argv = [
            str(HMAKV_BIN), "vllm", "serve", "--profile", PROFILE,
            "--port", str(self.api), "--events-port", str(self.events),
            "--replay-port", str(self.replay),
        ]  # fmt: skip
        if side == "hmakv":
            argv.append("--hmakv-publisher")
        env = {k: v for k, v in os.environ.items() if k != "HMAKV_VLLM_PUBLISHER"}
        with log.open("wb") as out:
            self._process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def pgid(self) -> int:
        return self._process.pid  # start_new_session: the leader's pid is the group's id

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.api}"

    def wait_healthy(self) -> float:
        started = time.monotonic()
        while time.monotonic() - started < START_TIMEOUT_S:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.side} server exited at start; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.side} server not healthy in {START_TIMEOUT_S:g} s; {self.log}")

    def stop(self) -> None:
        """SIGTERM to the group (vLLM's API server stops its engine core), SIGKILL if stuck."""
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGTERM)
                self._process.wait(30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        with contextlib.suppress(ProcessLookupError):  # the group's stragglers (engine, worker)
            os.killpg(self._process.pid, signal.SIGKILL)


def engine_core_cpu_s(server: Server) -> float:
    """CPU seconds (user + system) the server's engine-core process has used: the process where
    the scheduler, and so the publisher and its thread, run (``VLLM::EngineCore``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the comm: state ppid pgrp ... utime (14th field of stat) stime (15th)
        if comm.startswith("VLLM::EngineCor") and int(fields[2]) == server.pgid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def metrics(server: Server) -> dict[str, float]:
    """``/metrics`` summed over label sets, histogram buckets keyed ``name_bucket|le``."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        if name.endswith("_bucket") and labels:
            le = re.search(r'le="([^"]+)"', labels)
            name = f"{name}|{le.group(1) if le else ''}"
        values[name] += float(value)
    return values


def complete(server: Server, prompt: tuple[int, ...], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        usage: dict[str, Any] = json.loads(reply.read())["usage"]
    return usage


def send_all(server: Server, prompts: list[tuple[int, ...]], settings: Settings) -> list[Any]:
    """Closed loop: ``concurrency`` clients, each sends its next prompt when one completes."""
    with ThreadPoolExecutor(settings.concurrency) as pool:
        return list(pool.map(lambda p: complete(server, p, settings.max_tokens), prompts))


# --- the events -----------------------------------------------------------------------------------


class EventTap:
    """A SUB socket on the events port; frames are kept raw and decoded after the run."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.set_hwm(0)
        self._sub.connect(f"tcp://{LOOPBACK}:{port}")
        self._sub.subscribe(b"")
        self._frames: list[list[bytes]] = []
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._running:
            if self._sub.poll(50):
                frames = self._sub.recv_multipart()
                with self._lock:
                    self._frames.append(frames)
                    self._last = time.monotonic()

    def wait_quiet(self) -> None:
        """Until no batch has come for QUIET_S: the engine is idle and its events are all in."""
        while True:
            with self._lock:
                quiet = time.monotonic() - self._last
            if quiet >= QUIET_S:
                return
            time.sleep(QUIET_S - quiet)

    def take(self) -> list[list[bytes]]:
        with self._lock:
            frames, self._frames = self._frames, []
        return frames

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self._sub.close()


def count_events(frames: list[list[bytes]]) -> dict[str, Any]:
    types: collections.Counter[str] = collections.Counter()
    stored = removed = 0
    seqs = []
    for _topic, seq, payload in frames:
        seqs.append(decode_seq(seq))
        for event in wire.decode(payload).batch.events:
            types[type(event).__name__] += 1
            if isinstance(event, wire.BlockStored):
                stored += len(event.block_hashes)
            elif isinstance(event, wire.BlockRemoved):
                removed += len(event.block_hashes)
    lost = (max(seqs) - min(seqs) + 1 - len(set(seqs))) if seqs else 0
    return {
        "batches": len(frames),
        "events": sum(types.values()),
        "event_types": dict(sorted(types.items())),
        "blocks_stored": stored,
        "blocks_removed": removed,
        "lost_seqs": lost,
    }


def replay_request(ctx: zmq.Context[zmq.Socket[bytes]], port: int, start: int) -> list[Any]:
    """A DEALER request as the bridge sends it; (seq, event types) per reply batch, up to the
    first 3, then "END" if the end marker came."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{LOOPBACK}:{port}")
    dealer.send_multipart(protocol.replay_request(start))
    replies: list[Any] = []
    try:
        while dealer.poll(10_000):
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ_FRAME:
                replies.append("END")
                break
            if len(replies) < 3:
                names = [type(e).__name__ for e in wire.decode(frames[3]).batch.events]
                replies.append([decode_seq(frames[2]), names[:4]])
    finally:
        dealer.close()
    return replies


def plugin_checks(ctx: zmq.Context[zmq.Socket[bytes]], server: Server, log: Path) -> dict[str, Any]:
    text = log.read_text(errors="replace")
    seq0 = replay_request(ctx, server.replay, 0)
    snapshot = replay_request(ctx, server.replay, SNAPSHOT_REQUEST)
    return {
        "plugin_log_line": PLUGIN_LOG_LINE in text,
        "seq0": seq0[0] if seq0 else None,
        "seq0_all_blocks_cleared": bool(seq0)
        and seq0[0] != "END"
        and seq0[0][0] == 0
        and seq0[0][1] == ["AllBlocksCleared"],
        "snapshot_reply": snapshot,
        "snapshot_offered": bool(snapshot) and snapshot[0] != "END",
    }


# --- a round --------------------------------------------------------------------------------------


def run_round(side: str, index: int, settings: Settings, workdir: Path) -> Round:
    log = workdir / f"{side}-{index}.log"
    prompts_source = VllmPrompts(settings.seed, max_tokens=PROMPT_LIMIT)
    prompts = [prompts_source.next_prompt() for _ in range(settings.warmup + settings.requests)]
    server = Server(side, log)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        start_s = server.wait_healthy()
        time.sleep(1.0)  # the engine settles after /health answers
        idle_cpu = engine_core_cpu_s(server)
        time.sleep(IDLE_WINDOW_S)
        idle_cpu = engine_core_cpu_s(server) - idle_cpu
        tap = EventTap(ctx, server.events)
        try:
            send_all(server, prompts[: settings.warmup], settings)
            tap.wait_quiet()
            tap.take()
            before = metrics(server)
            cpu_before = engine_core_cpu_s(server)
            started = time.perf_counter()
            usages = send_all(server, prompts[settings.warmup :], settings)
            wall = time.perf_counter() - started
            engine_cpu = engine_core_cpu_s(server) - cpu_before
            tap.wait_quiet()
            after = metrics(server)
            counted = count_events(tap.take())
        finally:
            tap.close()
        checks = plugin_checks(ctx, server, log)
    finally:
        ctx.destroy(linger=0)
        server.stop()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    itl_count = delta(f"{ITL}_count")
    iterations = delta(f"{ITERATIONS}_count")
    return Round(
        side=side,
        round=index,
        start_s=start_s,
        wall_s=wall,
        req_per_s=settings.requests / wall,
        step_ms=1000 * delta(f"{ITL}_sum") / itl_count if itl_count else float("nan"),
        step_period_ms=1000 * wall / iterations if iterations else float("nan"),
        engine_cpu_s=engine_cpu,
        idle_engine_cpu_pct=100 * idle_cpu / IDLE_WINDOW_S,
        iterations=int(iterations),
        itl_samples=int(itl_count),
        generated_tokens=sum(u["completion_tokens"] for u in usages),
        cached_tokens=sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                          for u in usages),
        checks=checks,
        **counted,
    )  # fmt: skip


# --- the report -----------------------------------------------------------------------------------


def summarize(rounds: list[Round]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        mine = [r for r in rounds if r.side == side]
        summary[side] = {
            "rounds": len(mine),
            "median_req_per_s": statistics.median(r.req_per_s for r in mine),
            "median_step_ms": statistics.median(r.step_ms for r in mine),
            "median_step_period_ms": statistics.median(r.step_period_ms for r in mine),
            "median_engine_cpu_s": statistics.median(r.engine_cpu_s for r in mine),
            "median_idle_engine_cpu_pct": statistics.median(r.idle_engine_cpu_pct for r in mine),
            "events": sorted({r.events for r in mine}),
            "batches": sorted({r.batches for r in mine}),
            "blocks_stored": sorted({r.blocks_stored for r in mine}),
            "cached_tokens": sorted({r.cached_tokens for r in mine}),
            "lost_seqs": sum(r.lost_seqs for r in mine),
        }
    ours, theirs = summary["hmakv"], summary["vllm"]
    summary["ratio"] = {
        key: ours[key] / theirs[key]
        for key in (
            "median_req_per_s",
            "median_step_ms",
            "median_step_period_ms",
            "median_engine_cpu_s",
        )
    }
    return summary


def spread(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def table(rounds: list[Round], summary: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'side':<6} {'round':>5} {'req/s':>7} {'step ms':>8} {'period ms':>9} {'steps':>6}"
        f" {'core cpu s':>10} {'idle cpu%':>9} {'batches':>7} {'events':>7} {'stored':>7}"
        f" {'removed':>7} {'lost':>5} {'cached':>7}"
    )
    lines = [header]
    for r in rounds:
        lines.append(
            f"{r.side:<6} {r.round:>5} {r.req_per_s:>7.2f} {r.step_ms:>8.2f}"
            f" {r.step_period_ms:>9.2f} {r.iterations:>6} {r.engine_cpu_s:>10.2f}"
            f" {r.idle_engine_cpu_pct:>9.1f} {r.batches:>7} {r.events:>7} {r.blocks_stored:>7}"
            f" {r.blocks_removed:>7} {r.lost_seqs:>5} {r.cached_tokens:>7}"
        )
    lines += ["", f"{'side':<6} {'median req/s':>12} {'median step ms':>15} {'period ms':>9}"
              f" {'core cpu s':>10} {'idle cpu%':>9} {'events':>11} {'batches':>9}"
              f" {'lost':>5}"]  # fmt: skip
    for side in SIDES:
        s = summary[side]
        lines.append(
            f"{side:<6} {s['median_req_per_s']:>12.2f} {s['median_step_ms']:>15.2f}"
            f" {s['median_step_period_ms']:>9.2f} {s['median_engine_cpu_s']:>10.2f}"
            f" {s['median_idle_engine_cpu_pct']:>9.1f} {spread(s['events']):>11}"
            f" {spread(s['batches']):>9} {s['lost_seqs']:>5}"
        )
    ratio = summary["ratio"]
    lines.append(
        f"hmakv/vLLM: req/s {ratio['median_req_per_s']:.3f}, step time"
        f" {ratio['median_step_ms']:.3f}, step period {ratio['median_step_period_ms']:.3f},"
        f" engine-core CPU {ratio['median_engine_cpu_s']:.3f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side (default 4)")
    parser.add_argument(
        "--requests", type=int, default=120, help="measured requests per run (default 120)"
    )
    parser.add_argument("--warmup", type=int, default=8, help="warm-up requests per run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--workdir", type=Path, help="server logs (default: a new temp dir)")
    parser.add_argument(
        "--quick", action="store_true", help="one round per side, 24 requests (~2 minutes)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.warmup = 1, 24, 4
    settings = Settings(
        args.rounds, args.requests, args.warmup, args.concurrency, args.max_tokens, args.seed
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hmakv-vllm-publisher-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {workdir}", file=sys.stderr)
    rounds = []
    started = time.monotonic()
    for index in range(settings.rounds):
        for side in SIDES:
            result = run_round(side, index, settings, workdir)
            rounds.append(result)
            print(
                f"  {side} round {index}: {result.req_per_s:.2f} req/s, step"
                f" {result.step_ms:.2f} ms, {result.events} events"
                f" (server start {result.start_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    summary = summarize(rounds)
    print(f"step time: mean {ITL} over each run (engine loop per decode step)")
    print(table(rounds, summary))
    for side in SIDES:
        checks = next(r.checks for r in rounds if r.side == side)
        print(
            f"{side}: plugin log line {checks['plugin_log_line']}, seq 0 {checks['seq0']},"
            f" snapshot reply {checks['snapshot_reply']}"
        )
    load = os.getloadavg()
    report = {
        "python": sys.version.split()[0],
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_after": load,
        "elapsed_s": time.monotonic() - started,
        "profile": PROFILE,
        "topic": DEFAULT_TOPIC,
        "settings": asdict(settings),
        "step_time_metric": f"mean of {ITL} (sum/count delta over the measured run)",
        "step_period_metric": f"run wall time / delta of {ITERATIONS}_count",
        "summary": summary,
        "rounds": [asdict(r) for r in rounds],
    }
    write_report(args.json, report, note=f" (load average {load[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
