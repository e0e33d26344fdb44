"""``hmakv decode``: hex lines, raw payloads and a live ZMQ publisher, printed as JSON lines.

The publisher tests use a real PUB socket on loopback that sends vLLM's three-frame messages.
"""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from hmakv.cli import main
from hmakv.producer.events import BlockRemoved, BlockStored, KVEventBatch, encode
from hmakv.producer.protocol import live_frames

DATA = Path(__file__).parents[1] / "data"
WIRE_VECTORS = [json.loads(line) for line in (DATA / "vllm-wire.jsonl").read_text().splitlines()]
HMAKV = Path(sys.executable).with_name("hmakv")
CLEAR_HEX = next(v["payload_hex"] for v in WIRE_VECTORS if v["case"] == "clear")
CLEARED_BATCH = {
    "ts": 1700000003.0,
    "data_parallel_rank": 1,
    "events": [{"type": "AllBlocksCleared"}],
    "unknown_event_types": [],
}

Message = list[bytes]


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def _assert_matches_vector(printed: dict[str, Any], vector: dict[str, Any]) -> None:
    """Every field the vector's vLLM had is printed as expected; the newer ones print as null."""
    expected = vector["expected"]
    assert printed["ts"] == expected["ts"]
    assert printed["data_parallel_rank"] == expected["data_parallel_rank"]
    assert printed["unknown_event_types"] == []
    for event, expected_event in zip(printed["events"], expected["events"], strict=True):
        assert {key: event[key] for key in expected_event} == expected_event
        assert all(event[key] is None for key in event.keys() - expected_event.keys())


# --- Hex lines and raw payloads ----------------------------------------------------------------


def test_every_vector_file_line_prints_as_its_expected_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hex_file = tmp_path / "payloads.hex"
    hex_file.write_text("".join(f"{v['payload_hex']}\n" for v in WIRE_VECTORS))

    assert main(["decode", str(hex_file)]) == 0

    out, err = capsys.readouterr()
    printed = _json_lines(out)
    assert len(printed) == len(WIRE_VECTORS)
    for batch, vector in zip(printed, WIRE_VECTORS, strict=True):
        _assert_matches_vector(batch, vector)
    assert err == ""


def test_bytes_print_as_hex_and_uint64_hashes_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stored = BlockStored(
        block_hashes=[2**64 - 1, b"\xab" * 16],
        parent_block_hash=b"\x01\x02",
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("salt", b"\xff"), None],
    )
    raw_file = tmp_path / "batch.msgpack"
    raw_file.write_bytes(encode(KVEventBatch(9.5, [stored], None)))

    assert main(["decode", "--raw", str(raw_file)]) == 0

    (event,) = _json_lines(capsys.readouterr().out)[0]["events"]
    assert event["block_hashes"] == [18446744073709551615, "ab" * 16]
    assert event["parent_block_hash"] == "0102"
    assert event["extra_keys"] == [["salt", "ff"], None]


def test_unknown_event_types_are_listed_and_known_events_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockInactive", "block_hashes": [1]}, ["BlockRemoved", [7], "GPU", 2]], 0]
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(payload.hex() + "\n"))

    assert main(["decode"]) == 0

    (batch,) = _json_lines(capsys.readouterr().out)
    assert batch["unknown_event_types"] == ["BlockInactive"]
    assert batch["events"] == [
        {
            "type": "BlockRemoved",
            "block_hashes": [7],
            "medium": "GPU",
            "group_idx": 2,
            "locality": None,
            "ownership": None,
        }
    ]


def test_vllm_0_33_fields_print_under_their_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ownership, session and lookahead print as vLLM 0.33.0 sent them (its own vectors)."""
    newest = {v["case"]: v for v in WIRE_VECTORS if v["vllm"] == "0.33.0"}
    cases = ["lookahead-store-with-session", "offload-tier-store-and-removal"]
    hex_file = tmp_path / "payloads.hex"
    hex_file.write_text("".join(f"{newest[case]['payload_hex']}\n" for case in cases))

    assert main(["decode", str(hex_file)]) == 0

    lookahead, offload = _json_lines(capsys.readouterr().out)
    [store] = lookahead["events"]
    assert (store["session_id"], store["lookahead_token_ids"], store["ownership"]) == (
        "session-1",
        [[16], [32]],
        None,
    )
    assert [(e["type"], e["ownership"]) for e in offload["events"]] == [
        ("BlockStored", "kvcr"),
        ("BlockRemoved", "kvcr"),
    ]
    assert offload["events"][0]["session_id"] == "session-2"
    assert offload["events"][0]["lookahead_token_ids"] is None


def test_a_map_encoded_batch_prints_like_an_array_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    [vector] = [v for v in WIRE_VECTORS if v["vllm"] == "map-batch"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(vector["payload_hex"] + "\n"))

    assert main(["decode"]) == 0

    (batch,) = _json_lines(capsys.readouterr().out)
    _assert_matches_vector(batch, vector)


def test_bad_lines_are_reported_by_number_and_skipped_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [CLEAR_HEX, "not hex", "", "c1", msgspec.msgpack.encode([1.0, [42]]).hex(), CLEAR_HEX]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))

    assert main(["decode", "-"]) == 2

    out, err = capsys.readouterr()
    assert _json_lines(out) == [CLEARED_BATCH, CLEARED_BATCH]
    assert err.splitlines() == [
        "hmakv decode: <stdin>:2: not a hex string",
        "hmakv decode: <stdin>:4: not a KV event batch: MessagePack data is malformed: "
        "invalid opcode '\\xc1' (byte 0)",
        "hmakv decode: <stdin>:5: event 0: neither a map nor a tagged array: "
        "Expected `array`, got `int`",
    ]


def test_raw_payload_that_does_not_decode_exits_2_naming_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw_file = tmp_path / "big.msgpack"
    raw_file.write_bytes(bytes.fromhex(CLEAR_HEX))

    assert main(["decode", "--raw", str(raw_file), "--max-bytes", "8"]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert "exceeds the limit of 8" in err and str(raw_file) in err


@pytest.mark.parametrize("mode", [[], ["--raw"]], ids=["hex", "raw"])
def test_missing_file_exits_2(
    mode: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing")
    assert main(["decode", *mode, missing]) == 2
    assert f"cannot read {missing}: No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments",
    [["--count", "0"], ["--timeout", "inf"], ["--timeout", "-1"], ["f", "--raw", "g"]],
    ids=["zero-count", "infinite-timeout", "negative-timeout", "two-sources"],
)
def test_bad_usage_exits_2(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", *arguments])
    assert exit_info.value.code == 2
    assert "hmakv decode: error:" in capsys.readouterr().err


def test_installed_command_decodes_stdin_in_a_subprocess() -> None:
    completed = subprocess.run(
        [HMAKV, "decode"],
        input=f"{CLEAR_HEX}\nzz\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2
    assert _json_lines(completed.stdout) == [CLEARED_BATCH]
    assert completed.stderr == "hmakv decode: <stdin>:2: not a hex string\n"


def test_installed_command_stops_quietly_when_its_reader_goes_away(tmp_path: Path) -> None:
    """`hmakv decode ... | head -1`: more output than a pipe buffer holds, then the pipe closes."""
    hex_file = tmp_path / "many.hex"
    hex_file.write_text(f"{CLEAR_HEX}\n" * 5000)
    with subprocess.Popen(
        [HMAKV, "decode", str(hex_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert json.loads(process.stdout.readline()) == CLEARED_BATCH
        process.stdout.close()
        stderr = process.stderr.read()
        assert process.wait(timeout=60) == 0
    assert stderr == b""


# --- A live publisher --------------------------------------------------------------------------


def _vllm_message(seq: int, payload: bytes, topic: bytes = b"kv-events") -> Message:
    return live_frames(topic, seq, payload)


def _vector_message(seq: int) -> Message:
    return _vllm_message(seq, bytes.fromhex(WIRE_VECTORS[seq % len(WIRE_VECTORS)]["payload_hex"]))


@contextmanager
def _publishing(make_messages: Callable[[int], list[Message]]) -> Iterator[str]:
    """A real PUB socket on a free loopback port that sends ``make_messages(0)``, ``(1)``, ...

    It keeps sending until the block ends: a SUB socket misses everything sent before its
    subscription reaches the publisher, and a test cannot know when that is.
    """
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind("tcp://127.0.0.1:*")
    endpoint = publisher.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()

    def send_until_stopped() -> None:
        for step in itertools.count():
            if stop.wait(0.002):
                return
            for message in make_messages(step):
                publisher.send_multipart(message)

    sender = threading.Thread(target=send_until_stopped, daemon=True)
    sender.start()
    try:
        yield endpoint
    finally:
        stop.set()
        sender.join()
        publisher.close(linger=0)
        context.term()


def test_follows_a_publisher_and_prints_count_batches_with_their_seq(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with _publishing(lambda step: [_vector_message(step)]) as endpoint:
        code = main(["decode", "--zmq", endpoint, "--count", "5", "--timeout", "30"])

    assert code == 0
    printed = _json_lines(capsys.readouterr().out)
    seqs = [batch.pop("seq") for batch in printed]
    assert seqs == list(range(seqs[0], seqs[0] + 5))
    for seq, batch in zip(seqs, printed, strict=True):
        _assert_matches_vector(batch, WIRE_VECTORS[seq % len(WIRE_VECTORS)])


def test_subscribes_to_the_topic_only(capsys: pytest.CaptureFixture[str]) -> None:
    other_topic_seq = 1_000_000

    def both_topics(step: int) -> list[Message]:
        return [
            _vllm_message(other_topic_seq + step, bytes.fromhex(CLEAR_HEX), b"other"),
            _vector_message(step),
        ]

    with _publishing(both_topics) as endpoint:
        code = main(["decode", "--zmq", endpoint, "--topic", "kv-events", "--count", "6"])

    assert code == 0
    assert all(batch["seq"] < other_topic_seq for batch in _json_lines(capsys.readouterr().out))


def test_malformed_messages_are_reported_and_skipped_with_exit_code_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = encode(KVEventBatch(2.0, [BlockRemoved([5], "GPU", 1)], 0))

    def good_then_three_bad(step: int) -> list[Message]:
        return [
            _vllm_message(step * 4, good),
            _vllm_message(step * 4 + 1, b"\xc1"),
            [b"kv-events", good],
            [b"kv-events", b"\x00\x01", good],
        ]

    with _publishing(good_then_three_bad) as endpoint:
        code = main(["decode", "--zmq", endpoint, "--count", "8", "--timeout", "30"])

    assert code == 2
    out, err = capsys.readouterr()
    printed = _json_lines(out)
    assert [batch["events"] for batch in printed] == [
        [
            {
                "type": "BlockRemoved",
                "block_hashes": [5],
                "medium": "GPU",
                "group_idx": 1,
                "locality": None,
                "ownership": None,
            }
        ]
    ] * 2
    errors = err.splitlines()
    assert len(errors) == 6
    assert sum(e.endswith(": 2 frames, expected 3 (topic, seq, payload)") for e in errors) == 2
    assert sum(e.endswith(": seq frame of 2 bytes, expected 8") for e in errors) == 2
    bad_payloads = [e for e in errors if "MessagePack data is malformed" in e]
    assert len(bad_payloads) == 2
    assert all(int(e.split(": seq ")[1].split(":")[0]) % 4 == 1 for e in bad_payloads)


def test_endpoint_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with _publishing(lambda step: [_vector_message(step)]) as endpoint:
        monkeypatch.setenv("HMAKV_DECODE_ZMQ", endpoint)
        monkeypatch.setenv("HMAKV_DECODE_COUNT", "2")
        code = main(["decode", "--timeout", "30"])

    assert code == 0
    assert len(_json_lines(capsys.readouterr().out)) == 2


def test_silent_publisher_ends_with_exit_code_1(capsys: pytest.CaptureFixture[str]) -> None:
    with _publishing(lambda step: []) as endpoint:
        code = main(["decode", "--zmq", endpoint, "--timeout", "0.2"])

    assert code == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "hmakv decode: no message within 0.2 s\n"


def test_malformed_endpoint_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--zmq", "nonsense://x"]) == 2
    assert "cannot connect to nonsense://x" in capsys.readouterr().err
