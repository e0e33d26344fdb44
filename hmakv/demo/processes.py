"""The demo's child processes: each in its own process group, its output in its own log file.

Own groups mean a terminal's Ctrl-C reaches only the demo, which then stops everything in order
(engines first, so the bridge and the index can still deliver their last events). Linux's
parent-death signal is the backstop: if the demo itself is killed outright, its children die with
it instead of holding ports. Children must therefore be spawned from the main thread, whose
lifetime is the demo's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hmakv.kafka.process import group_is_running, log_tail, spawn_group, stop_group

# faulthandler: a child that ignores SIGTERM is sent SIGABRT before SIGKILL, so its log ends
# with every thread's stack, which says why it hung.
_CHILD_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "NO_COLOR": "1"}
_ABORT_WAIT_S = 2.0


def hmakv_command() -> list[str]:
    """The ``hmakv`` executable of this installation (what a user runs), or ``python -m``."""
    script = Path(sys.executable).with_name("hmakv")
    if script.exists():
        return [str(script)]
    found = shutil.which("hmakv")
    return [found] if found else [sys.executable, "-m", "hmakv.cli"]


@dataclass
class Child:
    """One started service: its name, command, log and process."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]
    terminated: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def terminate(self) -> None:
        """Ask the whole group to stop (SIGTERM), once, without waiting.

        Once only: a service restores the default SIGTERM action while it shuts down, so a
        second SIGTERM would kill it halfway through its drain.
        """
        if not self.terminated:
            self.terminated = True
            self._signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group; after ``grace_s`` SIGABRT (a stack dump), then SIGKILL.

        Returns the exit code: negative when a signal ended it, ``-SIGABRT`` or ``-SIGKILL``
        when it did not stop on its own.
        """
        if self.process.poll() is None:
            self.terminate()
            try:
                return self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=_ABORT_WAIT_S)
        if group_is_running(self.pid) or self.process.poll() is None:
            stop_group(self.pid, grace_s=0.0)
        return self.process.wait()

    def _signal(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)


class ChildExited(RuntimeError):
    """A service the demo needs exited on its own; the message carries its log tail."""


@dataclass
class Children:
    """Every process the demo started, stopped in reverse order of starting unless told."""

    workdir: Path
    started: list[Child] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str]) -> Child:
        log_path = self.workdir / f"{name}.log"
        log_path.write_bytes(b"")  # a reused workdir: this run's log only
        process = spawn_group(
            list(argv),
            log_path=log_path,
            cwd=self.workdir,
            die_with_parent=True,
            env_overrides=_CHILD_ENV,
        )
        child = Child(name=name, argv=list(argv), log_path=log_path, process=process)
        self.started.append(child)
        return child

    def check_alive(self) -> None:
        """Raise ``ChildExited`` for the first service that is no longer running."""
        for child in self.started:
            code = child.exit_code()
            if code is not None:
                raise ChildExited(
                    f"{child.name} exited with code {code}; the end of {child.log_path}:\n"
                    f"{child.log_tail()}"
                )

    def stop(self, children: Sequence[Child], grace_s: float) -> dict[str, int | None]:
        """Stop these children: SIGTERM to all at once, so they drain in parallel, then wait
        for each (SIGKILL after ``grace_s``). Returns each one's exit code."""
        for child in children:
            if child.exit_code() is None:
                child.terminate()
        return {child.name: child.stop(grace_s) for child in children}

    def stop_all(self, grace_s: float) -> dict[str, int | None]:
        """Stop whatever still runs, newest first; calling it again is harmless."""
        return self.stop(list(reversed(self.started)), grace_s)

    def running_pids(self) -> list[int]:
        return [child.pid for child in self.started if group_is_running(child.pid)]
