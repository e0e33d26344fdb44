"""Broker processes: spawned in their own process group, stopped as a group, never leaked.

A broker gets its own session so a terminal's Ctrl-C reaches its owner, which then stops it in
order, and so that stopping it can never signal the owner. Liveness checks treat a zombie as gone:
a broker orphaned by ``hmakv kafka start`` may be reparented to an init that never reaps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
_PROC = Path("/proc")


def free_port(consecutive: int = 1) -> int:
    """A loopback port nobody listens on right now, below the kernel's ephemeral range; with
    ``consecutive``, the first of that many (DP ranks bind the base port plus their rank).

    The caller binds it later, often in another process. A port from the ephemeral range (what
    ``bind(0)`` hands out) can meanwhile become the local end of some outgoing connection, such as
    a Kafka client's, and the later bind fails; ports below that range are never handed out so.
    Nor is a port this process handed out in the last ``_HANDED_OUT_S`` seconds: callers pick
    several before binding any (the demo's engines once got the same one).
    """
    lowest_ephemeral = _ephemeral_port_range()[0]
    candidates = range(max(1024, lowest_ephemeral - _PORT_SPAN), lowest_ephemeral - consecutive + 1)
    now = time.monotonic()
    for _ in range(100):
        first = _port_picker.choice(candidates)
        ports = range(first, first + consecutive)
        if any(now - _handed_out.get(port, -_HANDED_OUT_S) < _HANDED_OUT_S for port in ports):
            continue
        if all(_bindable(port) for port in ports):
            _handed_out.update(dict.fromkeys(ports, now))
            return first
    raise OSError(f"no free loopback port in {candidates.start}..{candidates.stop - 1}")


def _bindable(port: int, *, reuse_address: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if reuse_address:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def port_is_free(port: int) -> bool:
    """Whether a listener could bind loopback ``port`` now, as the brokers bind it.

    With SO_REUSEADDR, as Kafka's JVM and Tansu set it: the TIME_WAIT left by a broker that just
    stopped on that port does not count as in use, a listener or any other bound socket does.
    """
    return _bindable(port, reuse_address=True)


# A private generator: tests that seed the global one (hypothesis does) must not repeat ports.
_port_picker = random.Random()
_PORT_SPAN = 12_000
_HANDED_OUT_S = 600.0
_handed_out: dict[int, float] = {}  # port -> when (monotonic); at most the span's ports


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = (Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_accepts(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def spawn_group(
    argv: Sequence[str],
    *,
    log_path: Path,
    cwd: Path,
    die_with_parent: bool,
    env_overrides: Mapping[str, str],
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session, stdout and stderr appended to ``log_path``.

    ``die_with_parent`` asks Linux to SIGKILL the child when the thread that spawned it ends, so a
    test run killed outright still leaves no broker behind.
    """
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, **env_overrides},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_kill_me_with_parent() if die_with_parent else None,
        )


def _kill_me_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook setting PR_SET_PDEATHSIG; libc is loaded here, before the fork."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return set_parent_death_signal


def group_is_running(pgid: int) -> bool:
    """Whether the process group led by ``pgid`` still has its leader running.

    A zombie leader (exited, not yet reaped) counts as gone, and so does a recycled pid that
    leads no group: stopping must never signal a stranger.
    """
    if not _leader_alive(pgid):
        return False
    try:
        return os.getpgid(pgid) == pgid
    except ProcessLookupError:
        return False


def _leader_alive(pid: int) -> bool:
    if has_proc():
        return _proc_state(pid) not in (None, "Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_state(pid: int) -> str | None:
    """The state letter from ``/proc/<pid>/stat``."""
    fields = _proc_stat_fields(pid)
    return fields[0] if fields else None


def has_proc() -> bool:
    """Whether this system has Linux's ``/proc``, where a pid can be told from its successor."""
    return _PROC.joinpath("self").is_dir()


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat`` field 22); None if
    there is no such process (or no ``/proc``).

    A pid is recycled, a pid with its start time is not: a record keeping both names one process.
    """
    fields = _proc_stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def command_line(pid: int) -> str | None:
    """``pid``'s arguments joined by spaces, from ``/proc/<pid>/cmdline``; None if unreadable."""
    try:
        raw = _PROC.joinpath(str(pid), "cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _proc_stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (the state) on: the command name before it, in
    parentheses, may itself hold spaces and parentheses."""
    try:
        return _PROC.joinpath(str(pid), "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def stop_group(pgid: int, *, grace_s: float = 20.0) -> None:
    """SIGTERM the process group ``pgid``, SIGKILL it if its leader outlives ``grace_s``.

    Signalling by group is safe even with a stale pid: Linux never hands out a pid that is still
    some group's id, so ``killpg`` reaches the broker's group or nothing.
    """
    _signal_group(pgid, signal.SIGTERM)
    if _wait_gone(pgid, grace_s):
        return
    _signal_group(pgid, signal.SIGKILL)
    if not _wait_gone(pgid, 10.0):
        raise RuntimeError(f"process group {pgid} survived SIGKILL")


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_is_running(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (IPv4 or IPv6).

    What tells a broker's own listener from another process's on the same port, which answers
    just as well. Without ``/proc`` there is no telling: True, and the caller relies on the
    process being alive.
    """
    if not has_proc():
        return True
    return not _listening_socket_inodes(port).isdisjoint(_socket_inodes(pid))


_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def _listening_socket_inodes(port: int) -> set[str]:
    """The inodes of this network namespace's TCP sockets listening on ``port``."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = _PROC.joinpath("net", table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl, local, remote, state, ..., inode (10th)
            local_port = int(fields[1].rpartition(":")[2], 16)
            if fields[3] == _TCP_LISTEN and local_port == port:
                inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets ``pid`` has open, from its ``socket:[INODE]`` fd links."""
    try:
        fds = list(_PROC.joinpath(str(pid), "fd").iterdir())
    except OSError:
        return set()
    inodes: set[str] = set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    return inodes


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a broker log, for error messages that explain themselves."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])
