"""``hmakv decode``: vLLM KV-event payloads to JSON lines, from files or a live publisher.

Operators debug a routing miss by looking at what an engine really sent; this prints it with
the same tolerant decoder the bridge uses, so what you see is what the pipeline reads.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable

import msgspec
import zmq

from hmakv.argtypes import add_seconds, curve_key_pair, curve_public_key, positive_int
from hmakv.producer.curve import connect_to
from hmakv.producer.events import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DecodedBatch,
    KVEvent,
    WireDecodeError,
    decode,
)
from hmakv.producer.protocol import Malformed, parse_live

EXIT_OK = 0
EXIT_RUNTIME_FAILURE = 1
EXIT_BAD_INPUT = 2

HELP = "decode vLLM KV-event payloads (hex lines, a raw file, or a live ZMQ publisher)"

DESCRIPTION = """\
Decode vLLM KV-cache event batches (msgpack, any vLLM generation) and print one JSON object per
batch: {"ts", "data_parallel_rank", "events": [{"type", ...vLLM field names...}],
"unknown_event_types"}. Byte values print as lowercase hex; fields an older vLLM did not send
print as null.

Input, one of:
  FILE or stdin   msgpack payloads as hex, one per line (blank lines are skipped)
  --raw FILE      one raw binary payload
  --zmq ENDPOINT  subscribe to a live publisher (vLLM's PUB socket) and print each batch with
                  its "seq" added, like kcat for KV events

A bad line or frame is reported on stderr (line number or seq, and why) and skipped."""

EPILOG = """\
exit codes: 0 ok, 1 runtime failure (--count not reached before --timeout, or nothing received),
2 bad usage or input (some line or frame did not decode).

examples:
  hmakv decode payloads.hex
  hmakv decode --raw batch.msgpack
  hmakv decode --zmq tcp://engine-0:5557 --topic kv-events --count 10 | jq .events"""


def register(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "file", nargs="?", metavar="FILE", help="hex payloads, one per line; '-' or absent: stdin"
    )
    source.add_argument("--raw", metavar="FILE", help="one raw binary payload ('-': stdin)")
    source.add_argument(
        "--zmq", metavar="ENDPOINT", help="subscribe to a publisher, e.g. tcp://host:5557"
    )
    add = parser.add_argument
    add("--topic", metavar="T", default="", help="ZMQ topic prefix to subscribe to (default: all)")
    add(
        "--count",
        type=positive_int,
        metavar="N",
        help="with --zmq: stop after N messages (default: never)",
    )
    add_seconds(
        parser,
        "--timeout",
        "with --zmq: stop when no message arrives for this long (default: wait forever)",
    )
    add(
        "--max-bytes",
        type=positive_int,
        default=str(DEFAULT_MAX_PAYLOAD_BYTES),
        metavar="BYTES",
        help="refuse payloads larger than this",
    )
    add(
        "--curve-secret-key",
        type=curve_key_pair,
        metavar="FILE",
        help="with --zmq: a CURVE engine's admitted client's .key_secret file (hmakv keys)",
    )
    add(
        "--curve-server-key",
        type=curve_public_key,
        metavar="FILE|KEY",
        help="with --zmq and --curve-secret-key: the engine's public key",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run_mode(args)
    except BrokenPipeError:
        # The reader (head, jq -n ...) has gone: stop quietly, as cat does, and keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _run_mode(args: argparse.Namespace) -> int:
    if args.raw is not None:
        return _decode_raw(args.raw, args.max_bytes)
    if args.zmq is not None:
        return _follow_publisher(args)
    return _decode_hex_lines(args.file or "-", args.max_bytes)


# --- Files -------------------------------------------------------------------------------------


def _decode_raw(path: str, max_bytes: int) -> int:
    try:
        payload = _read_bytes(path)
    except OSError as error:
        return _fail(f"cannot read {path}: {error.strerror or error}", EXIT_BAD_INPUT)
    try:
        decoded = decode(payload, max_bytes=max_bytes)
    except WireDecodeError as error:
        return _fail(f"{path}: {error}", EXIT_BAD_INPUT)
    _print_batch(decoded)
    return EXIT_OK


def _read_bytes(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as file:
        return file.read()


def _decode_hex_lines(path: str, max_bytes: int) -> int:
    if path == "-":
        return _decode_lines("<stdin>", sys.stdin, max_bytes)
    # Opened apart from the `with` so that only opening is a read error: an OSError while
    # printing (a closed pipe) must not be reported as "cannot read".
    try:
        file = open(path, encoding="ascii", errors="replace")  # noqa: SIM115
    except OSError as error:
        return _fail(f"cannot read {path}: {error.strerror or error}", EXIT_BAD_INPUT)
    with file:
        return _decode_lines(path, file, max_bytes)


def _decode_lines(name: str, lines: Iterable[str], max_bytes: int) -> int:
    """Print every batch that decodes and report every line that does not, then go on."""
    failures = 0
    for line_number, line in enumerate(lines, start=1):
        reason = _print_hex_payload(line.strip(), max_bytes)
        if reason is not None:
            failures += 1
            _report(f"{name}:{line_number}: {reason}")
    return EXIT_BAD_INPUT if failures else EXIT_OK


def _print_hex_payload(text: str, max_bytes: int) -> str | None:
    """Print one hex payload as JSON; return why it is malformed instead, if it is."""
    if not text:
        return None
    try:
        payload = bytes.fromhex(text)
    except ValueError:
        return "not a hex string"
    try:
        decoded = decode(payload, max_bytes=max_bytes)
    except WireDecodeError as error:
        return str(error)
    _print_batch(decoded)
    return None


# --- A live publisher --------------------------------------------------------------------------


def _follow_publisher(args: argparse.Namespace) -> int:
    keys, server_key = args.curve_secret_key, args.curve_server_key
    if (keys is None) != (server_key is None):
        return _fail("--curve-secret-key and --curve-server-key go together", EXIT_BAD_INPUT)
    with zmq.Context() as context, context.socket(zmq.SUB) as socket:
        socket.setsockopt(zmq.LINGER, 0)  # never hang at exit on an unreachable endpoint
        if keys is not None:
            connect_to(socket, keys, server_key)
        try:
            socket.connect(args.zmq)
        except zmq.ZMQError as error:
            return _fail(f"cannot connect to {args.zmq}: {error}", EXIT_BAD_INPUT)
        socket.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
        return _print_messages(socket, args.count, args.timeout, args.max_bytes)


def _print_messages(
    socket: zmq.Socket[bytes], count: int | None, timeout: float | None, max_bytes: int
) -> int:
    poll_ms = None if timeout is None else int(timeout * 1000)
    received = failures = 0
    try:
        while count is None or received < count:
            if not socket.poll(poll_ms):
                if _silence_is_a_failure(received, count, timeout):
                    return EXIT_RUNTIME_FAILURE
                break
            frames = socket.recv_multipart()
            received += 1
            reason = _print_message(frames, max_bytes)
            if reason is not None:
                failures += 1
                _report(f"message {received}: {reason}")
    except KeyboardInterrupt:
        pass  # Ctrl-C is how one stops following a stream: end as if it had ended
    return EXIT_BAD_INPUT if failures else EXIT_OK


def _print_message(frames: list[bytes], max_bytes: int) -> str | None:
    """Print one vLLM message as JSON; return why it is malformed instead, if it is."""
    message = parse_live(frames)
    if isinstance(message, Malformed):
        return message.detail
    try:
        decoded = decode(message.payload, max_bytes=max_bytes)
    except WireDecodeError as error:
        return f"seq {message.seq}: {error}"
    _print_batch(decoded, seq=message.seq)
    return None


def _silence_is_a_failure(received: int, count: int | None, timeout: float | None) -> bool:
    """Whether --timeout of silence means something is wrong, which is then reported.

    Silence after some messages just ends a follow; silence from the start, or before --count
    messages arrived, means a wrong endpoint or topic, or an engine that stopped.
    """
    if received == 0:
        _report(f"no message within {timeout} s")
        return True
    if count is not None:
        _report(f"only {received} of {count} messages before {timeout} s of silence")
        return True
    return False


# --- Output ------------------------------------------------------------------------------------

_json_encoder = msgspec.json.Encoder()


def _batch_as_json(decoded: DecodedBatch, *, seq: int | None = None) -> dict[str, object]:
    """The printed form: every field of every event under vLLM's names, bytes as hex."""
    head: dict[str, object] = {} if seq is None else {"seq": seq}
    return head | {
        "ts": decoded.batch.ts,
        "data_parallel_rank": decoded.batch.data_parallel_rank,
        "events": [_event_as_json(event) for event in decoded.batch.events],
        "unknown_event_types": decoded.unknown_event_types,
    }


def _event_as_json(event: KVEvent) -> dict[str, object]:
    fields = {name: _hex_bytes(getattr(event, name)) for name in event.__struct_fields__}
    return {"type": type(event).__name__} | fields


def _hex_bytes(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_hex_bytes(item) for item in value]
    return value


def _print_batch(decoded: DecodedBatch, *, seq: int | None = None) -> None:
    line = _json_encoder.encode(_batch_as_json(decoded, seq=seq))
    sys.stdout.write(line.decode() + "\n")
    sys.stdout.flush()


def _report(message: str) -> None:
    print(f"hmakv decode: {message}", file=sys.stderr, flush=True)


def _fail(message: str, code: int) -> int:
    _report(message)
    return code
