"""A vLLM general plugin that makes vLLM publish KV events through hmakv's ZMQ publisher.

Why replace rather than add: vLLM validates ``KVEventsConfig.publisher`` as
``Literal["null", "zmq"]``, so a publisher registered under a new name could never be selected,
and ``EventPublisherFactory.register_publisher`` refuses a name that exists. So, when the user
opts in with ``HMAKV_VLLM_PUBLISHER=1``, ``register`` puts ``create_publisher`` in place of
``"zmq"`` in ``EventPublisherFactory._registry``; ``--kv-events-config '{"publisher": "zmq",
...}'`` then gets hmakv's publisher, which speaks the same protocol and adds what
``producer.publisher`` documents (a publish that never blocks the scheduler, drops seen as gaps,
a leading clear). Without the variable nothing changes, so installing hmakv next to vLLM is safe.

Install: the ``vllm.general_plugins`` entry point ``hmakv = "producer.vllm_plugin:register"``;
vLLM calls it in every process it starts (``VLLM_PLUGINS`` can filter plugins by name).
vLLM is imported only inside ``register``, so this module imports without it.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from producer.publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)

OPT_IN_ENV = "HMAKV_VLLM_PUBLISHER"
REPLACED_PUBLISHER = "zmq"
VLLM_KV_EVENTS_MODULE = "vllm.distributed.kv_events"

_warned_unknown: set[frozenset[str]] = set()


def create_publisher(
    data_parallel_rank: int = 0,
    endpoint: str = "tcp://*:5557",
    replay_endpoint: str | None = None,
    buffer_steps: int = 10_000,
    hwm: int = 100_000,
    max_queue_size: int = 100_000,
    topic: str = "",
    **unknown: Any,
) -> ZmqEventPublisher:
    """The constructor vLLM's ``EventPublisherFactory.create`` calls for ``"zmq"``.

    It passes every ``KVEventsConfig`` field but ``publisher`` and ``enable_kv_cache_events`` as
    keywords; fields added by a newer vLLM land in ``unknown`` and are ignored, with one warning
    per set of names, so a vLLM upgrade does not stop the engine from starting.
    """
    if unknown:
        _warn_unknown_once(frozenset(unknown))
    return ZmqEventPublisher(
        data_parallel_rank,
        endpoint,
        replay_endpoint,
        buffer_steps,
        hwm,
        max_queue_size,
        topic,
    )


def register() -> None:
    """vLLM's general-plugin hook: swap in hmakv's publisher if ``HMAKV_VLLM_PUBLISHER=1``."""
    if os.environ.get(OPT_IN_ENV, "").strip() != "1":
        logger.debug("hmakv publisher not enabled (set %s=1 to use it)", OPT_IN_ENV)
        return
    try:
        kv_events = importlib.import_module(VLLM_KV_EVENTS_MODULE)
    except ImportError as error:
        logger.error(
            "%s=1 but vLLM's kv_events module cannot be imported (%s); vLLM keeps its own "
            "publisher",
            OPT_IN_ENV,
            error,
        )
        return
    registry = kv_events.EventPublisherFactory._registry
    if registry.get(REPLACED_PUBLISHER) is create_publisher:
        return  # vLLM may load plugins more than once per process
    registry[REPLACED_PUBLISHER] = create_publisher
    logger.info(
        "hmakv's KV-event publisher replaces vLLM's %r publisher (%s=1)",
        REPLACED_PUBLISHER,
        OPT_IN_ENV,
    )


def _warn_unknown_once(names: frozenset[str]) -> None:
    if names in _warned_unknown:
        return
    _warned_unknown.add(names)
    logger.warning(
        "hmakv publisher ignores KV-events config field(s) it does not know: %s "
        "(a newer vLLM?); the rest of the config applies",
        ", ".join(sorted(names)),
    )
