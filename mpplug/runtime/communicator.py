"""How a party exchanges values with its peers: the `Communicator` interface and a `Mailbox`.

Values are keyed by (execution id, op id, source, destination) so executions never mix.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mpplug.errors import CommTimeoutError, ExecutionAborted

ABORTED_MEMORY = 4096


@dataclass(frozen=True, slots=True)
class Key:
    """Where a value belongs: one op of one execution, from `src` to `dst`."""

    exec_id: str
    op: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.exec_id}/{self.op}/{self.src}->{self.dst}"


class Communicator(ABC):
    """A party's link to its peers: send is non-blocking, receive waits up to a timeout."""

    rank: int
    world_size: int

    @abstractmethod
    def send(self, key: Key, value: Any) -> None:
        """Deliver `value` to party `key.dst`."""

    @abstractmethod
    def recv(self, key: Key, timeout: float) -> Any:
        """The value sent to this party under `key`; CommTimeoutError after `timeout` s."""


class Mailbox:
    """Values delivered to one party, waiting to be received; executions can be aborted."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._values: dict[Key, Any] = {}
        self._aborted: OrderedDict[str, str] = OrderedDict()
        self._cond = threading.Condition()

    def deliver(self, key: Key, value: Any) -> None:
        with self._cond:
            if key.exec_id in self._aborted:
                return
            self._values[key] = value
            self._cond.notify_all()

    def take(self, key: Key, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                reason = self._aborted.get(key.exec_id)
                if reason is not None:
                    raise ExecutionAborted(
                        f"party {self.rank}: execution {key.exec_id} aborted ({reason})"
                    )
                if key in self._values:
                    return self._values.pop(key)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(self.rank, key.src, str(key), timeout)
                self._cond.wait(remaining)

    def abort(self, exec_id: str, reason: str) -> None:
        """Wake every receive of `exec_id` with ExecutionAborted and drop its values."""
        with self._cond:
            self._aborted[exec_id] = reason
            while len(self._aborted) > ABORTED_MEMORY:
                self._aborted.popitem(last=False)
            self._drop(exec_id)
            self._cond.notify_all()

    def finish(self, exec_id: str) -> None:
        """Drop values of a finished execution that nobody received."""
        with self._cond:
            self._drop(exec_id)

    def _drop(self, exec_id: str) -> None:
        for key in [k for k in self._values if k.exec_id == exec_id]:
            del self._values[key]

    def pending(self) -> int:
        with self._cond:
            return len(self._values)
