"""The end of a run: what went through the pipeline, what was lost, how fresh, how well routed.

Every number comes from a service's own output: the engines' exit summaries (what they
published), the bridge's and the index's /metrics (what they forwarded and applied), and the
probe's comparisons. Loss is counted in engine batches (seqs published but never forwarded, or
given up as unrecoverable) and in Kafka records (forwarded but neither applied nor recognised as
a replayed duplicate); both must be zero.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hmakv.demo.comparison import RoutingComparison
from hmakv.demo.config import EngineSpec
from hmakv.demo.monitor import BRIDGE, INDEX, Tick
from hmakv.demo.probe import Comparison, ProbeStats
from hmakv.demo.promtext import MetricsPage, bucket_difference, bucket_quantile

SUMMARY_VERSION = 1

_EXIT_EVENTS = re.compile(r"events: (\d+) in (\d+) batches; last seq (-?\d+), (\d+) batches sent")
_EXIT_DROPPED = re.compile(r"batches sent, (\d+) dropped")


@dataclass(frozen=True)
class EngineExit:
    """How an engine ended, and what its exit summary says it published (None: not said)."""

    code: int | None
    events: int | None
    last_seq: int | None
    dropped: int | None

    @property
    def clean(self) -> bool:
        return self.code == 0 and self.last_seq is not None


def read_engine_exit(log_path: Path, code: int | None = 0) -> EngineExit:
    """The ``events: N in M batches; last seq S, ...`` line ``hmakv engine`` prints at exit."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return EngineExit(code, None, None, None)
    events = list(_EXIT_EVENTS.finditer(text))
    dropped = list(_EXIT_DROPPED.finditer(text))
    if not events:
        return EngineExit(code, None, None, None)
    last = events[-1]
    return EngineExit(
        code=code,
        events=int(last[1]),
        last_seq=int(last[3]),
        dropped=int(dropped[-1][1]) if dropped else None,
    )


class EngineTotals(msgspec.Struct, kw_only=True):
    worker: str
    profile: str
    workload: str
    groups: list[str]
    exit_code: int | None
    events_published: int | None
    batches_published: int
    batches_dropped_by_publisher: int | None
    batches_forwarded: int
    events_received_live: int
    removals_received_live: int
    """BlockRemoved events among them: the engine evicted cached blocks (a lower bound: events
    the bridge fetched as a replay are not counted)."""
    index_last_seq: int
    answers_compared: int
    """The probe's comparisons of this worker's hit at the same seq, engine and index."""
    hma_agreeing: int
    group_blind_agreeing: int


class Pipeline(msgspec.Struct, kw_only=True):
    events_published: int | None
    events_received_live: int
    batches_published: int
    batches_forwarded: int
    records_forwarded: int
    records_applied: int
    records_ignored_as_replayed: int
    gaps_detected: int
    gaps_replayed: int
    gaps_unrecoverable: int
    dead_letters: int
    index_records_lost: int
    index_bad_records: int
    lost_batches: int
    lost_records: int
    lost: int


class Latency(msgspec.Struct, kw_only=True):
    p50_s: float | None
    p99_s: float | None
    source: str


class Hops(msgspec.Struct, kw_only=True):
    """The event age hop by hop."""

    engine_to_bridge: Latency
    bridge_to_kafka_ack: Latency
    kafka_to_index_fetch: Latency


class Routing(msgspec.Struct, kw_only=True):
    probes: int
    attempts: int
    worker_answers_compared: int
    raced: int
    errors: int
    hma_agreeing: int
    hma_agreement: float | None
    group_blind_agreeing: int
    group_blind_agreement: float | None
    group_blind_over: int
    group_blind_under: int
    routing_decisions: int
    hma_decisions_right: int
    group_blind_decisions_right: int
    requests_routed: int
    routed_hit_tokens_predicted: int
    routed_hit_tokens_granted: int
    routed_predicted_granted: int
    """Routed requests whose confirmed predicted hit was the hit the engine granted at admission
    (the engine may have changed in between: not an agreement figure)."""
    routed_speculative_granted: int
    """The same with the speculative prediction (blocks of earlier routed prompts counted)."""
    routed_speculated_blocks: int
    """Blocks the index held speculatively for them until their events came (/v1/routed)."""
    disagreements: list[Comparison]


class Summary(msgspec.Struct, kw_only=True):
    version: int = SUMMARY_VERSION
    started_at: str
    run_s: float
    interrupted: bool
    kafka: str
    model: bool
    workdir: str
    engines: list[EngineTotals]
    pipeline: Pipeline
    event_age: Latency
    kafka_ack_age: Latency
    hops: Hops
    index_catch_up: Latency
    routing: Routing
    routing_comparison: RoutingComparison | None
    """None where the run had no reference engines to replay its traffic on (real vLLM)."""
    ok: bool
    problems: list[str]


@dataclass(frozen=True)
class RunFacts:
    """What the orchestration knows at the end, beside the ticks and the probe's stats."""

    started_at: float
    run_s: float
    interrupted: bool
    kafka: str
    model: bool
    workdir: Path
    engines: Sequence[EngineSpec]
    exits: dict[str, EngineExit]


def build_summary(
    facts: RunFacts,
    first: Tick,
    last: Tick,
    stats: ProbeStats,
    min_compared: int = 1,
    comparison: RoutingComparison | None = None,
) -> Summary:
    """``first`` is the tick taken when probing began (ages are measured from there)."""
    engines = [
        _engine_totals(spec, facts.exits.get(spec.name), last, stats) for spec in facts.engines
    ]
    pipeline = _pipeline(engines, last)
    routing = _routing(stats)
    compared = {engine.worker: engine.answers_compared for engine in engines}
    problems = [
        *_unclean_exits(facts),
        *_problems(pipeline, routing),
        *too_few_compared(compared, min_compared),
    ]
    return Summary(
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(facts.started_at)),
        run_s=round(facts.run_s, 3),
        interrupted=facts.interrupted,
        kafka=facts.kafka,
        model=facts.model,
        workdir=str(facts.workdir),
        engines=engines,
        pipeline=pipeline,
        event_age=_histogram_latency(
            first.index, last.index, f"{INDEX}_event_age_seconds", "engine batch to index apply"
        ),
        kafka_ack_age=_histogram_latency(
            first.bridge,
            last.bridge,
            f"{BRIDGE}_end_to_end_age_seconds",
            "engine batch to Kafka ack",
        ),
        hops=Hops(
            engine_to_bridge=_histogram_latency(
                first.bridge,
                last.bridge,
                f"{BRIDGE}_intake_age_seconds",
                "engine batch to the bridge reading it",
            ),
            bridge_to_kafka_ack=_histogram_latency(
                first.bridge,
                last.bridge,
                f"{BRIDGE}_kafka_send_latency_seconds",
                "bridge handing records to its producer to Kafka's ack",
            ),
            kafka_to_index_fetch=_histogram_latency(
                first.index,
                last.index,
                f"{INDEX}_fetch_age_seconds",
                "record's Kafka timestamp to the index fetching it",
            ),
        ),
        index_catch_up=_sampled_latency(
            stats.catch_up_s, "probe: engine lookup to the index applying that seq"
        ),
        routing=routing,
        routing_comparison=comparison,
        ok=not problems,
        problems=problems,
    )


def _engine_totals(
    spec: EngineSpec, exit_: EngineExit | None, last: Tick, stats: ProbeStats
) -> EngineTotals:
    compared = [c for c in stats.comparisons if c.worker == spec.name]
    status = last.engines.get(spec.name)
    last_seq = exit_.last_seq if exit_ and exit_.last_seq is not None else None
    if last_seq is None:
        last_seq = status.seq if status else -1
    forwarded_seq = last.bridge.total(f"{BRIDGE}_worker_last_seq", worker=spec.name)
    if not last.bridge.matching(f"{BRIDGE}_worker_last_seq", worker=spec.name):
        forwarded_seq = -1
    lost = last.bridge.total(f"{BRIDGE}_batches_lost_total", worker=spec.name)
    view = next((v for v in last.workers.workers if v.worker == spec.name), None)
    groups = [
        f"g{g.group_idx} {_kind_label(g.kind, g.sliding_window)}"
        for g in (status.groups if status else [])
    ]
    return EngineTotals(
        worker=spec.name,
        profile=spec.profile,
        workload=spec.workload,
        groups=groups,
        exit_code=exit_.code if exit_ else None,
        events_published=exit_.events if exit_ else None,
        batches_published=last_seq + 1,
        batches_dropped_by_publisher=exit_.dropped if exit_ else None,
        batches_forwarded=int(forwarded_seq + 1 - lost),
        events_received_live=int(last.events_received(spec.name)),
        removals_received_live=int(
            last.bridge.total(
                f"{BRIDGE}_events_received_total", worker=spec.name, type="BlockRemoved"
            )
        ),
        index_last_seq=max(view.last_seq.values(), default=-1) if view else -1,
        answers_compared=len(compared),
        hma_agreeing=sum(1 for c in compared if c.hma == c.actual),
        group_blind_agreeing=sum(1 for c in compared if c.group_blind == c.actual),
    )


def _kind_label(kind: str, window: int | None) -> str:
    return f"{kind} {window}" if window else kind


def _pipeline(engines: list[EngineTotals], last: Tick) -> Pipeline:
    bridge, index = last.bridge, last.index
    published = [e.events_published for e in engines]
    batches_published = sum(e.batches_published for e in engines)
    batches_forwarded = sum(e.batches_forwarded for e in engines)
    records_forwarded = int(last.records_forwarded())
    records_applied = int(last.records_applied())
    ignored = int(index.total(f"{INDEX}_records_ignored_total", reason="duplicate"))
    lost_batches = max(0, batches_published - batches_forwarded)
    lost_records = max(0, records_forwarded - records_applied - ignored)
    dead_letters = int(bridge.total(f"{BRIDGE}_frames_rejected_total"))
    index_lost = int(index.total(f"{INDEX}_records_lost_total"))
    bad = int(index.total(f"{INDEX}_bad_records_total"))
    return Pipeline(
        events_published=None if None in published else sum(p or 0 for p in published),
        events_received_live=sum(e.events_received_live for e in engines),
        batches_published=batches_published,
        batches_forwarded=batches_forwarded,
        records_forwarded=records_forwarded,
        records_applied=records_applied,
        records_ignored_as_replayed=ignored,
        gaps_detected=int(bridge.total(f"{BRIDGE}_gaps_detected_total")),
        gaps_replayed=int(bridge.total(f"{BRIDGE}_gaps_replayed_total")),
        gaps_unrecoverable=int(bridge.total(f"{BRIDGE}_gaps_unrecoverable_total")),
        dead_letters=dead_letters,
        index_records_lost=index_lost,
        index_bad_records=bad,
        lost_batches=lost_batches,
        lost_records=lost_records,
        lost=lost_batches + lost_records + dead_letters + index_lost + bad,
    )


def _histogram_latency(first: MetricsPage, last: MetricsPage, name: str, what: str) -> Latency:
    window = bucket_difference(last.buckets(name), first.buckets(name))
    return Latency(
        p50_s=bucket_quantile(window, 0.5),
        p99_s=bucket_quantile(window, 0.99),
        source=f"{what} ({name}, interpolated in its buckets, observed while probing)",
    )


def _sampled_latency(samples: Sequence[float], what: str) -> Latency:
    ordered = sorted(samples)
    return Latency(
        p50_s=_nearest_rank(ordered, 0.5),
        p99_s=_nearest_rank(ordered, 0.99),
        source=f"{what} ({len(ordered)} probes)",
    )


def _nearest_rank(ordered: Sequence[float], quantile: float) -> float | None:
    if not ordered:
        return None
    rank = max(0, min(len(ordered) - 1, round(quantile * len(ordered) + 0.5) - 1))
    return ordered[rank]


def _routing(stats: ProbeStats) -> Routing:
    compared = len(stats.comparisons)
    over = sum(1 for c in stats.comparisons if c.group_blind > c.actual)
    under = sum(1 for c in stats.comparisons if c.group_blind < c.actual)
    return Routing(
        probes=stats.probes,
        attempts=stats.attempts,
        worker_answers_compared=compared,
        raced=stats.raced,
        errors=stats.errors,
        hma_agreeing=stats.hma_agreeing,
        hma_agreement=_ratio(stats.hma_agreeing, compared),
        group_blind_agreeing=stats.blind_agreeing,
        group_blind_agreement=_ratio(stats.blind_agreeing, compared),
        group_blind_over=over,
        group_blind_under=under,
        routing_decisions=stats.decisions,
        hma_decisions_right=stats.hma_decisions_right,
        group_blind_decisions_right=stats.blind_decisions_right,
        requests_routed=len(stats.routed),
        routed_hit_tokens_predicted=sum(r.predicted for r in stats.routed),
        routed_hit_tokens_granted=sum(r.granted for r in stats.routed),
        routed_predicted_granted=sum(r.predicted == r.granted for r in stats.routed),
        routed_speculative_granted=sum(r.speculative == r.granted for r in stats.routed),
        routed_speculated_blocks=stats.speculated_blocks,
        disagreements=stats.disagreements(),
    )


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 6) if whole else None


def _unclean_exits(facts: RunFacts) -> list[str]:
    """An engine killed at the end never said what it published last: nothing can be checked."""
    problems = []
    for spec in facts.engines:
        exit_ = facts.exits.get(spec.name)
        if exit_ is None or not exit_.clean:
            code = exit_.code if exit_ else None
            problems.append(
                f"{spec.name} did not stop cleanly (exit code {code}; see its log): "
                "the batches it published last cannot be counted"
            )
    return problems


def too_few_compared(compared: Mapping[str, int], min_compared: int) -> list[str]:
    """Each engine's answers must have been compared: "agrees with every engine" is not shown by
    one engine's answers, and another's never compared (its probes all raced or failed)."""
    return [
        f"only {count} answers of {name} compared (at least {min_compared} expected)"
        for name, count in compared.items()
        if count < min_compared
    ]


def _problems(pipeline: Pipeline, routing: Routing) -> list[str]:
    problems = []
    if pipeline.lost:
        problems.append(f"{pipeline.lost} lost (see pipeline)")
    if routing.hma_agreeing != routing.worker_answers_compared:
        wrong = routing.worker_answers_compared - routing.hma_agreeing
        problems.append(f"the HMA-aware index disagreed with the engine {wrong} times")
    return problems


def encode_json(summary: Summary) -> bytes:
    return msgspec.json.format(msgspec.json.encode(summary), indent=2) + b"\n"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def render_text(summary: Summary) -> str:
    p, r = summary.pipeline, summary.routing
    how = "interrupted after" if summary.interrupted else "ran"
    lines = [
        f"hmakv demo summary: {how} {summary.run_s:.1f} s, Kafka {summary.kafka}, "
        f"model {'on' if summary.model else 'off'}",
    ]
    for engine in summary.engines:
        lines.append(
            f"  {engine.worker} ({engine.profile}, {engine.workload}; {', '.join(engine.groups)}): "
            f"{_count(engine.events_published)} events in {engine.batches_published} batches, "
            f"{engine.batches_forwarded} batches forwarded, index at seq {engine.index_last_seq}, "
            f"{engine.removals_received_live} removals; "
            f"agrees HMA-aware {engine.hma_agreeing}/{engine.answers_compared}, group-blind "
            f"{engine.group_blind_agreeing}/{engine.answers_compared}"
        )
    lines += [
        f"  events     published {_count(p.events_published)}, received live by the bridge "
        f"{p.events_received_live}; records forwarded {p.records_forwarded}, applied "
        f"{p.records_applied} (+{p.records_ignored_as_replayed} replayed duplicates ignored)",
        f"  lost       {p.lost}  (batches {p.lost_batches}, records {p.lost_records}, "
        f"dead letters {p.dead_letters}; gaps {p.gaps_detected} detected, {p.gaps_replayed} "
        f"replayed, {p.gaps_unrecoverable} unrecoverable)",
        f"  event age  p50 {_ms(summary.event_age.p50_s)}, p99 {_ms(summary.event_age.p99_s)} "
        f"engine to index (to Kafka: p50 {_ms(summary.kafka_ack_age.p50_s)}, "
        f"p99 {_ms(summary.kafka_ack_age.p99_s)}); a probe waited p50 "
        f"{_ms(summary.index_catch_up.p50_s)}, p99 {_ms(summary.index_catch_up.p99_s)} "
        "for the index",
        "  hops       "
        + "; ".join(
            f"{label} p50 {_ms(hop.p50_s)}, p99 {_ms(hop.p99_s)}"
            for label, hop in (
                ("engine -> bridge", summary.hops.engine_to_bridge),
                ("bridge -> Kafka ack", summary.hops.bridge_to_kafka_ack),
                ("Kafka -> index fetch", summary.hops.kafka_to_index_fetch),
            )
        ),
        f"  routing    {r.probes} probes, {r.worker_answers_compared} worker answers compared "
        f"at the same seq ({r.raced} raced, {r.errors} errors)",
        f"             HMA-aware agrees with the engine {_pct(r.hma_agreement)} "
        f"({r.hma_agreeing}/{r.worker_answers_compared}); group-blind "
        f"{_pct(r.group_blind_agreement)} ({r.group_blind_over} too high, "
        f"{r.group_blind_under} too low)",
        f"             best worker picked right: HMA-aware {r.hma_decisions_right}/"
        f"{r.routing_decisions}, group-blind {r.group_blind_decisions_right}/"
        f"{r.routing_decisions}; {r.requests_routed} requests routed, granted the predicted "
        f"hit {r.routed_predicted_granted} times, the speculative one "
        f"{r.routed_speculative_granted} ({r.routed_speculated_blocks} blocks held "
        "speculatively until their events came)",
    ]
    lines += _comparison_lines(summary.routing_comparison)
    verdict = "OK: zero loss, index agrees with every engine" if summary.ok else "FAILED: "
    lines.append(f"  result     {verdict}{'; '.join(summary.problems)}")
    return "\n".join(lines)


def _comparison_lines(comparison: RoutingComparison | None) -> list[str]:
    if comparison is None:
        return ["  routers    no comparison: it replays traffic on reference engines only"]
    lines = [
        f"  routers    this run's {comparison.prompts} routed prompts behind each router, "
        f"{comparison.fleets[0].engines if comparison.fleets else 0} simulated engines per "
        "layout: cached share, TTFT p99, predicted hit = real"
    ]
    for fleet in comparison.fleets:
        lines.append(f"             {fleet.profile} ({fleet.num_blocks} blocks):")
        lines += [
            f"               {run.router:20s} {_pct(run.cached_share):>6s}  "
            f"{_ms(run.ttft_p99_s):>9s}  "
            f"{_pct(run.predicted_exact / run.predicted) if run.predicted else 'n/a':>6s}"
            for run in fleet.runs
        ]
    return lines


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)
