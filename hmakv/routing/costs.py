"""How long an engine step takes, from what the step computed: the study's clock.

The reference engine runs no model here, so time comes from a roofline estimate of a serving
GPU (the defaults: gpt-oss-20b, 3.6 B active parameters, on one H100 SXM):

- ``step_s`` (5 ms): every step reads the weights once (about 13 GB in MXFP4 at 3.35 TB/s:
  3.9 ms) plus the scheduler's and sampler's overhead;
- ``prefill_token_s`` (15 us): 2 x 3.6 GFLOP per token at 989 TFLOP/s dense BF16 and 50% model
  FLOPs utilisation: the term a prefix hit saves;
- ``decode_seq_s`` (0.1 us x context): a decoding sequence reads its KV cache each step; at
  gpt-oss-20b's 24 layers x 8 KV heads x 64 dims x 2 (K, V) x 2 bytes, 49 kB per token of
  context at 3.35 TB/s is 15 ns, rounded up to 0.1 us for attention's own work.

Only the ratios between routers matter, and BENCHMARKS.md shows the order of the routers holds
when the prefill term is halved or doubled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """A step's duration: a fixed part, its prefill tokens, and its decoding sequences' context."""

    step_s: float = 0.005
    prefill_token_s: float = 15e-6
    decode_context_token_s: float = 0.1e-6

    def __post_init__(self) -> None:
        for name in ("step_s", "prefill_token_s", "decode_context_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    def seconds(self, prefill_tokens: int, decode_context_tokens: int) -> float:
        return (
            self.step_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_context_token_s * decode_context_tokens
        )

    def scaled(self, prefill_factor: float) -> StepCost:
        """The same model with prefill ``prefill_factor`` times as expensive."""
        return StepCost(
            self.step_s, self.prefill_token_s * prefill_factor, self.decode_context_token_s
        )
