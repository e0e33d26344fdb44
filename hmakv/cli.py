"""The ``hmakv`` command: one entry point, one subcommand per service or tool.

Each subcommand lives in ``hmakv/commands/<name>.py``: its ``HELP`` (one line in ``hmakv
--help``), ``DESCRIPTION`` and ``EPILOG`` (its own ``--help``), and ``register(parser)``, which
adds its options to the parser made here and sets ``func`` (a callable taking the parsed args
and returning an exit code). Subcommands are discovered from that package, so adding one never
touches this file. The parsers are ConfigArgParse's: every flag is also read from its
``HMAKV_*`` environment variable (``HMAKV_<NAME>_<FLAG>``, see ``argtypes.add_command``), which
``--help`` names.
Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad input (argparse's own convention).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

import configargparse

import hmakv.commands
from hmakv.argtypes import HelpFormatter, add_command


def subcommand_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(hmakv.commands.__path__))


def log_level(text: str) -> str:
    """A logging level name in any case, so that a bad one is bad usage."""
    name, levels = text.strip().upper(), logging.getLevelNamesMapping()
    if name not in levels:
        known = ", ".join(sorted(levels, key=levels.__getitem__))
        raise argparse.ArgumentTypeError(f"unknown level {text!r}; one of {known}")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = configargparse.ArgumentParser(
        prog="hmakv",
        description="HMA-aware KV-cache event pipeline: producer, bridge, index, demo.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="INFO",
        env_var="HMAKV_LOG_LEVEL",
        help="logging level",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in subcommand_names():
        command = importlib.import_module(f"hmakv.commands.{name}")
        command_parser = add_command(
            subparsers,
            name,
            help=command.HELP,
            description=command.DESCRIPTION,
            epilog=command.EPILOG,
        )
        command.register(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
