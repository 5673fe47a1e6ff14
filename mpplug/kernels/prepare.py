"""Readying a program's functions before a run: all of them at once, on a pool of threads
(XLA compiles outside the GIL), with progress logged to the `mpplug` logger.

A kernel offers this by having a `prepare(pfunc, runtime)` attribute that fills its caches
before the first run, and may have a `tier_up(pfunc, runtime)` one that compiles what the
first run ran interpreted, once the program is hot (in the background, unless
`MPPLUG_TIER_UP=wait` makes the second run start them and wait), and a
`check(pfuncs, runtime)` one that does at once, before them, what is cheaper done for all of a
program's functions together (jax.exec checks their modules in one helper fork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait

from mpplug.core import PFunction, progress
from mpplug.kernels.pools import SharedPool
from mpplug.kernels.registry import REGISTRY
from mpplug.kernels.runtime import KernelRuntime

log = logging.getLogger("mpplug")

ENV_TIER_UP = "MPPLUG_TIER_UP"
ENV_TIER_UP_AFTER = "MPPLUG_TIER_UP_AFTER_S"
DEFAULT_TIER_UP_AFTER_S = 1.0
COMPILE_S_PER_FUNCTION = 0.1
"""About what XLA takes to compile one of a program's functions on a CPU core: a run turns
its program hot as it goes only once it has run as long as compiling its functions would."""

_COMPILES = SharedPool("mpplug-compile")
_BACKGROUND = SharedPool("mpplug-tier-up", spare=1)
"""Compiles no run waits for, on their own threads (one core left to the runs), so that a
new program's preparation never queues behind another program's tier-up."""
_exiting = threading.Event()
# Set as the interpreter starts to exit, before concurrent.futures joins its pools' threads
# (hooks run last registered first; its own was registered when `pools` imported it).
threading._register_atexit(_exiting.set)  # type: ignore[attr-defined]


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
        background = step == "tier_up" and not tier_up_waits()
        pool = (_BACKGROUND if background else _COMPILES).get()
        kernels: dict[object, list[PFunction]] = {}
        for pfunc in dict.fromkeys(pfuncs):
            try:
                found = REGISTRY.lookup(pfunc.fn_type)
            except Exception:  # an unknown fn_type: the run reports it, naming the op
                continue
            kernels.setdefault(found, []).append(pfunc)
        for kernel, group in kernels.items():
            ready = getattr(kernel, step, None)
            if ready is None:
                continue
            check = getattr(kernel, "check", None) if step == "prepare" else None
            first = pool.submit(_quietly, check, group, runtime) if check is not None else None
            for pfunc in group:  # queued after `first`, so it has started when they wait
                future = pool.submit(_quietly, ready, pfunc, runtime, first)
                future.add_done_callback(self._ended)
                self.futures.append(future)

    def _ended(self, future: Future[None]) -> None:
        self.finished_ns = max(self.finished_ns, time.time_ns())

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def cancel(self) -> None:
        """Drop the compiles that have not started (a closed party has no use for them)."""
        for future in self.futures:
            future.cancel()

    def wait(self, label: str) -> None:
        """Return once every compile has ended, logging how far they are at most once a
        second (across the threads waiting on programs named `label`)."""
        start = time.monotonic()
        pending = {f for f in self.futures if not f.done()}
        total = len(self.futures)
        while pending:
            _, pending = wait(pending, timeout=progress.EVERY_S)
            if pending:
                what = f"compiled {total - len(pending)} of {total} functions"
                progress.report(label, what, start)
        if time.monotonic() - start >= progress.EVERY_S:
            progress.report(label, f"compiled {total} functions", start, final=True)


def tier_up_waits() -> bool:
    """Whether a program's second run waits for the compiles it starts (`MPPLUG_TIER_UP=wait`,
    for measuring compiled runs from the second on); by default they go on in the background
    while runs use each function's compiled code as soon as it is there."""
    return os.environ.get(ENV_TIER_UP, "background").strip().lower() == "wait"


def tier_up_after_s() -> float:
    """Interpreted run time after which a program's compiles start in the background
    (`MPPLUG_TIER_UP_AFTER_S`, default 1 s, the runs before included; a run that reaches it
    starts them as it goes): a program whose runs are quick is not worth compiling until it
    has run for a while, as JIT runtimes count a function's calls before compiling it."""
    value = os.environ.get(ENV_TIER_UP_AFTER, "").strip()
    try:
        return max(0.0, float(value)) if value else DEFAULT_TIER_UP_AFTER_S
    except ValueError:
        raise ValueError(
            f"{ENV_TIER_UP_AFTER} must be a number of seconds, got {value!r}"
        ) from None


def _quietly(
    step: object,
    what: PFunction | list[PFunction],
    runtime: KernelRuntime,
    after: Future[None] | None = None,
) -> None:
    """`step(what, runtime)` once `after` has ended. Failures are left for the run to raise,
    where they name the op. Nothing starts once the process is exiting: the pool's queue is
    not worth the wait then."""
    if after is not None:
        wait([after])
    if _exiting.is_set():
        return
    try:
        step(what, runtime)  # type: ignore[operator]
    except Exception as exc:
        names = [p.fn_name for p in what] if isinstance(what, list) else what.fn_name
        log.debug("readying %s ahead failed (the run reports it): %s", names, exc)
