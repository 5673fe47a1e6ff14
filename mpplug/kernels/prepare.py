"""Readying a program's functions before a run: all of them at once, on a pool of threads
(XLA compiles outside the GIL), with progress logged to the `mpplug` logger.

A kernel offers this by having a `prepare(pfunc, runtime)` attribute that fills its caches
before the first run, and may have a `tier_up(pfunc, runtime)` one that compiles what the
first run ran interpreted, before the second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait

from mpplug.core import PFunction
from mpplug.kernels.pools import SharedPool
from mpplug.kernels.registry import REGISTRY
from mpplug.kernels.runtime import KernelRuntime

log = logging.getLogger("mpplug")

PROGRESS_EVERY_S = 1.0
"""At most one progress line a second per program, and none for what takes less."""

_COMPILES = SharedPool("mpplug-compile")
_last_line: dict[str, float] = {}
_progress_lock = threading.Lock()


class Preparation:
    """The compiles of one program's functions at one party, started together: each
    kernel's `step` ("prepare" or "tier_up")."""

    def __init__(
        self, pfuncs: Sequence[PFunction], runtime: KernelRuntime, step: str = "prepare"
    ) -> None:
        self.started_ns = self.finished_ns = time.time_ns()
        """When the compiles started, and when the last one ended (so far)."""
        self.reported = False
        """Whether a run has shown these compiles (in a profile) yet."""
        self.futures: list[Future[None]] = []
        for pfunc in dict.fromkeys(pfuncs):
            try:
                kernel = REGISTRY.lookup(pfunc.fn_type)
            except Exception:  # an unknown fn_type: the run reports it, naming the op
                continue
            ready = getattr(kernel, step, None)
            if ready is not None:
                future = _COMPILES.get().submit(_quietly, ready, pfunc, runtime)
                future.add_done_callback(self._ended)
                self.futures.append(future)

    def _ended(self, future: Future[None]) -> None:
        self.finished_ns = max(self.finished_ns, time.time_ns())

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, label: str) -> None:
        """Return once every compile has ended, logging how far they are at most once a
        second (across the threads waiting on programs named `label`)."""
        start = time.monotonic()
        pending = {f for f in self.futures if not f.done()}
        total = len(self.futures)
        while pending:
            _, pending = wait(pending, timeout=PROGRESS_EVERY_S)
            if pending:
                _progress(label, f"compiled {total - len(pending)} of {total} functions", start)
        if time.monotonic() - start >= PROGRESS_EVERY_S:
            _progress(label, f"compiled {total} functions", start, final=True)


def _progress(label: str, what: str, start: float, final: bool = False) -> None:
    now = time.monotonic()
    with _progress_lock:
        if not final and now - _last_line.get(label, 0.0) < PROGRESS_EVERY_S:
            return
        _last_line[label] = now
        if final:
            _last_line.pop(label, None)
    log.info("%s: %s (%.1f s)", label, what, now - start)


def _quietly(step: object, pfunc: PFunction, runtime: KernelRuntime) -> None:
    """Failures are left for the run to raise, where they name the op."""
    try:
        step(pfunc, runtime)  # type: ignore[operator]
    except Exception as exc:
        log.debug("compiling %s ahead failed (the run reports it): %s", pfunc.fn_name, exc)
