"""Model profiles: lookup by name, and layouts the engine can run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hmakv.producer.engine import PROFILES, HybridCacheManager, UnknownProfile, get_profile
from hmakv.producer.events import GroupSpec
from hmakv.producer.recorder import EventRecorder

TRACE = Path(__file__).parents[2] / "data" / "vllm-trace-swa-small-seed1.jsonl.gz"


def test_unknown_name_error_lists_every_profile() -> None:
    with pytest.raises(UnknownProfile) as error:
        get_profile("llama-like")
    message = str(error.value)
    assert "'llama-like'" in message
    for name in PROFILES:
        assert name in message


def test_required_profiles_exist_with_their_layouts() -> None:
    gpt_oss = get_profile("gpt-oss-like").groups
    assert [(g.kind, g.block_size, g.sliding_window) for g in gpt_oss] == [
        ("full_attention", 16, None),
        ("sliding_window", 16, 128),
    ]
    gemma = get_profile("gemma3-like").groups
    assert gemma.count(GroupSpec(kind="sliding_window", block_size=16, sliding_window=1024)) == 5
    assert gemma.count(GroupSpec(kind="full_attention", block_size=16)) == 1
    mamba = get_profile("mamba-hybrid-like").groups
    attention, state = mamba
    assert state.kind == "mamba" and state.block_size % attention.block_size == 0
    assert state.block_size > attention.block_size


def test_swa_small_matches_the_recorded_vllm_trace_config() -> None:
    with gzip.open(TRACE, "rt") as trace:
        config = json.loads(trace.readline())
    profile = get_profile("swa-small")
    windows = [g.sliding_window for g in profile.groups]
    assert windows == [None, 32, 64]  # config groups: full, sw32, sw64
    assert {g.block_size for g in profile.groups} == {config["block_size"]}
    assert profile.num_blocks == config["num_blocks"]
    assert (profile.hash_fn, profile.hash_seed) == (config["hash_fn"], config["PYTHONHASHSEED"])


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_runs_a_request(name: str) -> None:
    profile = get_profile(name)
    manager = HybridCacheManager(profile, EventRecorder(profile.groups))
    admission = manager.admit("r", list(range(300)))
    assert admission is not None and admission.num_scheduled_tokens > 0
    assert manager.end_step() is not None


def test_a_profile_needs_one_layer_count_per_group() -> None:
    profile = get_profile("gpt-oss-like")
    with pytest.raises(ValueError, match="layer counts"):
        type(profile)(
            name="broken",
            groups=profile.groups,
            num_blocks=8,
            dims=type(profile.dims)(layers_per_group=(1,), num_heads=1, head_dim=1, vocab_size=1),
        )
