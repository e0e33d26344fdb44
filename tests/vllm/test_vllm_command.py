"""``hmakv vllm`` without starting vLLM: the profiles it lists, and what it says when vLLM's venv
is missing (the servers themselves run in test_real_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hmakv.vllm.profiles import PROFILES
from hmakv.vllm.server import ServerPorts, server_argv, server_env

HMAKV = Path(sys.executable).with_name("hmakv")


def hmakv(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HMAKV), *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=60
    )


def test_profiles_lists_every_profile_and_the_venv(tmp_path: Path) -> None:
    done = hmakv("vllm", "profiles", HMAKV_VLLM_VENV=str(tmp_path / "venv"))
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[:-1]] == list(PROFILES)
    assert done.stdout.splitlines()[-1] == f"vLLM venv: {tmp_path / 'venv'}"


def test_serve_without_vllm_set_up_says_how_and_exits_1(tmp_path: Path) -> None:
    done = hmakv("vllm", "serve", "--profile", "gemma3-swa64", HMAKV_VLLM_VENV=str(tmp_path))
    assert done.returncode == 1
    assert "run scripts/setup-vllm first" in done.stderr


def test_an_unknown_profile_is_bad_usage() -> None:
    done = hmakv("vllm", "serve", "--profile", "no-such-model")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_the_server_command_is_what_the_facts_say_vllm_needs(tmp_path: Path) -> None:
    """Prefix caching with a reproducible hash, real hits in the usage, KV events with replay,
    the profile's small pool and dtype, and a fixed PYTHONHASHSEED."""
    profile = PROFILES["qwen3next-gdn3"]
    argv = server_argv(
        profile, tmp_path, ServerPorts(api=8000, events=5557, replay=5560), num_gpu_blocks=200
    )
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--prefix-caching-hash-algo"] == "sha256_cbor"
    assert flags["--dtype"] == "bfloat16"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
    assert '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560"' in argv[-1]
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "200"
    env = server_env(hmakv_publisher=True)
    assert env["PYTHONHASHSEED"] == "0" and env["HMAKV_VLLM_PUBLISHER"] == "1"
    assert "HMAKV_VLLM_PUBLISHER" not in server_env(hmakv_publisher=False)
