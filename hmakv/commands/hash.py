"""``hmakv hash``: the block hashes vLLM would publish for a prompt, computed outside the engine.

Lets an operator check that a router and an engine agree (hash function, seed, block size,
extra keys) by comparing this output with the hashes in the engine's BlockStored events.
"""

from __future__ import annotations

import argparse
import json
import sys

from hmakv.producer.hashing import (
    HASH_FUNCTIONS,
    BlockHasher,
    block_extra_keys,
    external,
    group_block_hashes,
)

USAGE_ERROR = 2

HELP = "print vLLM-compatible block hashes for token ids read on stdin"

DESCRIPTION = """\
Read token ids (a JSON list of integers) on stdin and print, one line per full block, the
external 64-bit block hash vLLM puts in its KV events (or the full digest with --hex).
A trailing partial block is not hashed, as in vLLM.

The settings must match the engine's: --prefix-caching-hash-algo, its PYTHONHASHSEED (recent vLLM
without PYTHONHASHSEED seeds sha256_cbor with "vllm-none-hash"; older ones seed randomly, and
then nobody outside the engine can reproduce its hashes), the block size, the request's LoRA
name and cache_salt. vLLM's pickle-based "sha256" and "xxhash" cannot be reproduced outside the
engine process.
"""

EPILOG = """\
example:
  echo '[1, 2, 3, 4, 5, 6, 7, 8]' | hmakv hash --seed 0 --block-size 4
"""


def register(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--hash-fn",
        default="sha256_cbor",
        env_var="HMAKV_HASH_FN",
        help=f"one of {', '.join(HASH_FUNCTIONS)}",
    )
    add("--seed", default="0", help="the engine's PYTHONHASHSEED")
    add("--block-size", type=_positive_int, required=True, help="tokens per hash block")
    add(
        "--group-block-size",
        type=_positive_int,
        help="print hashes of a KV-cache group whose block size is this multiple of --block-size",
    )
    add("--lora-name", help="the request's LoRA adapter name")
    add("--cache-salt", help="the request's cache_salt")
    add("--hex", action="store_true", help="print full digests in hex instead of external ints")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        hasher = BlockHasher(args.hash_fn, seed=args.seed)
        token_ids = _parse_token_ids(sys.stdin.read())
        hashes = _hashes(hasher, token_ids, args)
    except ValueError as error:
        print(f"hmakv hash: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    for block_hash in hashes:
        print(block_hash.hex() if args.hex else external(block_hash))
    return 0


def _hashes(hasher: BlockHasher, token_ids: list[int], args: argparse.Namespace) -> list[bytes]:
    block_size: int = args.block_size
    extra_keys = block_extra_keys(
        len(token_ids) // block_size,
        block_size,
        lora_name=args.lora_name,
        cache_salt=args.cache_salt,
    )
    hashes = hasher.block_hashes(token_ids, block_size, extra_keys=extra_keys)
    if args.group_block_size is None:
        return hashes
    return list(group_block_hashes(hashes, block_size, args.group_block_size))


def _parse_token_ids(text: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"stdin is not JSON ({error})") from None
    if not isinstance(value, list) or not all(_is_token_id(item) for item in value):
        raise ValueError("stdin must be a JSON list of non-negative integer token ids")
    return value


def _is_token_id(item: object) -> bool:
    return type(item) is int and item >= 0


def _positive_int(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {number}")
    return number
