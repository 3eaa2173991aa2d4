"""Log lines at a bounded rate: a flood (10,000 membership cards put or deleted at once,
undecodable frames on a request plane, challenges for a URL that is not ours) must not
become as many log lines.

``LogBudget(logger, per_s=5, burst=20)`` lets ``burst`` lines through at once and then
``per_s`` a second; the rest are counted, and the next line let through says how many
were left out since the last one (so the log still tells that something happened, and
how much).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class LogBudget:
    def __init__(self, logger: logging.Logger, per_s: float = 5.0, burst: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.per_s, self.burst, self.clock = logger, per_s, burst, clock
        self._tokens = float(burst)
        self._at = clock()
        #: lines left out since the last one logged
        self.left_out = 0

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log the line if the budget allows (True), else count it (False)."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens < 1.0:
            self.left_out += 1
            return False
        self._tokens -= 1.0
        if self.left_out:
            self.logger.log(level, msg + " (and %d similar line(s) left out before it: "
                            "more than %g a second)", *args, self.left_out, self.per_s)
            self.left_out = 0
        else:
            self.logger.log(level, msg, *args)
        return True

    def info(self, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, msg, *args)

    def warning(self, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, msg, *args)
