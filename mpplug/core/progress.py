"""Progress lines for long work (a program's compiles, a secure function's trace) on the
`mpplug` logger: at most one a second per label, and none for work that ends within it."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("mpplug")

EVERY_S = 1.0
"""At most one progress line a second per label, and none for what takes less."""

_last_line: dict[str, float] = {}
_lock = threading.Lock()


def report(label: str, what: str, start: float, final: bool = False) -> None:
    """Log "`label`: `what` (seconds since `start`)" unless a line for `label` went out less
    than `EVERY_S` ago (threads working on one label share it); a `final` line always goes
    out, and the next work under `label` starts afresh."""
    now = time.monotonic()
    with _lock:
        if not final and now - _last_line.get(label, 0.0) < EVERY_S:
            return
        _last_line[label] = now
        if final:
            _last_line.pop(label, None)
    log.info("%s: %s (%.1f s)", label, what, now - start)


class Steps:
    """Progress through `total` steps of one piece of work ("wrote 120 of 358 rounds"):
    nothing until it has run `EVERY_S`, then a line at most every `EVERY_S`, and a last line
    from `end` if it ran that long."""

    def __init__(self, label: str, verb: str, total: int, unit: str) -> None:
        self.label, self.verb, self.total, self.unit = label, verb, total, unit
        self.start = time.monotonic()

    def step(self, done: int) -> None:
        if time.monotonic() - self.start >= EVERY_S:
            report(self.label, f"{self.verb} {done} of {self.total} {self.unit}", self.start)

    def end(self) -> None:
        if time.monotonic() - self.start >= EVERY_S:
            report(self.label, f"{self.verb} {self.total} {self.unit}", self.start, final=True)
