"""Tiny random-weight hybrid models that real vLLM serves on this machine's CPU.

No model can be downloaded here, and the pipeline's fidelity does not depend on weights: vLLM's
KV-cache manager, its hybrid coordinator and its events depend only on the layer layout. So a
model is a transformers config with the wanted layer types, random weights, and a byte-level
tokenizer (one byte is one token, ids 0-255), which makes token ids computable without the model.

Runs in the vLLM venv (transformers and torch come with vLLM): ``python -m hmakv.vllm.models
--profile NAME --out DIR``; ``hmakv vllm serve`` calls it when the model is not built yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hmakv.vllm.profiles import CHUNKED, PROFILES, VllmProfile

BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
VOCAB_SIZE = BYTE_TOKENS + len(SPECIAL_TOKENS)
STAMP = "hmakv-model.json"


def build_model(profile: VllmProfile, out: Path) -> None:
    """Write ``profile``'s config, random weights and tokenizer to ``out``, then a stamp."""
    import torch

    torch.manual_seed(0)
    config = _CONFIGS[profile.architecture](profile)
    model = _model_class(profile.architecture)(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(out)
    (out / STAMP).write_text(json.dumps(profile.stamp(), sort_keys=True))


def is_built(profile: VllmProfile, out: Path) -> bool:
    """Whether ``out`` holds this very profile's model (a changed profile is built again)."""
    try:
        return bool(json.loads((out / STAMP).read_text()) == profile.stamp())
    except (OSError, ValueError):
        return False


def _gemma3(profile: VllmProfile) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_shared_fields(profile),
        intermediate_size=128,
        layer_types=list(profile.layer_types),
        sliding_window=profile.sliding_window,
    )


def _gpt_oss(profile: VllmProfile) -> Any:
    """gpt-oss's layout (sliding and full attention with sinks) over a four-expert MoE."""
    from transformers import GptOssConfig

    return GptOssConfig(
        **_shared_fields(profile),
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=list(profile.layer_types),
        sliding_window=profile.sliding_window,
    )


def _qwen3_next(profile: VllmProfile) -> Any:
    """Gated delta-net (linear attention) and full attention over a four-expert MoE.

    The sizes are not free: vLLM's CPU delta-net kernel takes head dim 128 only ("Unexpected
    head dim size, 32"), and vLLM raises the attention block size until one attention page holds
    a whole mamba state, so the full-attention layer is wide (8 KV heads of 128: 4 KiB a token in
    bfloat16) to keep every group's block at 32 tokens (2 heads of 32 made it 544).
    """
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_shared_fields(profile, heads=8, kv_heads=8, head_dim=128),
        intermediate_size=128,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=list(profile.layer_types),
    )


def _llama4(profile: VllmProfile) -> Any:
    """Llama 4's chunked local attention: RoPE layers attend within a chunk, NoPE layers fully."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(
        **_shared_fields(profile),
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        # 1: a RoPE layer, chunked; 0: a NoPE layer, full attention (vLLM reads this list).
        no_rope_layers=[int(kind == CHUNKED) for kind in profile.layer_types],
        attention_chunk_size=profile.chunk_size,
    )


def _shared_fields(
    profile: VllmProfile, *, heads: int = 2, kv_heads: int = 1, head_dim: int = 32
) -> dict[str, Any]:
    """What every tiny config sets alike: the byte vocabulary and its special ids, the width, the
    profile's depth and length, float32, the architecture, and the attention's heads."""
    return {
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BYTE_TOKENS,
        "eos_token_id": BYTE_TOKENS + 1,
        "pad_token_id": BYTE_TOKENS + 2,
        "hidden_size": 64,
        "num_hidden_layers": len(profile.layer_types),
        "max_position_embeddings": profile.max_model_len,
        "torch_dtype": "float32",
        "architectures": [profile.architecture],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


_CONFIGS: dict[str, Callable[[VllmProfile], Any]] = {
    "Gemma3ForCausalLM": _gemma3,
    "GptOssForCausalLM": _gpt_oss,
    "Qwen3NextForCausalLM": _qwen3_next,
    "Llama4ForCausalLM": _llama4,
}


def _model_class(architecture: str) -> Any:
    import transformers

    return getattr(transformers, architecture)


def _save_tokenizer(out: Path) -> None:
    """A byte-level BPE without merges: byte ``b`` is token ``b``, whatever the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    by_byte = _bytes_to_unicode()
    vocab = {by_byte[b]: b for b in range(BYTE_TOKENS)}
    assert set(vocab) == set(alphabet)
    vocab.update({token: BYTE_TOKENS + i for i, token in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
    )
    wrapped.save_pretrained(out)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character table, the one ``ByteLevel`` pre-tokenizes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(BYTE_TOKENS):
        if b not in printable:
            printable.append(b)
            chars.append(BYTE_TOKENS + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build a tiny hybrid model for vLLM")
    parser.add_argument("--profile", required=True, choices=sorted(PROFILES))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    if not is_built(profile, args.out):
        build_model(profile, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
