"""The scheduler's token sampler backed by the torch model: greedy tokens from real paged K/V.

Kept apart from the scheduler so that an engine running without a model (``--no-model``) never
imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hmakv.producer.engine.cache_manager import HybridCacheManager
from hmakv.producer.engine.model import HybridModel, SequenceStep
from hmakv.producer.engine.scheduler import ScheduledChunk


class ModelSampler:
    """Runs each step's chunks through ``HybridModel`` on the manager's block tables.

    The model's cache is sized to the manager's pool, so every block id the manager hands out
    addresses real K/V memory; on the CPU, torch gets one thread, as the engine loop is the only
    thing that should be busy.
    """

    def __init__(
        self,
        manager: HybridCacheManager,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self._manager = manager
        self.model = HybridModel(
            manager.profile, seed=seed, device=device, num_blocks=manager.pool.num_blocks
        )
        if self.model.device.type == "cpu":
            torch.set_num_threads(1)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def sample(self, chunks: Sequence[ScheduledChunk]) -> list[int]:
        steps = [
            SequenceStep(
                chunk.request_id,
                chunk.token_ids,
                chunk.start_pos,
                self._manager.block_table(chunk.request_id),
            )
            for chunk in chunks
        ]
        return [output.next_token for output in self.model.step(steps)]
