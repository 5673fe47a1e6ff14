"""How a party exchanges values with its peers: the `Communicator` interface and a `Mailbox`.

Values are keyed by (execution id, op, source, destination, region scope) so executions,
branches and loop iterations never mix.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, NamedTuple

from mpplug.errors import CommTimeoutError, ExecutionAborted, MPPlugError

ABORTED_MEMORY = 4096
"""How many aborted and finished executions a mailbox remembers, to drop late values for them."""

MAX_REASON_CHARS = 256
"""An abort reason is cut to this many characters (it is remembered and shown in errors)."""


class Key(NamedTuple):
    """Where a value belongs: one op of one execution, from `src` to `dst`.

    `scope` places the op inside COND and WHILE regions: (op, region, iteration) for each
    enclosing region op, outermost first, so every branch and iteration has its own keys.
    A tuple, so it hashes fast.
    """

    exec_id: str
    op: int
    src: int
    dst: int
    scope: tuple[int, ...] = ()

    def __str__(self) -> str:
        frames = "".join(
            ".".join(map(str, self.scope[i : i + 3])) + "/" for i in range(0, len(self.scope), 3)
        )
        return f"{self.exec_id}/{frames}{self.op}/{self.src}->{self.dst}"


class Communicator(ABC):
    """A party's link to its peers. `send` returns once the value is handed over (in memory,
    or delivered to the peer over the network, bounded by a deadline); `recv` waits up to a
    timeout. Neither may block forever."""

    rank: int
    world_size: int

    @abstractmethod
    def send(self, key: Key, value: Any) -> None:
        """Deliver `value` to party `key.dst`."""

    @abstractmethod
    def recv(self, key: Key, timeout: float) -> Any:
        """The value sent to this party under `key`; CommTimeoutError after `timeout` s."""

    @abstractmethod
    def check(self, exec_id: str) -> None:
        """Raise ExecutionAborted if `exec_id` was aborted here (a loop checks each step)."""


class MailboxFull(MPPlugError):
    """A source has more bytes waiting in a mailbox than it allows; the value is refused."""


class Mailbox:
    """Values delivered to one party, waiting to be received; executions can be aborted.

    Values of an execution that has finished or been aborted here are dropped, and so are
    later ones for it. Limits, both off by default: `max_pending_bytes` caps the bytes of
    values from one source that wait here or are reserved on their way (a delivery or
    reservation over it raises MailboxFull; a value is always let in when none of its
    source's wait, however large), and
    `unclaimed_ttl` drops values of an execution not started here (`start`) within that
    many seconds of its first value (`expire` does the dropping).
    """

    def __init__(
        self,
        rank: int,
        *,
        max_pending_bytes: int | None = None,
        unclaimed_ttl: float | None = None,
    ) -> None:
        self.rank = rank
        self.max_pending_bytes = max_pending_bytes
        self.unclaimed_ttl = unclaimed_ttl
        self._values: dict[str, dict[Key, tuple[Any, int]]] = {}
        self._bytes_from: dict[int, int] = {}
        self._started: set[str] = set()
        self._unclaimed: OrderedDict[str, float] = OrderedDict()  # first delivery, by exec id
        self._aborted: OrderedDict[str, str] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()

    def deliver(self, key: Key, value: Any, nbytes: int = 0, *, reserved: bool = False) -> None:
        """Hold `value` (of `nbytes` bytes, counted against its source) until taken; its
        bytes were counted already if `reserved` (see `reserve`)."""
        with self._cond:
            waiting = self._bytes_from.get(key.src, 0)
            if key.exec_id in self._aborted or key.exec_id in self._finished:
                if reserved:
                    self._bytes_from[key.src] = waiting - nbytes
                return
            if not reserved:
                self._check_room(key.src, waiting, nbytes, f"value {key}")
                waiting += nbytes
            values = self._values.setdefault(key.exec_id, {})
            old = values.get(key)
            self._bytes_from[key.src] = waiting - (old[1] if old else 0)
            values[key] = (value, nbytes)
            if key.exec_id not in self._started:
                self._unclaimed.setdefault(key.exec_id, time.monotonic())
            self._cond.notify_all()

    def reserve(self, src: int, nbytes: int, what: str) -> None:
        """Count `nbytes` from `src` as waiting from now on, for a value `what` still on its
        way, so that values arriving at once cannot pass the limit together; MailboxFull if
        they would not fit. Then `deliver(..., reserved=True)` or `release` it."""
        with self._cond:
            waiting = self._bytes_from.get(src, 0)
            self._check_room(src, waiting, nbytes, what)
            self._bytes_from[src] = waiting + nbytes

    def release(self, src: int, nbytes: int) -> None:
        """Give back a reservation whose value never came."""
        with self._cond:
            self._bytes_from[src] -= nbytes

    def _check_room(self, src: int, waiting: int, nbytes: int, what: str) -> None:
        cap = self.max_pending_bytes
        if cap is not None and waiting and waiting + nbytes > cap:
            raise MailboxFull(
                f"party {self.rank}: {what} ({nbytes} bytes) refused: party {src} already "
                f"has {waiting} bytes waiting here or on their way, the limit is {cap}"
            )

    def take(self, key: Key, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self.check(key.exec_id)
                values = self._values.get(key.exec_id)
                if values is not None and key in values:
                    value, nbytes = values.pop(key)
                    self._bytes_from[key.src] -= nbytes
                    if not values:
                        del self._values[key.exec_id]
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(self.rank, key.src, str(key), timeout)
                self._cond.wait(remaining)

    def check(self, exec_id: str) -> None:
        """Raise ExecutionAborted if `exec_id` was aborted here."""
        reason = self._aborted.get(exec_id)
        if reason is not None:
            raise ExecutionAborted(f"party {self.rank}: execution {exec_id} aborted ({reason})")

    def start(self, exec_id: str) -> None:
        """`exec_id` runs here now: its values wait until it finishes, whatever their age."""
        with self._cond:
            self._started.add(exec_id)
            self._unclaimed.pop(exec_id, None)

    def abort(self, exec_id: str, reason: str) -> None:
        """Wake every receive of `exec_id` with ExecutionAborted and drop its values."""
        with self._cond:
            self._aborted[exec_id] = reason[:MAX_REASON_CHARS]
            _forget_oldest(self._aborted)
            self._drop(exec_id)
            self._cond.notify_all()

    def finish(self, exec_id: str) -> None:
        """Drop values of a finished execution that nobody received, and any sent later."""
        with self._cond:
            self._finished[exec_id] = None
            _forget_oldest(self._finished)
            self._drop(exec_id)

    def expire(self) -> int:
        """Drop the values of executions not started here within `unclaimed_ttl` seconds of
        their first value; returns how many values were dropped."""
        if self.unclaimed_ttl is None:
            return 0
        cutoff = time.monotonic() - self.unclaimed_ttl
        dropped = 0
        with self._cond:
            while self._unclaimed:
                exec_id, first = next(iter(self._unclaimed.items()))
                if first > cutoff:
                    break
                dropped += len(self._values.get(exec_id, ()))
                self._drop(exec_id)
        return dropped

    def _drop(self, exec_id: str) -> None:
        self._started.discard(exec_id)
        self._unclaimed.pop(exec_id, None)
        for key, (_, nbytes) in self._values.pop(exec_id, {}).items():
            self._bytes_from[key.src] -= nbytes

    def pending(self) -> int:
        """How many values wait here."""
        with self._cond:
            return sum(len(values) for values in self._values.values())

    def pending_bytes(self, src: int) -> int:
        """The bytes of values from `src` that wait here (or are reserved)."""
        with self._cond:
            return self._bytes_from.get(src, 0)


def _forget_oldest(memory: OrderedDict[str, Any]) -> None:
    while len(memory) > ABORTED_MEMORY:
        memory.popitem(last=False)
