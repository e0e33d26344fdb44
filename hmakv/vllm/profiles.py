"""The real-vLLM model profiles: a tiny hybrid model's layer layout and how vLLM serves it.

Pure data, importable without vLLM or transformers: ``hmakv vllm serve`` (project venv) and the
model maker (vLLM venv) read the same profile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SLIDING = "sliding_attention"
FULL = "full_attention"

# vLLM's CPU backend gives sliding-window layers blocks of at least 32 tokens whatever
# --block-size says, so 32 is the block size of every group and of the hashes a router computes.
CPU_BLOCK_SIZE = 32
HASH_FN = "sha256_cbor"
HASH_SEED = "0"


@dataclass(frozen=True)
class VllmProfile:
    """One tiny model and the server flags that shape its KV cache.

    ``num_gpu_blocks`` is small on purpose (vLLM refuses fewer than max_model_len needs), so a
    short run fills the pool and evicts.
    """

    name: str
    architecture: str
    layer_types: tuple[str, ...]
    sliding_window: int | None
    num_gpu_blocks: int
    max_model_len: int = 1024
    block_size: int = CPU_BLOCK_SIZE

    def stamp(self) -> dict[str, object]:
        """What the built model depends on: a change rebuilds it."""
        fields = asdict(self)
        fields.pop("num_gpu_blocks")
        return {**fields, "layer_types": list(self.layer_types)}


PROFILES: dict[str, VllmProfile] = {
    profile.name: profile
    for profile in (
        # Gemma 3's pattern (sliding layers, then a full one), with a 64-token window: vLLM makes
        # one full-attention group and one sliding-window group, two layers each.
        VllmProfile(
            name="gemma3-swa64",
            architecture="Gemma3ForCausalLM",
            layer_types=(SLIDING, SLIDING, FULL, FULL),
            sliding_window=64,
            num_gpu_blocks=96,
        ),
        # Three window layers per full one, a wider window: vLLM groups them 3 + 1, and the full
        # layer's group holds one layer, so there are four groups, three with one spec.
        VllmProfile(
            name="gemma3-swa128x3",
            architecture="Gemma3ForCausalLM",
            layer_types=(SLIDING, SLIDING, SLIDING, FULL),
            sliding_window=128,
            num_gpu_blocks=192,
        ),
    )
}
