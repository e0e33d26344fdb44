"""The demo's own rules, without services: when an index state may be compared with an engine
answer, how /metrics pages and histograms are read, and the engine exit line the summary parses
(taken from a real ``hmakv engine`` run, so a change of that line fails here first)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from hmakv.bridge.config import load_engines_file
from hmakv.cli import build_parser
from hmakv.commands.demo import engines_of
from hmakv.demo.config import ENGINE_LINEUP, chosen_engines, engine_lineup, parse_engine
from hmakv.demo.probe import holds_exactly, same_state
from hmakv.demo.promtext import MetricsPage, bucket_difference, bucket_quantile
from hmakv.demo.recordlog import RecordLog
from hmakv.demo.run import EngineEndpoints, bridge_engines_toml
from hmakv.demo.summary import read_engine_exit, too_few_compared
from hmakv.kvlog.answers import WorkerView
from hmakv.producer.events import GroupSpec

HMAKV = Path(sys.executable).with_name("hmakv")
FULL = GroupSpec(kind="full_attention", block_size=16)
WINDOW = GroupSpec(kind="sliding_window", block_size=16, sliding_window=128)


async def _never() -> dict[str, int]:
    raise AssertionError("not called")


def log_with(records: list[tuple[int, int]], worker: str = "w", epoch: int = 0) -> RecordLog:
    """A record log that read (group, seq) records of one worker from the events topic."""
    log = RecordLog("unused:9092", "hmakv.events", _never)
    for group, seq in records:
        log.note(
            [
                ("worker", worker.encode()),
                ("group", str(group).encode()),
                ("epoch", str(epoch).encode()),
                ("seq", str(seq).encode()),
            ]
        )
    return log


def view(last_seq: dict[int, int], health: str = "live") -> WorkerView:
    return WorkerView(
        worker="w",
        epoch=0,
        health=health,
        groups={0: FULL, 1: WINDOW},
        last_seq=last_seq,
        resident_blocks={},
        bridge_epoch=0,
        bridge_last_seq=None,
        lag_seqs=None,
        stale=False,
        applied_age_s=None,
        stale_groups=[],
    )


def test_a_state_whose_groups_all_have_their_last_record_is_that_seq() -> None:
    log = log_with([(0, 1), (1, 1), (0, 2), (0, 3), (1, 4)])
    assert holds_exactly(view({0: 3, 1: 1}), 3, log)  # group 1 had nothing at 2 or 3
    assert holds_exactly(view({0: 3, 1: 4}), 4, log)


def test_a_group_with_a_record_not_yet_applied_is_not_that_seq() -> None:
    log = log_with([(0, 1), (1, 1), (0, 2), (1, 2)])
    assert not holds_exactly(view({0: 2, 1: 1}), 2, log)  # group 1's record 2 is missing


def test_a_group_ahead_of_the_seq_is_not_that_seq() -> None:
    log = log_with([(0, 1), (1, 1), (0, 2), (1, 3)])
    assert not holds_exactly(view({0: 2, 1: 3}), 2, log)


def test_another_epochs_records_do_not_count() -> None:
    log = log_with([(0, 1), (1, 1)], epoch=1)
    assert not holds_exactly(view({0: 1, 1: 1}), 1, log)


def test_a_redelivered_record_is_noted_once_and_order_is_kept() -> None:
    log = log_with([(0, 5), (0, 3), (0, 5), (0, 4)])
    assert log.last_record_at_or_before("w", 0, 0, 4) == 4
    assert log.last_record_at_or_before("w", 0, 0, 2) is None
    assert log.last_record_at_or_before("w", 0, 0, 9) == 5


def test_headers_of_other_records_are_ignored() -> None:
    log = log_with([])
    log.note([("source", b"engine-a"), ("reason", b"undecodable")])
    log.note(None)
    assert log.last_record_at_or_before("engine-a", 0, 0, 10) is None


def test_only_an_unchanged_live_worker_counts_as_one_state() -> None:
    before = view({0: 3, 1: 1})
    assert same_state(before, view({0: 3, 1: 1}))
    assert not same_state(before, view({0: 4, 1: 1}))
    assert not same_state(before, None)
    assert not same_state(view({0: 3}, health="degraded"), view({0: 3}, health="degraded"))


PAGE = """\
# TYPE demo_age_seconds histogram
demo_age_seconds_bucket{le="0.1"} 2.0
demo_age_seconds_bucket{le="0.2"} 6.0
demo_age_seconds_bucket{le="+Inf"} 8.0
demo_age_seconds_count 8.0
demo_age_seconds_sum 1.0
# TYPE demo_events counter
demo_events_total{worker="a"} 5.0
demo_events_total{worker="b"} 7.0
"""


def test_pages_are_summed_by_label() -> None:
    page = MetricsPage.parse(PAGE)
    assert page.total("demo_events_total") == 12.0
    assert page.total("demo_events_total", worker="b") == 7.0
    assert page.by_label("demo_events_total", "worker") == {"a": 5.0, "b": 7.0}
    assert page.total("absent_total") == 0.0


def test_bucket_quantiles_interpolate_like_promql() -> None:
    buckets = MetricsPage.parse(PAGE).buckets("demo_age_seconds")
    assert buckets == [(0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.15)  # rank 4: half way into (0.1, 0.2]
    assert bucket_quantile(buckets, 0.25) == pytest.approx(0.1)
    assert bucket_quantile(buckets, 0.99) == 0.2  # in +Inf: the largest finite bound
    assert bucket_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_a_window_of_a_histogram_is_the_difference_of_two_scrapes() -> None:
    earlier = [(0.1, 2.0), (float("inf"), 3.0)]
    later = [(0.1, 2.0), (float("inf"), 5.0)]
    assert bucket_difference(later, earlier) == [(0.1, 0.0), (float("inf"), 2.0)]


def test_the_engine_exit_line_is_read_from_a_real_engine(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with log.open("wb") as sink:
        result = subprocess.run(
            [
                str(HMAKV),
                "engine",
                "--no-model",
                "--workload",
                "none",
                "--duration",
                "0.5",
                "--status-interval",
                "0",
                "--endpoint",
                "tcp://*:0",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=60,
            check=False,
        )
    assert result.returncode == 0, log.read_text()
    exit_ = read_engine_exit(log)
    assert exit_.events == 0  # no traffic: only the opening clear, which the engine does not count
    assert exit_.last_seq == 0
    assert exit_.dropped == 0


def test_a_log_without_an_exit_line_reads_as_unknown(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("engine 'a': profile gpt-oss-like\n")
    assert read_engine_exit(log).events is None
    assert read_engine_exit(tmp_path / "missing.log").last_seq is None


def test_the_bridge_is_told_each_chunked_groups_chunk_size(tmp_path: Path) -> None:
    """``chunk_size`` never travels on the wire: without it the index would apply the
    full-attention rule to a chunked group and under-report hits once early chunks are evicted."""
    engines = chosen_engines(
        [("chunked-local-like", "chat", None), ("gpt-oss-like", "chat", 512)], 0
    )
    endpoints = {
        "engine-a": EngineEndpoints(pub_port=5001, replay_port=5002, api_port=5003),
        "engine-b": EngineEndpoints(pub_port=6001, replay_port=6002, api_port=6003),
    }
    path = tmp_path / "engines.toml"
    path.write_text(bridge_engines_toml(engines, endpoints))
    chunked, windowed = load_engines_file(path)
    assert (chunked.name, chunked.endpoint, chunked.replay) == (
        "engine-a",
        "tcp://127.0.0.1:5001",
        "tcp://127.0.0.1:5002",
    )
    assert chunked.groups == {
        1: GroupSpec(kind="chunked_local_attention", block_size=16, chunk_size=64)
    }
    assert (windowed.name, windowed.endpoint, windowed.groups) == (
        "engine-b",
        "tcp://127.0.0.1:6001",
        {},
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("swa-small:chat", ("swa-small", "chat", None)),
        ("gemma3-like:documents:512", ("gemma3-like", "documents", 512)),
    ],
)
def test_engine_choices_parse(text: str, expected: tuple[str, str, int | None]) -> None:
    assert parse_engine(text) == expected


@pytest.mark.parametrize(
    "text", ["swa-small", "nope:chat", "swa-small:none", "swa-small:chat:8", "a:b:c:d"]
)
def test_bad_engine_choices_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="engine"):
        parse_engine(text)


def test_chosen_engines_get_names_seeds_and_the_demos_pool_sizes() -> None:
    engines = chosen_engines([("swa-small", "chat", None), ("mamba-hybrid-like", "chat", 64)], 7)
    assert [(e.name, e.profile, e.seed, e.num_blocks) for e in engines] == [
        ("engine-a", "swa-small", 7, None),
        ("engine-b", "mamba-hybrid-like", 8, 64),
    ]
    assert engine_lineup(6, 0) == chosen_engines(ENGINE_LINEUP, 0)


@pytest.mark.parametrize(
    ("option", "at", "message"),
    [
        ("--workdir", "a-file", "cannot use {path} as the workdir"),
        ("--json", "a-file/summary.json", "cannot use {parent} as the directory of --json"),
        ("--json", "a-dir", "--json {path} is a directory"),
        ("--report", "a-file/report", "cannot use {path} as the --report directory"),
    ],
)
def test_a_path_that_cannot_be_used_is_bad_usage(
    tmp_path: Path, option: str, at: str, message: str
) -> None:
    """The user's paths are checked before anything starts: a file or a directory in the way is
    a one-line error (exit 2), not a traceback at the end of the run."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    path = tmp_path / at
    options = ["--workdir", str(tmp_path / "work")] if option != "--workdir" else []
    done = subprocess.run(
        [str(HMAKV), "demo", "--no-model", "--duration", "1", *options, option, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    expected = message.format(path=path, parent=path.parent)
    assert f"hmakv demo: {expected}" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_engine_needs_answers_compared_for_the_verdict() -> None:
    """One engine's answers do not show that the index agrees with every engine: an engine
    whose probes all raced or failed makes the run not OK, however many the other had."""
    assert too_few_compared({"engine-a": 40, "engine-b": 3}, 3) == []
    assert too_few_compared({"engine-a": 40, "engine-b": 0}, 1) == [
        "only 0 answers of engine-b compared (at least 1 expected)"
    ]


def test_engine_flags_come_before_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """--engines on the command line wins over HMAKV_DEMO_ENGINE in the environment, as every
    flag wins over its variable; without flags the variables count, then the line-up of two."""
    monkeypatch.setenv("HMAKV_DEMO_ENGINE", "gpt-oss-like:chat,gemma3-like:documents")
    parser = build_parser()
    assert len(engines_of(parser.parse_args(["demo", "--engines", "4"]))) == 4
    assert len(engines_of(parser.parse_args(["demo"]))) == 2
    monkeypatch.delenv("HMAKV_DEMO_ENGINE")
    monkeypatch.setenv("HMAKV_DEMO_ENGINES", "3")
    assert len(engines_of(build_parser().parse_args(["demo"]))) == 3


def test_a_bad_engine_count_from_the_environment_exits_2_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HMAKV_DEMO_ENGINES", "9")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo"])
    assert exit_.value.code == 2
    assert "--engines: invalid engine count (2 to 6) value: '9'" in capsys.readouterr().err


def run_script(script: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """A demo with stand-ins patched in, as a process of its own (it signals itself)."""
    return subprocess.run(
        [sys.executable, "-c", script, str(workdir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


CTRL_C_WHILE_STOPPING = """
import asyncio, os, signal, sys, threading
from pathlib import Path
import hmakv.demo.run as run
from hmakv.demo.config import DemoConfig

class Broker:  # stands in for the embedded broker: what matters is that it is stopped
    pid = None
    log_path = Path("/nonexistent")
    def stop(self):
        print("broker stopped", flush=True)

async def failing_run(self, http):
    self.broker = Broker()
    # a child that takes 3 s to stop on SIGTERM, as a bridge draining its queue may
    slow = "trap 'sleep 3; exit 0' TERM; while :; do sleep 0.1; done"
    self.children.spawn("slow", ["sh", "-c", slow])
    await asyncio.sleep(0.5)
    raise run.DemoFailed("a service did not start")

run.Demo._run = failing_run
demo = run.Demo(DemoConfig(workdir=Path(sys.argv[1]), use_model=False))
threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()  # while it stops
print("exit", asyncio.run(demo.run()), flush=True)
"""


def test_ctrl_c_while_a_failed_run_stops_its_children_still_stops_the_broker(
    tmp_path: Path,
) -> None:
    """The signal handlers stay installed through the clean-up: Ctrl-C there raised a
    KeyboardInterrupt in the middle of stopping the children, and the broker was never stopped
    (nor its files removed). The services are stand-ins: what is tested is the clean-up."""
    done = run_script(CTRL_C_WHILE_STOPPING, tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.splitlines()[-2:] == ["broker stopped", "exit 1"], done.stdout


async def test_a_second_signal_ends_the_probe_in_flight(tmp_path: Path) -> None:
    """A probe's attempts can take 20 s against a service that died: the first Ctrl-C lets the
    probe in flight finish (its answers count), the second does not wait for it."""
    from hmakv.demo.config import DemoConfig
    from hmakv.demo.run import Demo

    demo = Demo(DemoConfig(workdir=tmp_path, use_model=False))
    probe_in_flight = asyncio.create_task(asyncio.sleep(3600))
    demo.signals()  # the first: stop
    finishing = asyncio.create_task(demo._let_finish(probe_in_flight))
    await asyncio.sleep(0.1)
    assert not finishing.done()
    demo.signals()  # the second: hurry
    await asyncio.wait_for(finishing, 10)
    assert probe_in_flight.cancelled()


CTRL_C_IN_THE_LAST_START_UP_WAIT = """
import asyncio, os, signal, sys
from pathlib import Path
import hmakv.demo.run as run
from hmakv.demo.config import DemoConfig

async def services_up(self, http, engines, index):
    pass

async def record_log_start(self):  # the record log's consumer joining, when Ctrl-C comes
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(0.2)

async def record_log_stop(self):
    pass

run.Demo._start_services = services_up
run.RecordLog.start = record_log_start
run.RecordLog.stop = record_log_stop
print("exit", asyncio.run(run.Demo(DemoConfig(workdir=Path(sys.argv[1]), use_model=False)).run()))
"""


def test_ctrl_c_in_the_last_wait_of_start_up_exits_130(tmp_path: Path) -> None:
    """The record log's consumer may take 30 s to join: a Ctrl-C then is an interrupted start
    (130, as the help says), not a run that compared nothing (1). Services are stand-ins."""
    done = run_script(CTRL_C_IN_THE_LAST_START_UP_WAIT, tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert "interrupted while starting" in done.stdout
    assert done.stdout.splitlines()[-1] == "exit 130", done.stdout
