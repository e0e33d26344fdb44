"""Argument types and options shared by the ``hmakv`` subcommands.

argparse turns a ``ValueError`` from a type into "invalid <type name> value", so each type's
``__name__`` is the phrase a user should read there.
"""

from __future__ import annotations

import argparse
import math
import os

from hmakv.kvlog.records import DEFAULT_TOPIC_PREFIX


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(text)
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(text)
    return value


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT``, with an IPv6 host in brackets (``[::1]:8181``)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(text)
    return host.strip("[]"), int(port)


def bootstrap_servers(text: str) -> str:
    """Kafka's ``HOST[:PORT][,...]``, checked here so a typo (in the flag or its environment
    variable) is one line and exit 2, not a traceback from the Kafka client later."""
    for server in text.split(","):
        host, sep, port = server.strip().rpartition(":")
        if not sep:
            host, port = server.strip(), "9092"
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
            raise ValueError(text)
    return text


positive_int.__name__ = "positive integer"
non_negative_int.__name__ = "non-negative integer"
positive_float.__name__ = "positive number"
non_negative_float.__name__ = "non-negative number"
host_port.__name__ = "HOST:PORT"
bootstrap_servers.__name__ = "HOST[:PORT][,...]"


def add_cluster_options(parser: argparse.ArgumentParser, topics: str) -> None:
    """``--kafka`` (required, or its environment variable) and ``--topic-prefix``, as the
    services that read hmakv's topics take them; ``topics`` names those the prefix makes."""
    parser.add_argument(
        "--kafka",
        type=bootstrap_servers,
        default=os.environ.get("HMAKV_KAFKA_BOOTSTRAP"),
        metavar="HOST:PORT[,...]",
        help="Kafka bootstrap servers (env HMAKV_KAFKA_BOOTSTRAP; required)",
    )
    parser.add_argument(
        "--topic-prefix",
        default=os.environ.get("HMAKV_TOPIC_PREFIX", DEFAULT_TOPIC_PREFIX),
        help=f"topics are {topics} (env HMAKV_TOPIC_PREFIX, default {DEFAULT_TOPIC_PREFIX})",
    )
