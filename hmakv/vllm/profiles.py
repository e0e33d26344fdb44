"""The real-vLLM model profiles: a tiny hybrid model's layer layout and how vLLM serves it.

Pure data, importable without vLLM or transformers: ``hmakv vllm serve`` (project venv) and the
model maker (vLLM venv) read the same profile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SLIDING = "sliding_attention"
FULL = "full_attention"
# Qwen3-Next's gated delta-net layers: vLLM gives each a mamba-kind group.
LINEAR = "linear_attention"
# Llama 4's chunked local attention (the RoPE layers; the NoPE ones attend fully).
CHUNKED = "chunked_attention"

# vLLM's CPU backend gives sliding-window layers blocks of at least 32 tokens whatever
# --block-size says, so 32 is the block size of every group and of the hashes a router computes.
CPU_BLOCK_SIZE = 32
HASH_FN = "sha256_cbor"
HASH_SEED = "0"


@dataclass(frozen=True)
class VllmProfile:
    """One tiny model and the server flags that shape its KV cache.

    ``num_gpu_blocks`` is small on purpose (vLLM refuses fewer than max_model_len needs), so a
    short run fills the pool and evicts. ``chunk_size`` is the chunked-local-attention chunk
    (Llama 4), which vLLM's events do not carry: a consumer must be told it. ``dtype`` is the
    one vLLM must serve the model in: its CPU gated delta-net kernel takes bfloat16 only.
    """

    name: str
    architecture: str
    layer_types: tuple[str, ...]
    sliding_window: int | None
    num_gpu_blocks: int
    max_model_len: int = 1024
    block_size: int = CPU_BLOCK_SIZE
    chunk_size: int | None = None
    dtype: str = "float32"

    def stamp(self) -> dict[str, object]:
        """What the built model depends on: a change rebuilds it.

        The weights are saved in float32 whatever ``dtype`` says (vLLM casts them), so ``dtype``
        is a serving flag like ``num_gpu_blocks``; a profile without a chunk keeps the stamp it
        had before ``chunk_size`` existed, so its built model stays valid.
        """
        fields = asdict(self)
        fields.pop("num_gpu_blocks")
        fields.pop("dtype")
        if fields["chunk_size"] is None:
            fields.pop("chunk_size")
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
        # gpt-oss: sliding 128 and full attention alternating, attention sinks, a tiny MoE. vLLM
        # makes two groups of two layers: sliding_window 128 and full_attention.
        VllmProfile(
            name="gptoss-swa128",
            architecture="GptOssForCausalLM",
            layer_types=(SLIDING, FULL, SLIDING, FULL),
            sliding_window=128,
            num_gpu_blocks=96,
        ),
        # Qwen3-Next: three gated delta-net layers per full-attention one. vLLM makes four groups
        # of one layer: three mamba (a single state block per prefix, 'align' cache mode) and
        # one full_attention; every group's block is 32 tokens (see models.py for why).
        VllmProfile(
            name="qwen3next-gdn3",
            architecture="Qwen3NextForCausalLM",
            layer_types=(LINEAR, LINEAR, LINEAR, FULL),
            sliding_window=None,
            num_gpu_blocks=96,
            dtype="bfloat16",
        ),
        # Llama 4: three chunked-local layers (128-token chunks) per full (NoPE) one. vLLM makes
        # four groups of one layer: three chunked_local_attention and one full_attention. 96
        # blocks are refused ("the estimated maximum model length is 736").
        VllmProfile(
            name="llama4-chunk128",
            architecture="Llama4ForCausalLM",
            layer_types=(CHUNKED, CHUNKED, CHUNKED, FULL),
            sliding_window=None,
            num_gpu_blocks=192,
            chunk_size=128,
        ),
    )
}
