"""How much of a party its callers may hold: threads, sessions, executions and streams at once,
and how long a stream may sit idle. What is over a limit is refused with RESOURCE_EXHAUSTED.

A party serves from a fixed pool of threads. Executions and streaming calls can hold a thread
for long, so each kind has its own slots, and together they leave threads free for the short
calls (health, Status, Abort, single-message sends), so no kind of caller can starve another:
drivers' executions never take the threads peers need to hand them values.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from mpplug.errors import ConfigError
from mpplug.remote.rpc import Exhausted

T = TypeVar("T")

MIN_FREE_WORKERS = 8
"""Threads that executions and streams together can never hold: short calls always run."""


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one party server.

    - `workers`: threads serving calls; `max_rpcs`: calls at once, queued ones included
      (gRPC refuses more).
    - `sessions`: open sessions.
    - `executes`: Execute calls running at once.
    - `uploads`: Put and LoadProgram streams at once; `downloads`: Fetch streams at once.
    - `peer_streams`: Send streams from other parties at once.
    - `stream_idle_s`: a stream that moves no message for this long is cancelled.
    - `pending_bytes_per_peer`: bytes one peer's values may take up waiting to be received
      (one value of any size is let in when none of the peer's wait).
    - `unclaimed_value_s`: values for an execution that has not started here are dropped
      this long after the first of them arrives.
    """

    workers: int = 64
    max_rpcs: int = 256
    sessions: int = 1024
    executes: int = 16
    uploads: int = 8
    downloads: int = 8
    peer_streams: int = 20
    stream_idle_s: float = 60.0
    pending_bytes_per_peer: int = 4 << 30
    unclaimed_value_s: float = 600.0

    def __post_init__(self) -> None:
        counts = {
            "workers": self.workers,
            "max_rpcs": self.max_rpcs,
            "sessions": self.sessions,
            "executes": self.executes,
            "uploads": self.uploads,
            "downloads": self.downloads,
            "peer_streams": self.peer_streams,
            "pending_bytes_per_peer": self.pending_bytes_per_peer,
        }
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServerLimits.{name}: expected a positive int, got {value!r}")
        for name, seconds in [
            ("stream_idle_s", self.stream_idle_s),
            ("unclaimed_value_s", self.unclaimed_value_s),
        ]:
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ConfigError(f"ServerLimits.{name}: expected seconds > 0, got {seconds!r}")
        held = self.executes + self.uploads + self.downloads + self.peer_streams
        if held + MIN_FREE_WORKERS > self.workers:
            raise ConfigError(
                f"ServerLimits: executes + uploads + downloads + peer_streams = {held} must "
                f"leave {MIN_FREE_WORKERS} of the {self.workers} workers free for short calls"
            )
        if self.max_rpcs < self.workers:
            raise ConfigError(
                f"ServerLimits.max_rpcs: expected at least workers ({self.workers}), "
                f"got {self.max_rpcs}"
            )


class Slots:
    """At most `limit` calls of one kind at once; one more is refused, not queued."""

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    def take(self) -> None:
        """Take a slot; Exhausted (RESOURCE_EXHAUSTED) when all are taken."""
        if not self._free.acquire(blocking=False):
            raise Exhausted(
                f"this party is running {self.limit} {self.what} already, its limit; "
                f"try again when one has finished"
            )

    def give_back(self) -> None:
        self._free.release()

    def hold_for(self, context: grpc.ServicerContext) -> None:
        """Take a slot until the call `context` ends (its response stream too)."""
        self.take()
        if not context.add_callback(self.give_back):  # the call has ended already
            self.give_back()


class _Watched:
    """One stream's context and when it last moved a message."""

    __slots__ = ("context", "last")

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.last = time.monotonic()


class StreamWatch:
    """Streams that must keep moving: `sweep` cancels those idle for `idle_s` seconds."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._streams: dict[int, _Watched] = {}
        self._lock = threading.Lock()

    def watch(self, context: grpc.ServicerContext, messages: Iterator[T]) -> Iterator[T]:
        """`messages` (a request stream, or a response stream as it is sent), watched from
        now until it is exhausted or the call ends."""
        watched = _Watched(context)
        key = id(watched)
        with self._lock:
            self._streams[key] = watched
        context.add_callback(lambda: self._forget(key))
        return self._moving(key, watched, messages)

    def _moving(self, key: int, watched: _Watched, messages: Iterator[T]) -> Iterator[T]:
        try:
            for message in messages:
                watched.last = time.monotonic()
                yield message
        finally:
            self._forget(key)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def sweep(self) -> int:
        """Cancel every stream idle for longer than `idle_s`; returns how many."""
        cutoff = time.monotonic() - self.idle_s
        with self._lock:
            idle = [key for key, w in self._streams.items() if w.last < cutoff]
            cancelled = [self._streams.pop(key) for key in idle]
        for watched in cancelled:
            watched.context.cancel()
        return len(cancelled)

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)
