"""``hmakv kafka start|stop|status|fetch``: a local broker for the demo, benchmarks and CI.

``start`` prints only the bootstrap address on stdout, so ``BOOTSTRAP=$(hmakv kafka start)`` works.
One detached broker per cache dir (``HMAKV_CACHE_DIR``); its state file is what ``status`` and
``stop`` read. Exit codes: 0 done (``stop`` with nothing running included), 1 failed or, for
``status``, not running; 2 bad usage. A state file that is not a readable record (empty, cut
short, an older format) is an error naming it, exit 1, and is left for the user to delete: a
broker it once described may still run. A record whose pid now belongs to another process (the
broker's start time, kept in the record, differs) is stale and cleaned up like a dead broker's.
``start`` and ``stop`` hold a lock beside the state file while they read, act and record, so
concurrent ones take turns: of two starts, the second finds the first's broker.
"""

from __future__ import annotations

import argparse
import functools
import logging
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from hmakv.argtypes import add_command
from hmakv.kafka import (
    BrokerDist,
    BrokerStartError,
    DetachedBroker,
    JarFetchError,
    LocalBroker,
    StateFileError,
    StateLockError,
    broker_answers,
    fetch_jars,
    local_broker,
    state_file,
    state_lock,
)

log = logging.getLogger(__name__)

# What a broker's exit code looks like when SIGTERM (from `hmakv kafka stop`, say) ended it: the
# JVM's 128+15, Popen's -15 for a process the signal killed, or 0 from Tansu, which stops cleanly.
_STOPPED_EXIT_CODES = (0, 128 + signal.SIGTERM, -signal.SIGTERM)


HELP = "run a local single-node broker (Apache Kafka or Tansu) on 127.0.0.1"
DESCRIPTION = __doc__
EPILOG = None


def register(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="kafka_action", metavar="ACTION", required=True)
    _add_start(actions)
    actions.add_parser("stop", help="stop the broker `start` left running").set_defaults(func=stop)
    actions.add_parser(
        "status", help="exit 0 and print its address if the broker runs, else exit 1"
    ).set_defaults(func=status)
    actions.add_parser(
        "fetch", help="only download Apache Kafka's jars into the cache (Maven)"
    ).set_defaults(func=fetch)


def _add_start(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    start_parser = add_command(
        actions,
        "start",
        help="start a broker, wait until it is ready, print its bootstrap address",
        parent="kafka",
    )
    add = start_parser.add_argument
    add(
        "--dist", type=BrokerDist, choices=list(BrokerDist), default="tansu", help="broker software"
    )
    add("--port", type=int, help="listener port (default: a free one)")
    add(
        "--data-dir",
        type=_directory,
        help="keep config, log and (Apache) topics here; default: a temporary dir `stop` removes",
    )
    add("--timeout", type=float, default="120", help="seconds to wait for readiness")
    add("--foreground", action="store_true", help="stay attached; Ctrl-C or SIGTERM stops it")
    start_parser.set_defaults(func=start)


def _directory(text: str) -> Path:
    """A path that is a directory or can become one: a file there is bad input (exit 2)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return path


Action = Callable[[argparse.Namespace], int]


def _unreadable_state_fails(action: Action) -> Action:
    """An unreadable state file, or one that cannot be locked, ends ``action`` with its one-line
    message and exit 1."""

    @functools.wraps(action)
    def guarded(args: argparse.Namespace) -> int:
        try:
            return action(args)
        except (StateFileError, StateLockError) as error:
            log.error("%s", error)
            return 1

    return guarded


@_unreadable_state_fails
def start(args: argparse.Namespace) -> int:
    broker = local_broker(
        args.dist, port=args.port, data_dir=args.data_dir, startup_timeout_s=args.timeout
    )
    try:
        if args.foreground:
            return _run_in_foreground(broker)
        return _start_detached(broker)
    except (BrokerStartError, JarFetchError) as exc:
        log.error("%s", exc)
        return 1


def _start_detached(broker: LocalBroker) -> int:
    """Start and record the broker under the state lock, so no concurrent start can slip in."""
    with state_lock():
        if _refused_while_one_runs():
            return 1
        detached = broker.start_detached()
        _save_or_stop(detached)
    print(detached.bootstrap, flush=True)
    return 0


def _refused_while_one_runs() -> bool:
    """Whether the state file records a running broker, which is then named in the refusal."""
    running = _recorded_running_broker()
    if running is not None:
        log.error(
            "a %s broker already runs at %s (pid %d); `hmakv kafka stop` it first",
            running.dist,
            running.bootstrap,
            running.pid,
        )
    return running is not None


def _save_or_stop(record: DetachedBroker) -> None:
    """Record the broker; one that cannot be recorded is stopped, or `stop` could never find it."""
    try:
        record.save(state_file())
    except BaseException:
        record.stop()
        raise


def _recorded_running_broker() -> DetachedBroker | None:
    """The broker the state file records, if it still runs; a dead one's record is cleaned up."""
    recorded = DetachedBroker.load(state_file())
    if recorded is None or recorded.is_running():
        return recorded
    _forget(recorded)
    return None


def _run_in_foreground(broker: LocalBroker) -> int:
    """Serve until Ctrl-C or SIGTERM (both end in a clean stop), `hmakv kafka stop`, or until
    the broker dies."""
    previous_handler = signal.signal(signal.SIGTERM, _interrupt)
    try:
        record = _start_attached(broker)
        return 1 if record is None else _serve(broker, record)
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop()
        signal.signal(signal.SIGTERM, previous_handler)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _start_attached(broker: LocalBroker) -> DetachedBroker | None:
    """Start the broker for this process to hold, and record it, under the state lock; None if
    one already runs. The lock is not kept while serving: `hmakv kafka stop` needs it."""
    with state_lock():
        if _refused_while_one_runs():
            return None
        broker.start()
        record = broker.describe()
        record.save(state_file())
    return record


def _serve(broker: LocalBroker, record: DetachedBroker) -> int:
    print(broker.bootstrap, flush=True)
    try:
        exit_code = broker.wait()
    finally:
        with state_lock():
            _forget_if_current(record)
    if exit_code in _STOPPED_EXIT_CODES:
        return 0
    log.error("the %s broker exited with code %d; see %s", broker.dist, exit_code, broker.log_path)
    return 1


@_unreadable_state_fails
def stop(args: argparse.Namespace) -> int:
    with state_lock():
        running = _recorded_running_broker()
        if running is None:
            print("no broker running")
            return 0
        running.stop()
        _forget_if_current(running)
    print(f"stopped the {running.dist} broker at {running.bootstrap}")
    return 0


@_unreadable_state_fails
def status(args: argparse.Namespace) -> int:
    running = _recorded_running_broker()
    if running is None:
        print("not running")
        return 1
    if not broker_answers(running.bootstrap):
        print(f"not answering: pid {running.pid} runs but {running.bootstrap} does not respond")
        return 1
    print(
        f"{running.bootstrap} running "
        f"({running.dist}, pid {running.pid}, data dir {running.data_dir})"
    )
    return 0


def fetch(args: argparse.Namespace) -> int:
    try:
        print(fetch_jars())
    except JarFetchError as exc:
        log.error("%s", exc)
        return 1
    return 0


def _forget(recorded: DetachedBroker) -> None:
    """Drop the record of a broker that is gone, and its temporary data dir."""
    if recorded.owns_data_dir:
        shutil.rmtree(recorded.data_dir, ignore_errors=True)
    _forget_if_current(recorded)


def _forget_if_current(recorded: DetachedBroker) -> None:
    """Remove the state file unless it already describes another broker."""
    if DetachedBroker.load(state_file()) == recorded:
        state_file().unlink(missing_ok=True)
