"""vLLM itself through Kafka, the follower and the score API (see trace_kit for the trace).

Each batch goes to Kafka split per group as the bridge splits it (``bridge.fanout.fan_out``);
the follower applies it; every probe's answer from /v1/score must be vLLM's own hit.
"""

from __future__ import annotations

import aiohttp
import pytest
from follower_kit import LogWriter, follower_config, fresh_topics
from trace_kit import PROBES, Batch, agreement, trace_groups, walk

from hmakv.bridge.fanout import fan_out
from hmakv.consumers.service import IndexService, ServiceConfig

WORKER = "vllm-0"


@pytest.mark.kafka
async def test_score_api_answers_vllms_own_hit_for_every_probe(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = await fresh_topics(kafka_bootstrap, partitions=3)
    service = IndexService(
        ServiceConfig(follower=follower_config(kafka_bootstrap, topics), port=0, snapshot_to="none")
    )
    groups = trace_groups()
    await service.start()
    try:
        async with LogWriter(kafka_bootstrap, topics) as log, aiohttp.ClientSession() as http:

            async def deliver(batches: list[Batch]) -> None:
                await log.events(
                    *(
                        record
                        for batch in batches
                        for record in fan_out(WORKER, 0, batch.seq, batch.decoded, groups)
                    )
                )

            outcomes = await walk(deliver, WORKER, service.url, http)
    finally:
        await service.stop()

    hma, blind = agreement(outcomes)
    with capsys.disabled():
        print(
            f"\nvLLM trace -> Kafka -> index, {len(outcomes)} probes: "
            f"HMA-aware {hma:.1%}, group-blind {blind:.1%}"
        )
    assert len(outcomes) == PROBES
    assert [o.hit_tokens for o in outcomes] == [o.expected_hit_tokens for o in outcomes]
    assert blind < 1.0, "the trace no longer tells a group-blind index apart"
