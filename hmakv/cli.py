"""The ``hmakv`` command: one entry point, one subcommand per service or tool.

Each subcommand lives in ``hmakv/commands/<name>.py`` and exposes ``register(subparsers)``, which
adds its parser and sets ``func`` (a callable taking the parsed args and returning an exit code).
Subcommands are discovered from that package, so adding one never touches this file.
Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad input (argparse's own convention).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Sequence

import hmakv.commands


def subcommand_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(hmakv.commands.__path__))


def log_level(text: str) -> str:
    """A logging level name in any case. As the ``type`` of ``--log-level`` it checks the
    HMAKV_LOG_LEVEL default too (argparse converts string defaults), so a bad one is bad usage."""
    name, levels = text.strip().upper(), logging.getLevelNamesMapping()
    if name not in levels:
        known = ", ".join(sorted(levels, key=levels.__getitem__))
        raise argparse.ArgumentTypeError(
            f"unknown level {text!r} (from --log-level or HMAKV_LOG_LEVEL); one of {known}"
        )
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hmakv",
        description="HMA-aware KV-cache event pipeline: producer, bridge, index, demo.",
    )
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=os.environ.get("HMAKV_LOG_LEVEL", "INFO"),
        help="logging level (env HMAKV_LOG_LEVEL, default INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in subcommand_names():
        importlib.import_module(f"hmakv.commands.{name}").register(subparsers)
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
