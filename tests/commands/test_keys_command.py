"""``hmakv keys generate`` and the CURVE flags of ``hmakv engine`` and ``hmakv decode``, as users
run them: the installed commands, the key files they write and read, and an engine that only the
bridge's key may read (issue 16)."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import zmq

from hmakv.kafka.process import free_port
from hmakv.producer.curve import connect_to, load_key_pair, load_public_key
from hmakv.producer.protocol import decode_seq

HMAKV = Path(sys.executable).with_name("hmakv")
WAIT_S = 20.0


def hmakv(*words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HMAKV), *words], capture_output=True, text=True, timeout=60)


def test_generate_writes_a_pair_only_its_owner_reads_and_never_overwrites(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    done = hmakv("keys", "generate", "engine-a", "--dir", str(keys))
    assert done.returncode == 0, done.stderr
    pair = load_key_pair(keys / "engine-a.key_secret")
    assert load_public_key(str(keys / "engine-a.key")) == pair.public
    assert f"public key {pair.public.decode()}" in done.stdout
    assert pair.secret.decode() not in done.stdout + done.stderr
    assert stat.S_IMODE((keys / "engine-a.key_secret").stat().st_mode) == 0o600
    again = hmakv("keys", "generate", "engine-a", "--dir", str(keys))
    assert again.returncode == 1 and "not overwritten" in again.stderr
    assert load_key_pair(keys / "engine-a.key_secret") == pair
    path_name = hmakv("keys", "generate", "../elsewhere", "--dir", str(keys))
    assert path_name.returncode == 2 and "without a path" in path_name.stderr


def test_an_engine_with_curve_keys_is_read_by_the_bridges_key_only(tmp_path: Path) -> None:
    for name in ("engine", "bridge", "stranger"):
        assert hmakv("keys", "generate", name, "--dir", str(tmp_path)).returncode == 0
    half = hmakv("engine", "--curve-server-key", str(tmp_path / "bridge.key"))
    assert half.returncode == 2 and "need --curve-secret-key" in half.stderr
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    command = [
        *(str(HMAKV), "engine", "--no-model", "--status-interval", "0", "--rate", "50"),
        *("--bind", "--endpoint", endpoint),
        *("--curve-secret-key", str(tmp_path / "engine.key_secret")),
        *("--curve-clients", str(tmp_path / "bridge.key")),
    ]
    engine = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        engine_key = load_public_key(str(tmp_path / "engine.key"))
        bridge, stranger = (ctx.socket(zmq.SUB) for _ in range(2))
        connect_to(bridge, load_key_pair(tmp_path / "bridge.key_secret"), engine_key)
        connect_to(stranger, load_key_pair(tmp_path / "stranger.key_secret"), engine_key)
        for sub in (bridge, stranger):
            sub.connect(endpoint)
            sub.subscribe(b"")
        deadline = time.monotonic() + WAIT_S
        while not bridge.poll(50):
            assert time.monotonic() < deadline and engine.poll() is None, "the engine sent nothing"
        assert decode_seq(bridge.recv_multipart()[1]) >= 0
        assert not stranger.poll(300)
        watch = ("decode", "--zmq", endpoint, "--count", "1", "--timeout", "5")
        server = ("--curve-server-key", str(tmp_path / "engine.key"))
        admitted = hmakv(*watch, "--curve-secret-key", str(tmp_path / "bridge.key_secret"), *server)
        assert admitted.returncode == 0 and '"events"' in admitted.stdout, admitted.stderr
        refused = hmakv(
            *watch, "--curve-secret-key", str(tmp_path / "stranger.key_secret"), *server
        )
        assert refused.stdout == ""
    finally:
        ctx.destroy(linger=0)
        engine.terminate()
        engine.communicate(timeout=WAIT_S)
