"""Coverage-guided fuzzing with atheris (libFuzzer): the wire decoder, the bridge's frame
splitters and the Kafka record decoders, on inputs libFuzzer evolves towards new coverage of
hmakv's Python code (msgspec's C code is not instrumented: its branches do not steer the search).

    python tests/fuzz/atheris_wire.py CORPUS_DIR [libFuzzer flags]

``CORPUS_DIR`` gets vLLM's payloads of every generation as seeds (the first byte of an input
picks the target, see ``one_input``), and collects what libFuzzer finds. Typical flags:
``-runs=N`` (stop after N inputs; none: run until stopped), ``-max_len=4096``, ``-seed=1``
(reproducible), ``-artifact_prefix=DIR/`` (where a crashing input is written), ``-rss_limit_mb``.
A failed check or an exception other than the documented one stops the run with the input saved
as ``crash-<sha1>``; ``python tests/fuzz/atheris_wire.py CRASH_FILE`` replays it.
``tests/fuzz/test_fuzz_atheris.py`` runs a few thousand inputs in CI.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import atheris  # type: ignore[import-untyped]

with atheris.instrument_imports(include=["hmakv"]):
    from hmakv.bridge.frames import (
        EventLimits,
        Rejected,
        RejectReason,
        decode_payload,
        split_live,
        split_reply,
    )
    from hmakv.kvlog import records
    from hmakv.producer.events import DecodedBatch, WireDecodeError, decode, encode
    from hmakv.producer.protocol import SeqFrames

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fuzz_kit import (  # noqa: E402  (beside this file, not a package)
    MEMORY_CONSTANT,
    MEMORY_MULTIPLE,
    SEED_PAYLOADS,
    decode_peak,
)

MEMORY_EVERY = 64  # inputs per decode whose memory is measured (tracemalloc slows it down)
TARGETS = ("decode", "frames", "records")
SMALL_LIMITS = EventLimits(
    max_hashes_per_event=4, max_hashes_per_batch=8, max_token_ids_per_event=64, max_items=2
)
_inputs = 0


def one_input(data: bytes) -> None:
    """The first byte picks the target; the rest is its input."""
    global _inputs
    _inputs += 1
    if not data:
        return
    target, rest = TARGETS[data[0] % len(TARGETS)], data[1:]
    if target == "decode":
        check_decode(rest)
        if _inputs % MEMORY_EVERY == 0:
            check_memory(rest)
    elif target == "frames":
        check_frames(rest)
    else:
        check_records(rest)


def check_decode(payload: bytes) -> None:
    try:
        decoded = decode(payload)
    except WireDecodeError:
        return
    if not isinstance(decoded, DecodedBatch):
        raise AssertionError(f"decode returned {type(decoded)}")
    again = decode(encode(decoded.batch))  # what the bridge passes on decodes again
    if encode(again.batch) != encode(decoded.batch):
        raise AssertionError("a decoded batch does not survive being encoded again")


def check_memory(payload: bytes) -> None:
    peak = decode_peak(payload)
    if peak > MEMORY_MULTIPLE * len(payload) + MEMORY_CONSTANT:
        raise AssertionError(f"decoding {len(payload)} bytes peaked at {peak} bytes")


def as_frames(data: bytes) -> list[bytes]:
    """The input as a multipart message: a frame count (0 to 6), each frame but the last as a
    length byte (0 to 255) and its bytes, the last frame what is left."""
    if not data:
        return []
    count, at, frames = data[0] % 7, 1, []
    for _ in range(count - 1):
        length = data[at] if at < len(data) else 0
        frames.append(data[at + 1 : at + 1 + length])
        at += 1 + length
    if count:
        frames.append(data[at:])
    return frames


def frames_input(frames: list[bytes]) -> bytes:
    """The input ``as_frames`` reads as ``frames``."""
    head = [bytes([len(frame)]) + frame for frame in frames[:-1]]
    return bytes([len(frames)]) + b"".join(head) + (frames[-1] if frames else b"")


def check_frames(data: bytes) -> None:
    frames = as_frames(data)
    for message in (split_live(frames, None), split_live(frames, b"engine-0"), split_reply(frames)):
        if isinstance(message, Rejected):
            check_rejected(message, frames)
        elif isinstance(message, SeqFrames):
            for limits in (EventLimits(), SMALL_LIMITS):
                decoded = decode_payload(message, frames, 1 << 20, limits)
                if isinstance(decoded, Rejected):
                    check_rejected(decoded, frames)


def check_rejected(rejected: Rejected, frames: list[bytes]) -> None:
    if not isinstance(rejected.reason, RejectReason) or not rejected.detail:
        raise AssertionError(f"a rejection without its reason: {rejected!r}")
    if rejected.frames is not frames:
        raise AssertionError("a rejection lost the frames it refused")


def check_records(value: bytes) -> None:
    for decoder in (
        records.decode_event_record,
        records.decode_worker_state,
        records.decode_dead_letter,
    ):
        with contextlib.suppress(records.RecordDecodeError):
            decoder(value)
    with contextlib.suppress(records.RecordDecodeError):
        records.parse_event_key(value)


def write_seeds(corpus: Path) -> None:
    """Every seed payload once per target, named by target and seed."""
    corpus.mkdir(parents=True, exist_ok=True)
    for name, payload in SEED_PAYLOADS.items():
        stem = name.replace("/", "-")
        (corpus / f"decode-{stem}").write_bytes(bytes([0]) + payload)
        live = [b"engine-0", bytes(8), payload]
        reply = [b"", b"engine-0", (7).to_bytes(8, "big"), payload]
        (corpus / f"frames-live-{stem}").write_bytes(bytes([1]) + frames_input(live))
        (corpus / f"frames-reply-{stem}").write_bytes(bytes([1]) + frames_input(reply))
        record = records.encode(
            records.EventRecord("w", 0, 0, 0.0, 0, decode(payload).batch.events)
        )
        (corpus / f"records-{stem}").write_bytes(bytes([2]) + record)


def main() -> None:
    corpora = [Path(arg) for arg in sys.argv[1:] if not arg.startswith("-")]
    if corpora and not corpora[0].is_file():
        write_seeds(corpora[0])
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
