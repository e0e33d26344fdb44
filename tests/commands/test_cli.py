"""The ``hmakv`` entry point: its own options, and the variable of every subcommand's every flag."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from hmakv.cli import build_parser
from hmakv.commands.index import service_config

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


# --- every flag has a variable ---------------------------------------------------------------

# A value each option type accepts, by the type's name (an option with choices takes one of
# them, a flag "1"); a new type needs a sample here.
# A CURVE key pair for the key flags' samples, made once for the module.
_PUBLIC_KEY, _SECRET_KEY = zmq.auth.create_certificates(tempfile.mkdtemp(), "sample")

SAMPLES = {
    None: "x",
    "int": "3",
    "float": "2.5",
    "Path": "some/path",
    "positive integer": "3",
    "non-negative integer": "3",
    "positive number": "2.5",
    "non-negative number": "2.5",
    "HOST:PORT": "127.0.0.1:1",
    "HOST[:PORT][,...]": "kafka-1:9093,kafka-2",
    "log_level": "debug",
    "_positive_int": "3",
    "_directory": "some/dir",
    "_shard": "1/2",
    "_engine_flags": "a=tcp://h:1,replay=tcp://h:2;b=tcp://g:1",
    "MEDIUM=WEIGHT[,...]": "GPU=1,CPU=0.5",
    "kafka, file:PATH or none": "none",
    "auto or SECONDS": "2.5",
    "tansu, apache or HOST:PORT": "apache",
    "engine count (2 to 6)": "3",
    "_engine_choices": "gpt-oss-like:chat,gemma3-like:documents",
    "_token_file": __file__,  # any readable, non-empty file
    "curve_key_pair": _SECRET_KEY,
    "curve_public_key": _PUBLIC_KEY,
    "curve_public_keys": _PUBLIC_KEY,
    "_key_name": "engine-a",
    "PROFILE[,...]": "gpt-oss-like,gemma3-like",
    "WORKLOAD[,...]": "chat,burst",
    "ROUTER[,...]": "hmakv,round-robin",
    "N[,...]": "4,16",
}


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """The words of every command line that reaches a parser without subcommands."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not commands:
        yield path
    for action in commands:
        for name, subparser in action.choices.items():
            yield from _leaves(subparser, (*path, name))


def _parsers_on(
    top: argparse.ArgumentParser, path: tuple[str, ...]
) -> list[argparse.ArgumentParser]:
    parsers = [top]
    for word in path:
        (command,) = [a for a in parsers[-1]._actions if isinstance(a, argparse._SubParsersAction)]
        parsers.append(command.choices[word])
    return parsers


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def _sample(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "1"
    if action.choices:
        return str(next(c for c in action.choices if c != action.default))
    return SAMPLES[getattr(action.type, "__name__", None)]


def _help_of(
    top: argparse.ArgumentParser, path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> str:
    """--help of the parser ``path`` reaches, on one line; parsing assigns the variables of the
    parsers on the way."""
    with pytest.raises(SystemExit):
        top.parse_args([*path, "--help"])
    return " ".join(capsys.readouterr().out.split())


def _command_line(
    path: tuple[str, ...], leaf: argparse.ArgumentParser, omit: argparse.Action
) -> list[str]:
    """``path`` with what its parser, ``leaf``, requires (but ``omit``): required options and
    positionals."""
    words = list(path)
    for action in leaf._actions:
        if action is omit or isinstance(action, argparse._HelpAction):
            continue
        if action.required and action.option_strings:
            words += [action.option_strings[-1], _sample(action)]
        elif not action.option_strings and action.nargs not in ("?", "*"):
            words.append(_sample(action))
    return words


def _with_flag(
    path: tuple[str, ...], leaf: argparse.ArgumentParser, depth: int, action: argparse.Action
) -> list[str]:
    """The command line with ``action``'s flag, after the words of the parser it belongs to."""
    words = _command_line(path, leaf, omit=action)
    flag = [action.option_strings[-1]] + ([] if action.nargs == 0 else [_sample(action)])
    return words[:depth] + flag + words[depth:]


@pytest.mark.parametrize("path", list(_leaves(build_parser())), ids=" ".join)
def test_every_flag_has_a_variable_that_does_what_the_flag_does(
    path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each option of each parser on the way to a subcommand (the entry point's own too) names
    its HMAKV_* variable in --help, and setting the variable parses as giving the flag does."""
    for variable in [name for name in os.environ if name.startswith("HMAKV_")]:
        monkeypatch.delenv(variable)
    top = build_parser()
    parsers = _parsers_on(top, path)
    for depth, parser in enumerate(parsers):
        help_text = _help_of(top, path[:depth], capsys)
        for action in _options(parser):
            variable = getattr(action, "env_var", None) or ""
            assert variable.startswith("HMAKV_"), f"{path[:depth]} {action.option_strings}"
            assert f"[env var: {variable}]" in help_text, variable
            words = _command_line(path, parsers[-1], omit=action)
            flagged = build_parser().parse_args(_with_flag(path, parsers[-1], depth, action))
            monkeypatch.setenv(variable, _sample(action))
            from_variable = build_parser().parse_args(words)
            monkeypatch.delenv(variable)
            assert vars(from_variable) == vars(flagged), variable
            if not action.required:
                unset = build_parser().parse_args(words)
                assert getattr(unset, action.dest) != getattr(flagged, action.dest), variable


def test_the_index_reads_its_api_token_from_a_file_and_never_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ps3cret\n")
    args = build_parser().parse_args(
        ["index", "--kafka", "127.0.0.1:9092", "--api-token-file", str(token_file)]
    )
    config = service_config(args)
    assert config.api_token == "t0ps3cret"
    assert "t0ps3cret" not in repr(config)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(
            ["index", "--kafka", "k:1", "--api-token-file", str(tmp_path / "empty")]
        )
    assert refused.value.code == 2
    assert "is empty" in capsys.readouterr().err
