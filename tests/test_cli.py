"""The ``hmakv`` entry point's own options, before any subcommand runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hmakv.cli import build_parser

HMAKV = Path(sys.executable).with_name("hmakv")


@pytest.mark.parametrize(
    ("arguments", "environment"),
    [
        (["--log-level", "verbose"], {}),
        ([], {"HMAKV_LOG_LEVEL": "verbose"}),
    ],
    ids=["flag", "environment"],
)
def test_an_unknown_log_level_is_bad_usage(
    arguments: list[str], environment: dict[str, str]
) -> None:
    """logging rejects an unknown level with a ValueError, which was a traceback and exit 1; a
    mistyped flag or variable is bad usage (exit 2), and the message lists the levels there are.
    A subprocess: in pytest's own process logging is already set up and never sees the level."""
    done = subprocess.run(
        [str(HMAKV), *arguments, "hash", "--block-size", "4"],
        env={**os.environ, **environment},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--log-level: unknown level 'verbose'" in done.stderr
    assert "DEBUG, INFO, WARN, WARNING" in done.stderr
    assert "Traceback" not in done.stderr


def test_log_levels_are_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check must not refuse what worked before: any case, from the flag or the variable."""
    monkeypatch.setenv("HMAKV_LOG_LEVEL", "debug")
    hash_args = ["hash", "--block-size", "4"]
    assert build_parser().parse_args(hash_args).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "Warning", *hash_args]).log_level == "WARNING"
