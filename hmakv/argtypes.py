"""Argument types, and the parser pieces and options shared by the ``hmakv`` subcommands.

argparse turns a ``ValueError`` from a type into "invalid <type name> value", so each type's
``__name__`` is the phrase a user should read there. Every flag has an environment variable:
ConfigArgParse reads it (``HMAKV_<COMMAND>_<FLAG>`` from ``add_command``, or the ``env_var`` a
shared option names) as if the flag were given, so types and choices check it alike, and
``--help`` prints it after the flag's help.
"""

from __future__ import annotations

import argparse
import math

from hmakv.kvlog.kafka_client import SECURITY_SETTINGS, KafkaSecurity
from hmakv.kvlog.records import DEFAULT_TOPIC_PREFIX
from hmakv.producer.curve import (
    CurveError,
    KeyPair,
    load_key_pair,
    load_public_key,
    load_public_keys,
)


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


def curve_key_pair(text: str) -> KeyPair:
    """A ``.key_secret`` file; the problem in its words (argparse's "invalid value" would hide
    it)."""
    try:
        return load_key_pair(text)
    except CurveError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def curve_public_key(text: str) -> bytes:
    try:
        return load_public_key(text)
    except CurveError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def curve_public_keys(text: str) -> frozenset[bytes]:
    try:
        return load_public_keys(text)
    except CurveError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


positive_int.__name__ = "positive integer"
non_negative_int.__name__ = "non-negative integer"
positive_float.__name__ = "positive number"
non_negative_float.__name__ = "non-negative number"
host_port.__name__ = "HOST:PORT"
bootstrap_servers.__name__ = "HOST[:PORT][,...]"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written, and each option's default after its help where it
    has one: None, False and empty defaults mean "not set", which the help itself explains."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in ("", []):
            return action.help
        return super()._get_help_string(action)


def add_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str | None = None,
    epilog: str | None = None,
    parent: str | None = None,
) -> argparse.ArgumentParser:
    """A (sub)command's parser, whose flags are also read from ``HMAKV_<NAME>_<FLAG>`` (``-`` as
    ``_``; an action of another command, ``parent``, shares that command's variables), but for
    a flag that names its own variable (``env_var=``)."""
    prefix = f"HMAKV_{(parent or name).upper()}_"
    return subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
        auto_env_var_prefix=prefix,
    )


def add_seconds(
    parser: argparse.ArgumentParser,
    flag: str,
    what: str,
    *,
    default: str | None = None,
    zero: bool = False,
) -> None:
    """A duration flag: a positive number of seconds, or with ``zero`` also 0 (its help says
    what 0 means)."""
    parser.add_argument(
        flag,
        type=non_negative_float if zero else positive_float,
        default=default,
        metavar="SECONDS",
        help=what,
    )


def add_listen(parser: argparse.ArgumentParser, what: str, default: str | None = None) -> None:
    parser.add_argument(
        "--listen", type=host_port, default=default, metavar="HOST:PORT", help=f"serve {what} here"
    )


# Kafka's security settings, as every client takes them: option (after --kafka-), its default
# and what it is. Their variables are HMAKV_KAFKA_<OPTION>, whichever command reads them.
_KAFKA_SECURITY = (
    ("security-protocol", "PLAINTEXT", "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"),
    ("sasl-mechanism", "PLAIN", "SASL mechanism, e.g. SCRAM-SHA-512"),
    ("sasl-username", "", "SASL user name"),
    ("sasl-password", "", "SASL password (better in its variable: flags show in ps)"),
    ("ssl-cafile", "", "file of the CA certificates that sign the brokers' certificates"),
    ("ssl-certfile", "", "this client's certificate file, for brokers that check clients"),
    ("ssl-keyfile", "", "the private key file of --kafka-ssl-certfile"),
)


def _security_variable(option: str) -> str:
    return "HMAKV_KAFKA_" + option.upper().replace("-", "_")


def add_kafka_options(
    parser: argparse.ArgumentParser, topics: str, default: str | None = None
) -> None:
    """``--kafka`` (required without a ``default``), ``--topic-prefix`` and Kafka's security
    options, as every command that reads or writes hmakv's topics takes them (one variable
    each for all of them); ``topics`` names the topics the prefix makes."""
    parser.add_argument(
        "--kafka",
        type=bootstrap_servers,
        default=default,
        required=default is None,
        env_var="HMAKV_KAFKA_BOOTSTRAP",
        metavar="HOST:PORT[,...]",
        help="Kafka bootstrap servers",
    )
    parser.add_argument(
        "--topic-prefix",
        default=DEFAULT_TOPIC_PREFIX,
        env_var="HMAKV_TOPIC_PREFIX",
        metavar="PREFIX",
        help=f"topics are {topics}",
    )
    for option, value, what in _KAFKA_SECURITY:
        parser.add_argument(
            f"--kafka-{option}",
            default=value,
            env_var=_security_variable(option),
            metavar=option.rpartition("-")[2].upper(),
            help=what,
        )


def kafka_security(args: argparse.Namespace) -> KafkaSecurity:
    """The security options as the Kafka clients' settings; ValueError for one that cannot
    connect (an unknown protocol, SASL without a password, ...)."""
    return KafkaSecurity.from_settings(
        **{name: getattr(args, "kafka_" + name) for name in SECURITY_SETTINGS}
    )
