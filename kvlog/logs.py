"""Logs an operator can use: one line per incident with its cause, and JSON when asked.

A misbehaving engine can send thousands of bad frames a second; ``RateLimitedLog`` writes the
first of each kind at once and then at most one line per interval, saying how many it held back,
so the log shows every kind of trouble without drowning in one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class Throttle:
    """One pass per kind per ``interval`` seconds; ``passes`` says how many it held back since
    the last, or None to hold this one back too."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def passes(self, kind: str) -> int | None:
        now = self._clock()
        if now - self._last.get(kind, float("-inf")) < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._held.pop(kind, 0)


class RateLimitedLog:
    """``level``: WARNING, or lower for incidents that are expected history (the index reading
    older lives' states while it catches up)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        level: int = logging.WARNING,
    ) -> None:
        self._logger = logger
        self._throttle = Throttle(interval, clock)
        self._level = level

    def warning(
        self,
        kind: str,
        message: str,
        *args: object,
        error: BaseException | None = None,
        **fields: object,
    ) -> None:
        held = self._throttle.passes(kind)
        if held is None:
            return
        interval = self._throttle.interval
        suffix = f" ({held} more like it in the last {interval:g} s)" if held else ""
        extra = {"kind": kind, **fields}
        self._logger.log(self._level, message + suffix, *args, exc_info=error, extra=extra)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((key, value) for key, value in record.__dict__.items() if key not in _RESERVED)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)
