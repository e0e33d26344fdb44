"""``hmakv hash`` against vLLM's hash vectors, through the real CLI entry point."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hmakv.cli import main

VECTORS = Path(__file__).parents[1] / "data" / "vllm-hash-sha256_cbor.jsonl"


def _vector(name: str) -> dict[str, Any]:
    with VECTORS.open() as lines:
        cases = [json.loads(line) for line in lines]
    return next(case for case in cases if case["case"] == name)


def _run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stdin: str,
    *args: str,
) -> tuple[int, list[str], str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["hash", *args])
    out, err = capsys.readouterr()
    return code, out.split(), err


@pytest.mark.parametrize("name", ["seed0-range64-bs16", "seed42-prompt-bs16", "seed0-bs32"])
def test_prints_vllm_external_ints(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    case = _vector(name)
    code, lines, _ = _run(
        monkeypatch,
        capsys,
        json.dumps(case["token_ids"]),
        "--seed",
        case["PYTHONHASHSEED"],
        "--block-size",
        str(case["block_size"]),
    )
    assert code == 0
    assert [int(line) for line in lines] == case["external_ints"]


def test_hex_prints_full_digests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    case = _vector("seed0-range64-bs16")
    code, lines, _ = _run(
        monkeypatch, capsys, json.dumps(case["token_ids"]), "--block-size", "16", "--hex"
    )
    assert (code, lines) == (0, case["block_hashes_hex"])


def test_lora_name_and_cache_salt_become_extra_keys(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lora = _vector("seed0-lora-first-block")
    salt = _vector("seed0-salt-first-block-only")
    tokens = json.dumps(lora["token_ids"])
    _, lora_lines, _ = _run(
        monkeypatch, capsys, tokens, "--block-size", "16", "--lora-name", "adapter-x"
    )
    tokens = json.dumps(salt["token_ids"])
    _, salt_lines, _ = _run(
        monkeypatch, capsys, tokens, "--block-size", "16", "--cache-salt", "salt-a"
    )
    assert [int(line) for line in lora_lines] == lora["external_ints"]
    assert [int(line) for line in salt_lines] == salt["external_ints"]


def test_environment_supplies_hash_function_and_seed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    case = _vector("seed42-prompt-bs16")
    monkeypatch.setenv("HMAKV_HASH_FN", "sha256_cbor")
    monkeypatch.setenv("HMAKV_HASH_SEED", "42")
    code, lines, _ = _run(monkeypatch, capsys, json.dumps(case["token_ids"]), "--block-size", "16")
    assert code == 0
    assert [int(line) for line in lines] == case["external_ints"]


def test_group_block_size_prints_each_group_block_last_sub_block(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    case = _vector("seed0-range64-bs16")
    tokens = json.dumps(case["token_ids"])
    _, lines, _ = _run(
        monkeypatch, capsys, tokens, "--block-size", "16", "--group-block-size", "32"
    )
    assert [int(line) for line in lines] == case["external_ints"][1::2]


def test_short_input_prints_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(monkeypatch, capsys, "[1, 2, 3]", "--block-size", "16")[:2] == (0, [])


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        ("1, 2, 3", "stdin is not JSON"),
        ('{"tokens": [1]}', "JSON list of non-negative integer"),
        ("[1, 2.5]", "JSON list of non-negative integer"),
        ("[1, true]", "JSON list of non-negative integer"),
        ("[1, -2]", "JSON list of non-negative integer"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: str, message: str
) -> None:
    code, lines, err = _run(monkeypatch, capsys, stdin, "--block-size", "4")
    assert (code, lines) == (2, [])
    assert message in err


def test_pickle_sha256_exits_2_explaining_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(monkeypatch, capsys, "[1, 2]", "--block-size", "1", "--hash-fn", "sha256")
    assert code == 2
    assert "cannot be reproduced outside the engine process" in err


def test_group_block_size_not_a_multiple_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(monkeypatch, capsys, "[]", "--block-size", "16", "--group-block-size", "24")
    assert code == 2
    assert "not a multiple" in err


def test_non_positive_block_size_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run(monkeypatch, capsys, "[]", "--block-size", "0")
    assert exit_info.value.code == 2
    assert "must be positive" in capsys.readouterr().err


def test_installed_command_matches_vectors() -> None:
    """The console script as a user runs it: a real process reading a real pipe."""
    case = _vector("seed42-prompt-bs16")
    command = Path(sys.executable).with_name("hmakv")
    result = subprocess.run(
        [str(command), "hash", "--hash-fn", "sha256_cbor", "--seed", "42", "--block-size", "16"],
        input=json.dumps(case["token_ids"]),
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": str(command.parent)},
    )
    assert result.returncode == 0, result.stderr
    assert [int(line) for line in result.stdout.split()] == case["external_ints"]
