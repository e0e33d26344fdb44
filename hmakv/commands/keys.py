"""``hmakv keys``: CURVE key pairs for engines and bridges, as ``zmq.auth`` writes them.

The files are czmq's certificate format, which ``zmq.auth`` reads and every CURVE-capable ZMQ
tool shares: ``NAME.key`` holds the public key (give it to the other side), ``NAME.key_secret``
the pair (keep it; it is written readable by its owner only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import zmq.auth

from hmakv.argtypes import add_command
from hmakv.producer.curve import load_key_pair

EXIT_OK = 0
EXIT_FAILED = 1

HELP = "make CURVE key pairs for engines and bridges (ZMQ authentication and encryption)"

DESCRIPTION = """\
CURVE keys let the bridge tell real engines from anyone else who reaches its sockets. Each
engine and each bridge gets a key pair; the public keys go to the other side: the bridge's into
every engine's --curve-server-key (or --curve-clients where the bridge connects to the engine),
each engine's into the bridge's engines file (public_key) or --engine ...,key=.
"""

EPILOG = """\
examples:
  hmakv keys generate bridge --dir keys        # keys/bridge.key, keys/bridge.key_secret
  hmakv keys generate engine-a --dir keys
  hmakv engine --bind --endpoint tcp://127.0.0.1:5557 \\
      --curve-secret-key keys/engine-a.key_secret --curve-clients keys/bridge.key
  hmakv bridge --curve-secret-key keys/bridge.key_secret \\
      --engine engine-a=tcp://127.0.0.1:5557,key=keys/engine-a.key"""


def register(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    generate = add_command(
        actions, "generate", help="write NAME.key and NAME.key_secret", parent="keys"
    )
    generate.add_argument(
        "name", type=_key_name, metavar="NAME", help="whose keys: an engine's or bridge's name"
    )
    generate.add_argument("--dir", type=Path, default=Path("."), help="where to write them")
    generate.set_defaults(func=run_generate)


def _key_name(text: str) -> str:
    """A file name's stem: a path in it would write the secret somewhere ``--dir`` does not say."""
    if not text or text != Path(text).name or text.startswith("."):
        raise argparse.ArgumentTypeError(f"{text!r}: a plain name, without a path")
    return text


def run_generate(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    public_file, secret_file = directory / f"{args.name}.key", directory / f"{args.name}.key_secret"
    existing = [str(path) for path in (public_file, secret_file) if path.exists()]
    if existing:  # a new pair would lock out every side that has the old public key
        print(f"hmakv keys: {', '.join(existing)} already there; not overwritten", file=sys.stderr)
        return EXIT_FAILED
    try:
        directory.mkdir(parents=True, exist_ok=True)
        old_mask = os.umask(0o077)  # the secret file is its owner's from the first byte
        try:
            zmq.auth.create_certificates(directory, args.name)
        finally:
            os.umask(old_mask)
    except OSError as error:
        print(f"hmakv keys: {error}", file=sys.stderr)
        return EXIT_FAILED
    public_file.chmod(0o644)
    print(f"public key {load_key_pair(secret_file).public.decode()}")
    print(f"wrote {public_file} (share it) and {secret_file} (keep it)")
    return EXIT_OK
