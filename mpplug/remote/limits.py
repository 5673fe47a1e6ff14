"""The slots and stream watch that enforce a party's `ServerLimits` (set in mpplug.config): what
is over a limit is refused with RESOURCE_EXHAUSTED, and streams that stall are cancelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TypeVar

import grpc

from mpplug.remote.rpc import Exhausted

T = TypeVar("T")


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
