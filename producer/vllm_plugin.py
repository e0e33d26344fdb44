"""A vLLM general plugin that makes vLLM publish KV events through hmakv's ZMQ publisher.

Why replace rather than add: vLLM validates ``KVEventsConfig.publisher`` as
``Literal["null", "zmq"]``, so a publisher registered under a new name could never be selected,
and ``EventPublisherFactory.register_publisher`` refuses a name that exists. So, when the user
opts in with ``HMAKV_VLLM_PUBLISHER=1``, ``register`` puts ``create_publisher`` in place of
``"zmq"`` in ``EventPublisherFactory._registry``; ``--kv-events-config '{"publisher": "zmq",
...}'`` then gets hmakv's publisher, which speaks the same protocol and adds what
``producer.publisher`` documents (a publish that never blocks the scheduler, drops seen as gaps,
a leading clear). Without the variable nothing changes, so installing hmakv next to vLLM is safe.

Install: the ``vllm.general_plugins`` entry point ``hmakv = "hmakv.producer.vllm_plugin:register"``;
vLLM calls it in every process it starts (``VLLM_PLUGINS`` can filter plugins by name).
vLLM is imported only inside ``register``, so this module imports without it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections import Counter
from typing import Any

from hmakv.producer.curve import CurveSettings, load_key_pair, load_public_key, load_public_keys
from hmakv.producer.events import BlockStored, ExternalBlockHash, KVEvent
from hmakv.producer.publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)

OPT_IN_ENV = "HMAKV_VLLM_PUBLISHER"
BIND_ENV = "HMAKV_VLLM_BIND"
"""``1``: bind the endpoint even where it names a host (``tcp://127.0.0.1:5557``), which vLLM's
rule would connect: the one way to publish on loopback only, since vLLM's config has no flag."""
CURVE_SECRET_KEY_ENV = "HMAKV_VLLM_CURVE_SECRET_KEY"
"""CURVE (``producer.curve``): the engine's ``.key_secret`` file. With it, the two below:"""
CURVE_SERVER_KEY_ENV = "HMAKV_VLLM_CURVE_SERVER_KEY"
"""the public key (file or z85) of the bridge a connecting endpoint reaches (its --bind-sub);"""
CURVE_CLIENTS_ENV = "HMAKV_VLLM_CURVE_CLIENTS"
"""the client keys (a directory of ``*.key`` files, a file or a key) that may read what the
engine binds; unset, any client that knows the engine's public key may."""
REPLACED_PUBLISHER = "zmq"
SNAPSHOT_HASHES_PER_STORE = 4096
"""A snapshot's stores list at most this many hashes each: a consumer keeps every hash it is
told of, so the bridge caps what one event may list, and a large cache is many stores."""
SNAPSHOT_STORES_PER_CHUNK = 32
"""Stores per snapshot batch: 131,072 hashes at most, half the bridge's default cap on one
batch (``EventLimits.max_hashes_per_batch``, 262,144)."""
VLLM_KV_EVENTS_MODULE = "vllm.distributed.kv_events"
VLLM_SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"

_warned_unknown: set[frozenset[str]] = set()


class VllmZmqEventPublisher(ZmqEventPublisher):
    """hmakv's publisher with what vLLM's engine needs beyond ``publish``/``shutdown``.

    vLLM 0.32's engine core asks its scheduler for ``kv_event_publisher.get_publisher_config()``
    in its ready handshake (the front end lists it as the engine's KV-event source); without it
    the engine core dies at startup with an ``AttributeError``. Like vLLM's own publisher, this
    answers with a ``KVEventsConfig`` of the endpoints actually bound (after the DP-rank offset).

    Snapshots read the scheduler's ``KVCacheManager``, which vLLM creates after the publisher:
    ``register`` wraps the scheduler's constructor to hand it over (``cache_manager``).
    """

    publisher_config: Any = None
    cache_manager: Any = None

    def get_publisher_config(self) -> Any:
        return self.publisher_config

    def vllm_snapshot(self) -> list[KVEvent]:
        """The provider: every block vLLM's prefix cache holds, on the engine thread."""
        if self.cache_manager is None:
            raise RuntimeError("vLLM's KV cache manager was never handed to the publisher")
        return snapshot_events(self.cache_manager)


def snapshot_events(manager: Any) -> list[KVEvent]:
    """``BlockStored`` events per group with every cached hash, once per physical copy
    (consumers count copies), ``SNAPSHOT_HASHES_PER_STORE`` at most in each, tagged with the
    group's kind and window as vLLM tags its own stores: the cache as of the batch being
    published.

    Reads vLLM 0.32's block pool: ``cached_block_hash_to_block`` maps a hash with its group id
    (the last 4 bytes) to one block or a dict of copies; it has no public iterator.
    """
    pool = manager.block_pool
    copies: dict[int, Counter[ExternalBlockHash]] = {}
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        counts = copies.setdefault(int.from_bytes(key[-4:], "big"), Counter())
        counts[_external(key[:-4])] += len(blocks) if isinstance(blocks, dict) else 1
    _undo_unpublished(copies, pool.kv_event_queue)
    groups = manager.kv_cache_config.kv_cache_groups
    stores: list[KVEvent] = []
    for group, counts in sorted(copies.items()):
        group_hashes = list((+counts).elements())
        if not group_hashes:
            continue
        kind, window = manager.kv_cache_event_metadata[group]
        stores.extend(
            BlockStored(
                block_hashes=group_hashes[start : start + SNAPSHOT_HASHES_PER_STORE],
                parent_block_hash=None,
                token_ids=[],
                block_size=groups[group].kv_cache_spec.block_size,
                lora_id=None,
                medium=pool.medium,
                lora_name=None,
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
            for start in range(0, len(group_hashes), SNAPSHOT_HASHES_PER_STORE)
        )
    return stores


def _undo_unpublished(
    copies: dict[int, Counter[ExternalBlockHash]], unpublished: list[Any]
) -> None:
    """Take back what the pool did after the batch being published: with async scheduling vLLM
    schedules step S+1 (allocating, evicting) before it publishes step S, and those events wait
    in the pool's queue for batch S+1, which consumers of the snapshot (the state after S) will
    apply. A clear among them leaves no way back: then there is no snapshot."""
    for event in reversed(unpublished):
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            raise RuntimeError("a clear waits to be published: no snapshot until it is")
        group = copies.setdefault(event.group_idx or 0, Counter())
        undo = -1 if kind == "BlockStored" else 1
        group.update({block_hash: undo for block_hash in event.block_hashes})


def _external(digest: bytes) -> ExternalBlockHash:
    """vLLM's ``maybe_convert_block_hash``: the last 8 bytes as an unsigned int by default."""
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip().lower() in ("0", "false"):
        return digest
    return int.from_bytes(digest[-8:], "big")


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
    publisher = VllmZmqEventPublisher(
        data_parallel_rank,
        endpoint,
        replay_endpoint,
        buffer_steps,
        hwm,
        max_queue_size,
        topic,
        snapshot_provider=lambda: publisher.vllm_snapshot(),
        snapshot_chunk_events=SNAPSHOT_STORES_PER_CHUNK,
        bind=os.environ.get(BIND_ENV, "").strip() == "1",
        curve=curve_from_environment(),
    )
    config_type = getattr(sys.modules.get(VLLM_KV_EVENTS_MODULE), "KVEventsConfig", None)
    if config_type is not None:
        publisher.publisher_config = config_type(
            enable_kv_cache_events=True,
            publisher=REPLACED_PUBLISHER,
            endpoint=publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
        )
    return publisher


def curve_from_environment() -> CurveSettings | None:
    """CURVE as the ``HMAKV_VLLM_CURVE_*`` variables set it; a bad key raises ``CurveError``, so
    the engine does not start publishing in the clear when it was meant not to."""
    secret = os.environ.get(CURVE_SECRET_KEY_ENV, "").strip()
    server = os.environ.get(CURVE_SERVER_KEY_ENV, "").strip()
    clients = os.environ.get(CURVE_CLIENTS_ENV, "").strip()
    if not secret:
        if server or clients:
            raise ValueError(
                f"{CURVE_SERVER_KEY_ENV} and {CURVE_CLIENTS_ENV} need {CURVE_SECRET_KEY_ENV}"
            )
        return None
    return CurveSettings(
        load_key_pair(secret),
        load_public_key(server) if server else None,
        load_public_keys(clients) if clients else None,
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
    _log_through_vllm()
    _hand_over_cache_manager()
    registry = kv_events.EventPublisherFactory._registry
    if registry.get(REPLACED_PUBLISHER) is create_publisher:
        return  # vLLM may load plugins more than once per process
    registry[REPLACED_PUBLISHER] = create_publisher
    logger.info(
        "hmakv's KV-event publisher replaces vLLM's %r publisher (%s=1)",
        REPLACED_PUBLISHER,
        OPT_IN_ENV,
    )


def _hand_over_cache_manager() -> None:
    """Wrap vLLM's ``Scheduler.__init__`` so that hmakv's publisher gets the scheduler's
    ``KVCacheManager`` for snapshots; without that scheduler (another vLLM) snapshots are off."""
    try:
        scheduler_module = importlib.import_module(VLLM_SCHEDULER_MODULE)
    except ImportError:
        logger.warning("vLLM's scheduler is not at %s: no snapshots", VLLM_SCHEDULER_MODULE)
        return
    scheduler = scheduler_module.Scheduler
    original = scheduler.__init__
    if getattr(original, "_hmakv_wrapped", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        publisher = getattr(self, "kv_event_publisher", None)
        if isinstance(publisher, VllmZmqEventPublisher):
            publisher.cache_manager = getattr(self, "kv_cache_manager", None)

    init._hmakv_wrapped = True  # type: ignore[attr-defined]
    scheduler.__init__ = init


def _log_through_vllm() -> None:
    """Log as vLLM's own ``vllm.*`` loggers do, once vLLM has configured its logger.

    vLLM configures only the ``vllm`` logger (its handler, INFO, no propagation); a logger
    outside that tree falls back to the root's WARNING level, so the INFO line saying that the
    publisher was replaced never showed in vLLM's log.
    """
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logger.handlers:
        return
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(vllm_logger.level)
    logger.propagate = False


def _warn_unknown_once(names: frozenset[str]) -> None:
    if names in _warned_unknown:
        return
    _warned_unknown.add(names)
    logger.warning(
        "hmakv publisher ignores KV-events config field(s) it does not know: %s "
        "(a newer vLLM?); the rest of the config applies",
        ", ".join(sorted(names)),
    )
